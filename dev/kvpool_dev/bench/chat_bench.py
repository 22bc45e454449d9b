"""`kvpool bench chat`: multi-turn chat with token-exact history, per turn, four arms.

A scaled-down multi-turn workload on a real OpenAI-compatible vLLM server (CPU platform):
conversations x turns, a long first turn, short answers, an engine KV cache that holds
about two conversations, rounds of turns (every conversation's turn k, then turn k+1) so
the engine's own cache has evicted a conversation before its next turn. History is
token-exact: each turn's prompt is the previous prompt + every generated token id + the new
tokens, sent as prompt token ids through the completions API (what agent frameworks do), so
no re-tokenization changes an id. Arms, one server each, one after another:
  plain    vLLM alone (its prefix cache)
  chunks   kvpool, full prompt chunks only (save_decode_tokens and tail_objects off)
  tails    kvpool with tail objects and decode KV (the defaults)
  native   vLLM's native offloading (OffloadingConnector, kvpool's spec), the anchor
Per turn index: prompt tokens computed (prompt - cached, from the usage of each response),
TTFT p50 (first streamed token); per arm the cached tokens by vLLM's hit source. A
benchmark, not a timed test: the numbers of one run, side by side.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import shutil
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvpool_dev.bench import kv_configs

ARMS = ("plain", "chunks", "tails", "native")
BLOCK_TOKENS = 128  # vLLM's block size on its CPU platform
GOAL_TTFT_X = 2.0   # TTFT p50 of turns 2+: chunks arm / tails arm


@dataclass(frozen=True)
class Settings:
    preset: str = "bench"
    conversations: int = 6
    turns: int = 6
    first_tokens: tuple[int, int] = (1024, 2048)
    new_tokens: tuple[int, int] = (64, 128)
    answer_tokens: tuple[int, int] = (32, 48)
    concurrency: int = 2
    kv_cache_tokens: int = 6144  # the engine's paged cache: about two conversations
    max_model_len: int = 4096
    cpu_tier: str = "1Gi"
    chunk_tokens: int = 256

    @staticmethod
    def quick() -> Settings:
        return Settings(preset="tiny", conversations=3, turns=3, first_tokens=(300, 500),
                        new_tokens=(24, 40), answer_tokens=(8, 16), kv_cache_tokens=1536,
                        max_model_len=1536, cpu_tier="256Mi")


# -- pure parts -------------------------------------------------------------------------------


def workload(s: Settings, seed: int = 0) -> list[dict[str, Any]]:
    """Per conversation: the first prompt's ids, each later turn's new ids, each answer's
    length (random ids below 2000: every model's vocabulary has them)."""
    rng = random.Random(seed)

    def ids(lo_hi: tuple[int, int]) -> list[int]:
        return [rng.randrange(3, 2000) for _ in range(rng.randint(*lo_hi))]

    return [{"turns": [ids(s.first_tokens)] + [ids(s.new_tokens) for _ in range(s.turns - 1)],
             "answers": [rng.randint(*s.answer_tokens) for _ in range(s.turns)]}
            for _ in range(s.conversations)]


def summarize(arm: str, turns: list[dict], sources: dict[str, float]) -> dict[str, Any]:
    """Per turn index: requests, prompt tokens computed (mean), TTFT p50 (pure)."""
    from kvpool_dev.demo import percentile

    by_turn = []
    for k in sorted({t["turn"] for t in turns}):
        ts = [t for t in turns if t["turn"] == k]
        by_turn.append({
            "turn": k + 1, "requests": len(ts),
            "prompt_tokens": sum(t["prompt_tokens"] for t in ts) / len(ts),
            "new_tokens": sum(t["new_tokens"] for t in ts) / len(ts),
            "computed_tokens": sum(t["prompt_tokens"] - t["cached_tokens"] for t in ts) / len(ts),
            "ttft_p50_s": percentile([t["ttft_s"] for t in ts], 50)})
    later = [t for t in turns if t["turn"] > 0]
    return {"arm": arm, "requests": len(turns), "by_turn": by_turn,
            "later_computed_tokens": (sum(t["prompt_tokens"] - t["cached_tokens"] for t in later)
                                      / len(later)) if later else None,
            "later_new_tokens": sum(t["new_tokens"] for t in later) / len(later) if later else None,
            "later_ttft_p50_s": percentile([t["ttft_s"] for t in later], 50) if later else None,
            "cached_by_source": sources}


def render(report: dict[str, Any]) -> str:
    """The per-turn table (pure)."""
    s, runs = report["settings"], report["runs"]
    names = list(runs)
    turns = max(len(r["by_turn"]) for r in runs.values())
    out = [f"kvpool bench chat: {s['conversations']} conversations x {s['turns']} turns "
           f"({s['preset']} model), first turn {s['first_tokens'][0]}-{s['first_tokens'][1]} "
           f"tokens, +{s['new_tokens'][0]}-{s['new_tokens'][1]} per turn, answers "
           f"{s['answer_tokens'][0]}-{s['answer_tokens'][1]}, concurrency {s['concurrency']}, "
           f"engine KV cache {s['kv_cache_tokens']} tokens, token-exact history", "",
           "computed prompt tokens per request (new tokens of the turn) / TTFT p50"]
    w = 20
    out.append(f"{'turn':<8}" + "".join(f"{n:<{w}}" for n in names))
    for k in range(turns):
        cells = []
        for n in names:
            bt = runs[n]["by_turn"]
            if k >= len(bt):
                cells.append("-")
                continue
            b = bt[k]
            cells.append(f"{b['computed_tokens']:.0f} ({b['new_tokens']:.0f}) "
                         f"{b['ttft_p50_s'] * 1000:.0f}ms")
        out.append(f"{k + 1:<8}" + "".join(f"{c:<{w}}" for c in cells))
    out.append(f"{'2+':<8}" + "".join(
        f"{runs[n]['later_computed_tokens'] or 0:.0f} ({runs[n]['later_new_tokens'] or 0:.0f}) "
        f"{(runs[n]['later_ttft_p50_s'] or 0) * 1000:.0f}ms".ljust(w) for n in names))
    out += ["", "cached prompt tokens by source (vLLM's hit sources, all turns)"]
    for n in names:
        src = ", ".join(f"{k} {v:.0f}" for k, v in sorted(runs[n]["cached_by_source"].items()))
        out.append(f"  {n:<8} {src or '-'}")
    out += ["", "goals (turns 2+):"]
    for g in report["goals"]:
        mark = {True: "met ", False: "MISS", None: "n/a "}[g["met"]]
        out.append(f"  [{mark}] {g['goal']}: {g['value']}")
    return "\n".join(out)


def goals(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's goals on turns 2+ (pure)."""
    out = []
    t = runs.get("tails")
    if t is None or t["later_computed_tokens"] is None:
        return out
    limit = t["later_new_tokens"] + BLOCK_TOKENS
    out.append({"goal": "tails: computed tokens <= new tokens + one block",
                "value": f"{t['later_computed_tokens']:.0f} <= {limit:.0f}",
                "met": t["later_computed_tokens"] <= limit})
    c = runs.get("chunks")
    if c is not None and t["later_ttft_p50_s"]:
        x = c["later_ttft_p50_s"] / t["later_ttft_p50_s"]
        out.append({"goal": f"TTFT p50 >= {GOAL_TTFT_X}x lower than the chunks arm",
                    "value": f"{x:.2f}x", "met": x >= GOAL_TTFT_X})
    n = runs.get("native")
    if n is not None and n["later_computed_tokens"] is not None:
        out.append({"goal": "tails: computed tokens <= native",
                    "value": f"{t['later_computed_tokens']:.0f} vs {n['later_computed_tokens']:.0f}",
                    "met": t["later_computed_tokens"] <= n["later_computed_tokens"]})
        out.append({"goal": "tails: TTFT p50 <= native",
                    "value": f"{t['later_ttft_p50_s'] * 1000:.0f} vs "
                             f"{n['later_ttft_p50_s'] * 1000:.0f} ms",
                    "met": t["later_ttft_p50_s"] <= n["later_ttft_p50_s"]})
    return out


# -- I/O shell --------------------------------------------------------------------------------


def _log(msg: str) -> None:
    print(f"[bench chat {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def arm_config(arm: str, s: Settings) -> dict[str, Any] | None:
    from kvpool_connector.config import parse_size

    ns = f"chat-{arm}-{uuid.uuid4().hex[:8]}"
    tier = [kv_configs.cpu_tier(s.cpu_tier)]
    if arm == "plain":
        return None
    if arm == "chunks":
        return kv_configs.kvpool_config(tier, ns, s.chunk_tokens, save_decode_tokens=False,
                                        tail_objects=False)
    if arm == "tails":
        return kv_configs.kvpool_config(tier, ns, s.chunk_tokens)
    if arm == "native":
        return kv_configs.native_config(parse_size(s.cpu_tier), s.chunk_tokens)
    raise ValueError(f"unknown arm {arm!r}")


def _turn(base_url: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed completion of prompt token ids: the generated ids, TTFT, usage."""
    import httpx

    body = {"model": "local", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, ids, usage = None, [], None
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                got = choice.get("token_ids") or []
                if got and ttft is None:
                    ttft = time.perf_counter() - t0
                ids += got
            if chunk.get("usage"):
                usage = chunk["usage"]
    details = (usage or {}).get("prompt_tokens_details") or {}
    return {"ids": ids, "ttft_s": ttft if ttft is not None else time.perf_counter() - t0,
            "prompt_tokens": (usage or {}).get("prompt_tokens", len(prompt)),
            "cached_tokens": details.get("cached_tokens") or 0}


def run_arm(arm: str, s: Settings, work: list[dict[str, Any]], model: Path, workdir: Path
            ) -> dict[str, Any]:
    from kvpool_dev.bench.fleet_bench import counters, delta
    from kvpool_dev.testbed.engine import VllmServer

    blocks = max(s.kv_cache_tokens // BLOCK_TOKENS, -(-s.max_model_len // BLOCK_TOKENS) + 1)
    server = VllmServer(model, kv_transfer_config=arm_config(arm, s),
                        max_model_len=s.max_model_len,
                        env={**kv_configs.pool_key_env(), "VLLM_CPU_KVCACHE_SPACE": "1"},
                        extra_args=["--num-gpu-blocks-override", str(blocks)],
                        log_path=workdir / f"engine-{arm}.log")
    t0 = time.monotonic()
    server.start()
    try:
        _log(f"{arm}: server up in {time.monotonic() - t0:.0f}s")
        _turn(server.base_url, [7] * 200, 4)  # first-request costs outside the figures
        before = counters(server.metrics())
        prompts = [list(c["turns"][0]) for c in work]
        results: list[dict[str, Any]] = []
        lock = threading.Lock()

        def one(c: int, k: int) -> None:
            if k:
                prompts[c] = prompts[c] + work[c]["turns"][k]
            out = _turn(server.base_url, prompts[c], work[c]["answers"][k])
            prompts[c] = prompts[c] + out.pop("ids")  # token-exact history
            with lock:
                results.append({"conversation": c, "turn": k,
                                "new_tokens": len(work[c]["turns"][k]), **out})

        with ThreadPoolExecutor(max_workers=s.concurrency) as pool:
            for k in range(s.turns):
                list(pool.map(functools.partial(one, k=k), range(len(work))))
        d = delta(counters(server.metrics()), before)
        sources = {k.split(":", 1)[1]: v for k, v in d.items() if k.startswith("cached:") and v}
        return summarize(arm, results, sources)
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvpool bench chat", description=__doc__.split("\n\n")[1])
    ap.add_argument("--quick", action="store_true", help="tiny model, 3 conversations x 3 turns")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma list (default {','.join(ARMS)})")
    ap.add_argument("--conversations", type=int, default=None)
    ap.add_argument("--turns", type=int, default=None)
    ap.add_argument("--concurrency", type=int, default=None)
    ap.add_argument("--model", default=None, help="model path (default: the generated one)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the report as JSON")
    ap.add_argument("--workdir", default=None, help="keep the engine logs here")
    args = ap.parse_args(argv)

    from kvpool_dev.testbed.localmodel import ensure_model

    arms = [a for a in args.arms.split(",") if a]
    bad = [a for a in arms if a not in ARMS]
    if bad:
        print(f"kvpool bench chat: --arms: unknown {bad}; choose from {list(ARMS)}",
              file=sys.stderr)
        return 2
    if not kv_configs.kvpool_connector_available():
        print("kvpool bench chat: kvpool_connector.vllm.KVPoolConnector does not import",
              file=sys.stderr)
        return 2
    s = Settings.quick() if args.quick else Settings()
    overrides = {k: v for k in ("conversations", "turns", "concurrency")
                 if (v := getattr(args, k)) is not None}
    if overrides:
        s = Settings(**{**asdict(s), **overrides})
    model = Path(args.model) if args.model else ensure_model(s.preset)
    work = workload(s, args.seed)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kvpool-chat-"))
    workdir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"settings": asdict(s), "runs": {}}
    t0 = time.monotonic()
    try:
        for arm in arms:
            report["runs"][arm] = run_arm(arm, s, work, model, workdir)
            r = report["runs"][arm]
            _log(f"{arm}: turns 2+ computed {r['later_computed_tokens']}, TTFT p50 "
                 f"{r['later_ttft_p50_s']}")
    except (RuntimeError, TimeoutError) as exc:
        print(f"kvpool bench chat: {exc}", file=sys.stderr)
        return 1
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    report["goals"] = goals(report["runs"])
    report["wall_s"] = time.monotonic() - t0
    print(render(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
