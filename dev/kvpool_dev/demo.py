"""`kvpool demo` (`make demo`): the main job on one machine.

Starts vLLM's OpenAI-compatible server on the generated `bench` model twice, once as is and
once with the kvpool connector (cpu + disk tiers; plus Redis when REDIS_URL is set), and
runs the same multi-turn chat workload against each with the `openai` client: several users,
each with a long document in the system prompt, take turns in rounds, so the engine's own
(deliberately small) KV cache keeps evicting the other users' history. Without kvpool every
turn recomputes its history; with it the history comes back from the pool. Prints TTFT
p50/p95, throughput and hit rates (vLLM's local prefix cache, kvpool per tier, from the
server's /metrics) and writes a PNG chart (default out/demo.png).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from kvpool_dev.bench import kv_configs
from kvpool_dev.testbed.localmodel import kv_bytes_per_token

REDIS_PASSWORD_ENV = "KVPOOL_DEMO_REDIS_PASSWORD"
BLOCK_TOKENS = 128   # vLLM's block size on its CPU platform

_WORDS = (  # noqa: SIM905 -- one string reads as the word list it is
    "cache key value tensor layer token prefix chunk tier memory disk redis bucket object "
    "engine request latency throughput model attention head block page eviction shard node "
    "cluster replica operator volume network bandwidth queue batch stream kernel buffer host "
    "device copy load store hit miss warm cold fleet pool tenant prompt answer summary report "
    "the a of to in and for with on by from is are was were this that these those it its"
).split()


@dataclass(frozen=True)
class Settings:
    """Workload shape; `quick` is a small version for tests."""

    preset: str = "bench"
    conversations: int = 8
    turns: int = 4
    doc_tokens: int = 1500
    question_tokens: int = 40
    max_tokens: int = 24
    concurrency: int = 2
    kv_cache_tokens: int = 4096    # the engine's own KV cache: about 2 conversations
    max_model_len: int = 4096
    cpu_tier_conversations: float = 3.5  # kvpool's cpu tier holds about this many; disk the rest

    @staticmethod
    def quick() -> Settings:
        return Settings(preset="tiny", conversations=4, turns=3, doc_tokens=600,
                        question_tokens=24, max_tokens=8, concurrency=2,
                        kv_cache_tokens=1536, max_model_len=1536, cpu_tier_conversations=1.5)

    def conversation_tokens(self) -> int:
        """Prompt tokens of a conversation's last turn (upper estimate: the chat template's
        few tokens per message are inside the slack of the question/answer counts)."""
        return self.doc_tokens + self.turns * (self.question_tokens + self.max_tokens + 8)


# Minimum workload the demo shrinks to on a slow machine (it never grows one)
MIN_CONVERSATIONS, MIN_TURNS = 4, 3
BUDGET_S = 300.0          # `make demo` after setup, model generation and boot included
# What the arms took over what the probe's figures predict: longer histories prefill slower
# than the probe's one document, and two requests in flight do not halve decode time
# (measured 1.3 with the bench model in float32 on a 2-core AVX2 EPYC)
ESTIMATE_SLACK = 1.3


@dataclass
class TurnResult:
    conversation: int
    turn: int
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass
class RunResult:
    label: str
    wall_s: float
    turns: list[TurnResult] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)


# -- pure parts -----------------------------------------------------------------------------


def make_text(rng: random.Random, n_tokens: int, count_tokens) -> str:
    """Random words until the tokenizer counts at least n_tokens."""
    words: list[str] = []
    step = max(8, n_tokens // 4)
    while True:
        words += [rng.choice(_WORDS) for _ in range(step)]
        text = " ".join(words)
        if count_tokens(text) >= n_tokens:
            return text


def build_workload(s: Settings, count_tokens, seed: int = 0) -> list[dict[str, Any]]:
    """Per conversation: a system document and the user's questions (deterministic)."""
    rng = random.Random(seed)
    return [{"system": f"Document {c}. " + make_text(rng, s.doc_tokens, count_tokens),
             "questions": [f"Question {t + 1}: " + make_text(rng, s.question_tokens, count_tokens)
                           for t in range(s.turns)]}
            for c in range(s.conversations)]


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def parse_metrics(text: str) -> dict[str, Any]:
    """Hit counters from a vLLM server's Prometheus text (summed over engine labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    per_tier: dict[str, dict[str, float]] = {}
    by_source: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name == "vllm:prompt_tokens_cached_by_source_total":
                src = sample.labels.get("source", "")
                by_source[src] = by_source.get(src, 0.0) + sample.value
            elif name.startswith("kvpool_tier_") and name.endswith("_total") and "tier" in sample.labels:
                kind = name[len("kvpool_tier_"):-len("_total")]
                tier = per_tier.setdefault(sample.labels["tier"], {})
                tier[kind] = tier.get(kind, 0.0) + sample.value
            elif name.endswith("_total"):
                sums[name] = sums.get(name, 0.0) + sample.value

    def ratio(hits: str, queries: str) -> float | None:
        q = sums.get(queries, 0.0)
        return sums.get(hits, 0.0) / q if q else None

    return {
        "local_hit_rate": ratio("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
        "external_hit_rate": ratio("vllm:external_prefix_cache_hits_total",
                                   "vllm:external_prefix_cache_queries_total"),
        "prompt_tokens": sums.get("vllm:prompt_tokens_total"),
        "external_hit_tokens": sums.get("vllm:external_prefix_cache_hits_total", 0.0),
        "cached_tokens_by_source": by_source,
        "connector": {k: sums.get(f"kvpool_{k}_total", 0.0) for k in
                      ("saved_chunks", "loaded_chunks", "load_error_chunks", "lookups")},
        "tiers": {name: {"hit_chunks": v.get("hit_chunks", 0.0),
                         "miss_chunks": v.get("miss_chunks", 0.0),
                         "hit_rate": (v.get("hit_chunks", 0.0)
                                      / (v.get("hit_chunks", 0.0) + v.get("miss_chunks", 0.0))
                                      if v.get("hit_chunks", 0.0) + v.get("miss_chunks", 0.0)
                                      else None)}
                  for name, v in per_tier.items()},
    }


def turn_prompt_tokens(s: Settings, turn: int) -> int:
    """Estimated prompt tokens of a conversation's turn (0-based): the document, every
    question so far and every earlier answer, plus a few template tokens per message."""
    return s.doc_tokens + (turn + 1) * (s.question_tokens + 4) + turn * (s.max_tokens + 4)


def estimate_seconds(s: Settings, prefill_tps: float, decode_s: float,
                     chunk_tokens: int = 256) -> dict[str, float]:
    """Expected workload time per arm from measured prefill tokens/s and seconds per decoded
    token (pure). Without kvpool every turn recomputes its history (an upper bound: vLLM's own
    cache serves the last conversation or two); with it, turns after the first compute their
    new text and the partial last chunk."""
    full = sum(turn_prompt_tokens(s, k) for k in range(s.turns)) * s.conversations
    new = (turn_prompt_tokens(s, 0) + (s.turns - 1) * (
        s.question_tokens + s.max_tokens + 8 + chunk_tokens // 2)) * s.conversations
    decode = s.conversations * s.turns * s.max_tokens * decode_s / max(1, s.concurrency)
    return {"without": (full / prefill_tps + decode) * ESTIMATE_SLACK,
            "with": (new / prefill_tps + decode) * ESTIMATE_SLACK}


def fit_workload(s: Settings, prefill_tps: float, decode_s: float, budget_s: float) -> Settings:
    """The largest workload no bigger than `s` expected to run within `budget_s` (both arms),
    shrinking conversations first, then turns, down to MIN_CONVERSATIONS x MIN_TURNS (pure)."""
    def total(x: Settings) -> float:
        return sum(estimate_seconds(x, prefill_tps, decode_s).values())

    while total(s) > budget_s:
        if s.conversations > MIN_CONVERSATIONS:
            s = replace(s, conversations=s.conversations - 1)
        elif s.turns > MIN_TURNS:
            s = replace(s, turns=s.turns - 1)
        else:
            break
    return s


def visit_order(conversations: int, turn: int) -> list[int]:
    """Conversations in a round: forward on even turns, backward on odd ones, so each round
    starts with the ones served last: vLLM's own cache holds the last one or two, kvpool's cpu
    tier the next few, its disk tier the rest (pure)."""
    order = list(range(conversations))
    return order if turn % 2 == 0 else order[::-1]


def arm_order(turn: int) -> tuple[int, int]:
    """Which arm runs its round first: they alternate (ABBA), so drift on a shared machine
    falls on both (pure)."""
    return (0, 1) if turn % 2 == 0 else (1, 0)


def cpu_tier_bytes(s: Settings, bytes_per_token: int, chunk_tokens: int = 256) -> int:
    """A cpu tier holding about `cpu_tier_conversations` conversations' chunks, so the
    disk tier below it serves the rest (pure)."""
    chunks = -(-s.conversation_tokens() // chunk_tokens)
    return int(s.cpu_tier_conversations * chunks * chunk_tokens * bytes_per_token * 1.05) + (1 << 20)


def summarize(run: RunResult) -> dict[str, Any]:
    ttfts = [t.ttft_s for t in run.turns]
    prompt = sum(t.prompt_tokens for t in run.turns)
    return {
        "label": run.label,
        "requests": len(run.turns),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p95_s": percentile(ttfts, 95),
        "ttft_by_turn_s": [statistics.median(t.ttft_s for t in run.turns if t.turn == k)
                           for k in sorted({t.turn for t in run.turns})],
        "requests_per_s": len(run.turns) / run.wall_s if run.wall_s else None,
        "output_tokens_per_s": (sum(t.completion_tokens for t in run.turns) / run.wall_s
                                if run.wall_s else None),
        "cached_tokens": sum(t.cached_tokens for t in run.turns),
        "cached_token_share": sum(t.cached_tokens for t in run.turns) / prompt if prompt else None,
        "wall_s": run.wall_s,
        "metrics": run.metrics,
    }


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _ratio(base: float | None, pool: float | None) -> str:
    if not pool or not base:
        return ""
    r = base / pool
    return f"({r:.1f}x faster)" if r >= 1 else f"({1 / r:.1f}x slower)"


def render(base: dict[str, Any], pool: dict[str, Any], s: Settings, tiers: list[str],
           machine: str = "") -> str:
    """The side-by-side text report (pure)."""
    rows = [
        ("TTFT p50", f"{base['ttft_p50_s']:.3f} s",
         f"{pool['ttft_p50_s']:.3f} s {_ratio(base['ttft_p50_s'], pool['ttft_p50_s'])}"),
        ("TTFT p95", f"{base['ttft_p95_s']:.3f} s",
         f"{pool['ttft_p95_s']:.3f} s {_ratio(base['ttft_p95_s'], pool['ttft_p95_s'])}"),
    ]
    for k, (b, p) in enumerate(zip(base["ttft_by_turn_s"], pool["ttft_by_turn_s"], strict=True)):
        note = "  nothing cached yet" if k == 0 else ""
        rows.append((f"  TTFT p50, turn {k + 1}", f"{b:.3f} s", f"{p:.3f} s {_ratio(b, p)}{note}"))
    rows += [
        ("throughput", f"{base['requests_per_s']:.2f} req/s, {base['output_tokens_per_s']:.1f} tok/s",
         f"{pool['requests_per_s']:.2f} req/s, {pool['output_tokens_per_s']:.1f} tok/s"),
        ("time serving", f"{base['wall_s']:.1f} s", f"{pool['wall_s']:.1f} s"),
        ("prompt tokens cached", _pct(base["cached_token_share"]), _pct(pool["cached_token_share"])),
        ("  vLLM prefix cache", _pct(base["metrics"].get("local_hit_rate")),
         _pct(pool["metrics"].get("local_hit_rate"))),
        ("  kvpool (external)", "-", _pct(pool["metrics"].get("external_hit_rate"))),
    ]
    for tier in tiers:
        t = pool["metrics"].get("tiers", {}).get(tier) or {"hit_chunks": 0, "hit_rate": None}
        reads = ("no reads reached it" if t["hit_rate"] is None
                 else f"{_pct(t['hit_rate'])} of its reads")
        cell = f"{t['hit_chunks']:.0f} chunks served ({reads})"
        rows.append((f"  kvpool {tier} tier", "-", cell))
    head = (f"kvpool demo: {s.conversations} conversations x {s.turns} turns, concurrency "
            f"{s.concurrency}, ~{s.doc_tokens}-token documents, engine KV cache "
            f"{s.kv_cache_tokens} tokens; the two servers took turns round by round")
    if machine:
        head += f"\n{machine}"
    w = max(len(r[1]) for r in rows) + 2
    lines = [head, "", f"{'':<24}{'without kvpool':<{w}}with kvpool ({'+'.join(tiers)})"]
    lines += [f"{a:<24}{b:<{w}}{c}" for a, b, c in rows]
    return "\n".join(lines)


def chart(base: dict[str, Any], pool: dict[str, Any], tiers: list[str], path: Path,
          title: str = "kvpool demo: multi-turn chat on vLLM") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = ("#9e9e9e", "#1f77b4")
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    ax = axes[0][0]
    xs = range(2)
    for i, (run, color) in enumerate(zip((base, pool), colors, strict=True)):
        ax.bar([x + i * 0.38 for x in xs], [run["ttft_p50_s"], run["ttft_p95_s"]], 0.38,
               color=color, label=("without kvpool", "with kvpool")[i])
    ax.set_xticks([x + 0.19 for x in xs], ["TTFT p50", "TTFT p95"])
    ax.set_ylabel("seconds")
    ax.set_title("Time to first token")
    ax.legend()
    ax = axes[0][1]
    for run, color, label in zip((base, pool), colors, ("without kvpool", "with kvpool"), strict=True):
        turns = range(1, len(run["ttft_by_turn_s"]) + 1)
        ax.plot(list(turns), run["ttft_by_turn_s"], marker="o", color=color, label=label)
    ax.set_xticks(list(range(1, len(base["ttft_by_turn_s"]) + 1)))
    ax.set_xlabel("turn (turn 1: nothing cached yet)")
    ax.set_ylabel("TTFT p50 (s)")
    ax.set_title("TTFT by conversation turn")
    ax.legend()
    ax = axes[1][0]
    vals = [base["output_tokens_per_s"], pool["output_tokens_per_s"]]
    ax.bar(["without kvpool", "with kvpool"], vals, color=colors)
    ax.set_ylabel("output tokens / s")
    ax.set_title("Throughput")
    ax = axes[1][1]
    names = ["vLLM prefix cache", "kvpool (all tiers)"] + [f"kvpool {t}" for t in tiers]
    m = pool["metrics"]
    rates = [m.get("local_hit_rate") or 0.0, m.get("external_hit_rate") or 0.0]
    rates += [(m.get("tiers", {}).get(t) or {}).get("hit_rate") or 0.0 for t in tiers]
    base_rates = [base["metrics"].get("local_hit_rate") or 0.0] + [0.0] * (len(names) - 1)
    ys = range(len(names))
    ax.barh([y + 0.38 for y in ys], base_rates, 0.38, color=colors[0], label="without kvpool")
    ax.barh(list(ys), rates, 0.38, color=colors[1], label="with kvpool")
    ax.set_yticks([y + 0.19 for y in ys], names)
    ax.set_xlim(0, 1)
    ax.set_xlabel("hit rate")
    ax.set_title("Hit rates (server /metrics)")
    ax.legend(loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def redis_from_env(url: str | None) -> tuple[dict[str, Any], dict[str, str]] | None:
    """REDIS_URL -> (tier config, env for the engine); a password in the URL moves to env."""
    if not url:
        return None
    parts = urlsplit(url)
    env: dict[str, str] = {}
    password = parts.password or os.environ.get("REDIS_PASSWORD")
    if parts.password:
        host = parts.hostname + (f":{parts.port}" if parts.port else "")
        user = f"{parts.username}@" if parts.username else ""
        url = urlunsplit((parts.scheme, user + host, parts.path, parts.query, parts.fragment))
    if password:
        env[REDIS_PASSWORD_ENV] = password
    return kv_configs.redis_tier(url, REDIS_PASSWORD_ENV if password else None), env


# -- I/O shell ------------------------------------------------------------------------------


def _chat_turn(client, history: list[dict[str, str]], max_tokens: int,
               extra_headers: dict | None = None, extra_body: dict | None = None
               ) -> tuple[str, dict]:
    """One streamed chat turn; TTFT is the arrival of the first generated token. vLLM
    streams a chunk per token only with `return_token_ids` (otherwise it holds back tokens
    that decode to no visible text yet, which a random-weight model produces often)."""
    t0 = time.perf_counter()
    ttft = None
    text = []
    usage = None
    stream = client.chat.completions.create(
        model="local", messages=history, max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_headers=extra_headers,
        extra_body={"return_token_ids": True, **(extra_body or {})})
    for chunk in stream:
        choice = chunk.choices[0] if chunk.choices else None
        if choice is not None and (choice.delta.content or choice.finish_reason
                                   or getattr(choice, "token_ids", None)):
            if ttft is None:
                ttft = time.perf_counter() - t0
            text.append(choice.delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage
    latency = time.perf_counter() - t0
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    return "".join(text), {
        "ttft_s": ttft if ttft is not None else latency, "latency_s": latency,
        "prompt_tokens": usage.prompt_tokens if usage else 0,
        "completion_tokens": usage.completion_tokens if usage else 0,
        "cached_tokens": (getattr(details, "cached_tokens", 0) or 0) if details else 0}


class Arm:
    """One server's side of the demo: its client, conversation histories and results."""

    def __init__(self, server, label: str, workload: list[dict[str, Any]]) -> None:
        from openai import OpenAI

        self.server, self.label = server, label
        self.client = OpenAI(base_url=server.base_url + "/v1", api_key="kvpool-demo",
                             timeout=900, max_retries=0)
        self.histories = [[{"role": "system", "content": c["system"]}] for c in workload]
        self.result = RunResult(label=label, wall_s=0.0)


def probe(arm: Arm, s: Settings, count_tokens) -> tuple[float, float]:
    """(prefill tokens/s, seconds per decoded token) of one chat turn on a document nobody
    asks about again, so it warms the server up without helping either arm."""
    doc = make_text(random.Random(99), s.doc_tokens, count_tokens)
    _, m = _chat_turn(arm.client, [{"role": "system", "content": "Probe. " + doc},
                                   {"role": "user", "content": "Summarise."}], s.max_tokens)
    decode = (m["latency_s"] - m["ttft_s"]) / max(1, m["completion_tokens"] - 1)
    return m["prompt_tokens"] / max(m["ttft_s"], 1e-3), decode


def run_rounds(arms: list[Arm], workload: list[dict[str, Any]], s: Settings, bar) -> None:
    """Round k is every conversation's turn k (s.concurrency at a time, in visit_order); the
    two arms take turns round by round, in alternating order."""
    lock = threading.Lock()

    def one(arm: Arm, c: int, k: int) -> None:
        hist = arm.histories[c]
        hist.append({"role": "user", "content": workload[c]["questions"][k]})
        answer, m = _chat_turn(arm.client, hist, s.max_tokens)
        hist.append({"role": "assistant", "content": answer})
        with lock:
            arm.result.turns.append(TurnResult(conversation=c, turn=k, **m))
            bar.update(1)

    for k in range(s.turns):
        for a in arm_order(k):
            arm = arms[a]
            bar.set_description(f"turn {k + 1}/{s.turns} {arm.label:<14}")
            t0 = time.perf_counter()
            with ThreadPoolExecutor(max_workers=s.concurrency) as pool:
                list(pool.map(lambda c, arm=arm, k=k: one(arm, c, k), visit_order(s.conversations, k)))
            arm.result.wall_s += time.perf_counter() - t0


def _server(model: Path, s: Settings, kv_cfg: dict | None, env: dict[str, str], label: str,
            log_dir: Path, dtype: str):
    from kvpool_dev.testbed.engine import VllmServer

    # vLLM keeps one block back (the null block): a longest request needs one more
    blocks = max(s.kv_cache_tokens // BLOCK_TOKENS, -(-s.max_model_len // BLOCK_TOKENS) + 1)
    return VllmServer(model, kv_transfer_config=kv_cfg, env=env, max_model_len=s.max_model_len,
                      extra_args=["--num-gpu-blocks-override", str(blocks)], dtype=dtype,
                      log_path=log_dir / f"vllm-{label.replace(' ', '-')}.log")


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _serve_both(model: Path, s: Settings, kv_cfg: dict, env: dict[str, str],
                workload_for, log_dir: Path, dtype: str, count_tokens, t_start: float,
                fit: bool) -> tuple[Settings, RunResult, RunResult]:
    """Both servers boot at the same time and stay up; a probe on one sizes the workload to
    the time left, then the arms take turns round by round."""
    from tqdm import tqdm

    labels = ("without kvpool", "with kvpool")
    servers = [_server(model, s, cfg, env, label, log_dir, dtype)
               for cfg, label in zip((None, kv_cfg), labels, strict=True)]
    t0 = time.monotonic()
    _say("starting two vLLM servers (without and with kvpool) ...")
    try:
        for server in servers:
            server.launch()
        for server, label in zip(servers, labels, strict=True):
            server.wait_ready()
            _say(f"vLLM ({label}) up in {time.monotonic() - t0:.0f}s at {server.base_url}")
        arms = [Arm(server, label, []) for server, label in zip(servers, labels, strict=True)]
        rates = [probe(arm, s, count_tokens) for arm in arms]
        prefill_tps = statistics.mean(r[0] for r in rates)
        decode_s = statistics.mean(r[1] for r in rates)
        left = BUDGET_S - (time.monotonic() - t_start) - 15  # the report and chart
        asked = s
        if fit:
            s = fit_workload(s, prefill_tps, decode_s, left)
        expected = sum(estimate_seconds(s, prefill_tps, decode_s).values())
        _say(f"this machine: {prefill_tps:.0f} prefill tokens/s, {decode_s * 1000:.0f} ms per "
             f"output token; workload {s.conversations} conversations x {s.turns} turns, "
             f"expected ~{expected / 60:.1f} min")
        if s != asked:
            _say(f"  (shrunk from {asked.conversations} x {asked.turns}, expected "
                 f"~{sum(estimate_seconds(asked, prefill_tps, decode_s).values()) / 60:.1f} min, "
                 f"to finish within {BUDGET_S / 60:.0f} minutes; --no-fit runs it whole)")
        workload = workload_for(s)
        arms = [Arm(server, label, workload) for server, label in zip(servers, labels, strict=True)]
        bar = tqdm(total=2 * s.conversations * s.turns, unit="turn", file=sys.stderr)
        run_rounds(arms, workload, s, bar)
        bar.close()
        for arm in arms:
            arm.result.metrics = parse_metrics(arm.server.metrics())
    finally:
        for server in servers:
            server.stop()
    return s, arms[0].result, arms[1].result


def machine_line(model: Path, dtype: str) -> str:
    """'bench model (8 layers, hidden 1024), float32, AMD EPYC, 2 CPUs' for titles."""
    from kvpool_dev.testbed.dtype import cpu_model, read_cpuinfo

    cfg = json.loads((model / "config.json").read_text())
    return (f"{model.name.split('-')[0]} model ({cfg['num_hidden_layers']} layers, hidden "
            f"{cfg['hidden_size']}), {dtype}, {cpu_model(read_cpuinfo())}, "
            f"{os.cpu_count()} CPUs")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvpool demo", description=__doc__.split("\n\n")[1])
    ap.add_argument("--quick", action="store_true", help="tiny model, 4 conversations x 3 turns")
    ap.add_argument("--model", default=None, help="model path (default: the generated model)")
    ap.add_argument("--conversations", type=int, default=None)
    ap.add_argument("--turns", type=int, default=None)
    ap.add_argument("--concurrency", type=int, default=None)
    ap.add_argument("--dtype", default=None, help="engine dtype (default: bfloat16 where the "
                    "CPU has it natively, else float32; env KVPOOL_DTYPE)")
    ap.add_argument("--no-fit", action="store_true", help="run the workload whole even when "
                    "this machine would take longer than 5 minutes")
    ap.add_argument("--out", default="out/demo.png", help="PNG chart path (default out/demo.png)")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    args = ap.parse_args(argv)
    t_start = time.monotonic()

    from kvpool_dev.testbed.dtype import DtypeError, choose, engine_dtype
    from kvpool_dev.testbed.localmodel import ensure_model

    if not kv_configs.kvpool_connector_available():
        print("kvpool demo: kvpool_connector.vllm.KVPoolConnector does not import "
              "(is vLLM installed? run `make setup`)", file=sys.stderr)
        return 2
    try:
        dtype = engine_dtype(args.dtype)
        _say(f"kvpool demo: {args.dtype and 'engine dtype: ' + dtype + ' (--dtype)' or choose().describe()}")
    except DtypeError as exc:
        print(f"kvpool demo: {exc}", file=sys.stderr)
        return 2
    s = Settings.quick() if args.quick else Settings()
    overrides = {k: v for k in ("conversations", "turns", "concurrency")
                 if (v := getattr(args, k)) is not None}
    if overrides:
        s = replace(s, **overrides)
    _say(f"two vLLM servers, with and without kvpool, take turns on a {s.conversations}-"
         f"conversation chat; about {2 if args.quick else 4} minutes on 2 cores (never more "
         f"than ~{BUDGET_S / 60:.0f}: a probe sizes the workload to this machine)")
    _say(f"preparing model ({s.preset}) ...")
    model = Path(args.model) if args.model else ensure_model(s.preset)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    count_tokens = lambda text: len(tok.encode(text).ids)  # noqa: E731
    config = json.loads((model / "config.json").read_text())

    work = Path(tempfile.mkdtemp(prefix="kvpool-demo-"))
    cpu_bytes = cpu_tier_bytes(s, kv_bytes_per_token(config, dtype))
    tiers = [kv_configs.cpu_tier(f"{-(-cpu_bytes // (1 << 20))}Mi"),
             kv_configs.disk_tier(str(work / "disk"), "4Gi")]
    env: dict[str, str] = kv_configs.pool_key_env()
    redis = redis_from_env(os.environ.get("REDIS_URL"))
    if redis is not None:
        tiers.append(redis[0])
        env.update(redis[1])
    tier_names = [t["type"] for t in tiers]
    kv_cfg = kv_configs.kvpool_config(tiers, namespace=f"demo-{uuid.uuid4().hex[:8]}")
    out = Path(args.out)
    machine = machine_line(model, dtype)
    try:
        s, base_run, pool_run = _serve_both(
            model, s, kv_cfg, env, lambda x: build_workload(x, count_tokens), work, dtype,
            count_tokens, t_start, fit=not args.no_fit)
        base, pool = summarize(base_run), summarize(pool_run)
    except (RuntimeError, TimeoutError) as exc:
        print(f"kvpool demo: {exc}", file=sys.stderr)
        return 1
    finally:
        logs = out.parent / "demo-logs"
        logs.mkdir(parents=True, exist_ok=True)
        for log in work.glob("*.log"):
            shutil.copy(log, logs / log.name)
        shutil.rmtree(work, ignore_errors=True)
    print(render(base, pool, s, tier_names, machine))
    chart(base, pool, tier_names, out, title=f"kvpool demo: multi-turn chat on vLLM\n{machine}")
    print(f"\nchart: {out}  (whole demo: {time.monotonic() - t_start:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": asdict(s), "tiers": tier_names,
                                               "dtype": dtype, "machine": machine,
                                               "without": base, "with": pool}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
