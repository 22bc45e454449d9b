"""`kvpool bench warm`: what warm start buys a new engine (issue 26).

Engine A (cpu + Redis, warm start on) serves a shared-prefix workload: --prefixes prefixes of
--prefix-len tokens, each asked --a-rounds times with its own suffix, and merges the chunks
its requests reuse into the pool's hot set manifest in Redis. A is stopped, then each arm
starts a fresh engine B and sends it --b-requests requests, one at a time: the same
prefixes, round robin, with suffixes of their own (each arm's differ, so no arm finds what
another arm's B saved):

  warm         cpu + Redis, warm start on: the hot set is in B's cpu tier before it serves
  cold-shared  cpu + Redis, warm start off: B finds A's chunks in Redis
  plain        no connector at all: a cold replica computes every prefix (the floor)

Each B first answers one untimed request of unrelated tokens (vLLM's first-call costs,
the same for every arm, out of the timing). Per arm, over B's requests: the share of
kvpool's object hits the cpu tier served, prompt tokens computed (neither vLLM's prefix
cache nor the pool had them), TTFT p50 (streamed, time to the first token), and the
warm-up's seconds and bytes (kvpool_prewarm_* counters); the verdict checks issue 26's
goals. Loopback Redis, the same model, dtype and engine arguments for every arm.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvpool_dev.bench import kv_configs

ARMS = ("warm", "cold-shared", "plain")
REDIS_PASSWORD_ENV = "KVPOOL_BENCH_REDIS_PASSWORD"
GOAL_CPU_SHARE = 0.9
GOAL_TTFT_RATIO = 3.0
B_REFRESH_S = 3600  # engine B's manifest refresh: never within its timed requests


@dataclass(frozen=True)
class Workload:
    prefixes: int = 20
    prefix_len: int = 1024       # a multiple of chunk_tokens: A stores every prefix token
    suffix_len: int = 64
    output_len: int = 4
    a_rounds: int = 2            # requests per prefix on A (the second one is a reuse)
    b_requests: int = 20
    chunk_tokens: int = 256
    host_bytes: int = 2 << 30    # each engine's cpu tier
    refresh_seconds: float = 1.0
    max_seconds: float = 30.0    # warm start's time budget


QUICK = Workload(prefixes=4, prefix_len=512, suffix_len=32, output_len=2, a_rounds=2,
                 b_requests=6, host_bytes=256 << 20)


# -- pure parts ------------------------------------------------------------------------------


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(n)]


def prompts(w: Workload, n: int, suffix_seed: int) -> list[list[int]]:
    """`n` prompts: prefix i % prefixes (the same for every caller) + a suffix of their own."""
    return [tokens(w.prefix_len, 10_000 + i % w.prefixes)
            + tokens(w.suffix_len, suffix_seed * 100_000 + i) for i in range(n)]


def transfer_config(arm: str, w: Workload, namespace: str, redis_url: str
                    ) -> dict[str, Any] | None:
    """A's (arm "a") and each arm's B's --kv-transfer-config (pure)."""
    if arm == "plain":
        return None
    if arm not in ("a", "warm", "cold-shared"):
        raise ValueError(f"--arms: unknown arm {arm!r}; choose from {', '.join(ARMS)}")
    tiers = [kv_configs.cpu_tier(str(w.host_bytes)),
             kv_configs.redis_tier(redis_url, REDIS_PASSWORD_ENV)]
    # B merges nothing while it is timed (a Redis read and write a second would be a cost
    # the cold-shared arm does not pay): only A refreshes the manifest often
    warm = {"enabled": arm != "cold-shared",
            "refresh_seconds": w.refresh_seconds if arm == "a" else B_REFRESH_S,
            "max_seconds": w.max_seconds}
    return kv_configs.kvpool_config(tiers, namespace, chunk_tokens=w.chunk_tokens,
                                    warm_start=warm, timeout_seconds=5.0)


def parse_metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value of every sample in Prometheus text (pure)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(m: dict, name: str, **labels: str) -> float:
    """Sum of `name`'s samples whose labels include `labels` (pure)."""
    return sum(v for (n, ls), v in m.items() if n == name
               and all(dict(ls).get(k) == x for k, x in labels.items()))


def arm_figures(before: dict, after: dict, ttfts: list[float], prompt_tokens: int,
                start_s: float) -> dict[str, Any]:
    """An arm's figures from its server's metrics around B's requests (pure)."""
    def d(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    hits = d("kvpool_hit_objects_total")
    cpu = d("kvpool_hit_objects_total", tier="cpu")
    cached = d("vllm:prefix_cache_hits_total") + d("vllm:external_prefix_cache_hits_total")
    return {
        "requests": len(ttfts),
        "ttft_p50_ms": statistics.median(ttfts) * 1000 if ttfts else None,
        "ttft_ms": [t * 1000 for t in ttfts],
        "prompt_tokens": prompt_tokens,
        "tokens_computed": prompt_tokens - cached,
        "tier_hit_objects": hits,
        "cpu_hit_share": cpu / hits if hits else None,
        "prewarm_objects": total(after, "kvpool_prewarm_objects_total"),
        "prewarm_bytes": total(after, "kvpool_prewarm_bytes_total"),
        "prewarm_seconds": total(after, "kvpool_prewarm_seconds_total"),
        "prewarm_hit_objects": d("kvpool_prewarm_hit_objects_total"),
        "start_s": start_s,
    }


def verdict(arms: dict[str, dict[str, Any]], w: Workload) -> dict[str, bool | None]:
    """Issue 26's goals for the warm arm (None: an arm it needs did not run) (pure)."""
    warm, plain = arms.get("warm"), arms.get("plain")
    if warm is None:
        return {}
    out: dict[str, bool | None] = {
        "cpu_share_at_least_90pct": (warm["cpu_hit_share"] or 0) >= GOAL_CPU_SHARE,
        # every prefix token came from the pool: only the suffixes were computed
        "no_prefix_token_computed": warm["tokens_computed"] <= warm["requests"] * w.suffix_len,
        # within the budget, and something was warmed (nothing loaded in 0 s is no pass)
        "warm_up_within_budget": warm["prewarm_objects"] > 0
        and warm["prewarm_seconds"] <= w.max_seconds,
        "ttft_p50_3x_below_plain": None,
    }
    if plain is not None and plain["ttft_p50_ms"] and warm["ttft_p50_ms"]:
        out["ttft_p50_3x_below_plain"] = (plain["ttft_p50_ms"] / warm["ttft_p50_ms"]
                                          >= GOAL_TTFT_RATIO)
    return out


def render(report: dict[str, Any]) -> str:
    """The human table (pure)."""
    w = report["workload"]
    out = [f"kvpool bench warm: {report['cpu']}, dtype {report['dtype']}, model {report['model']}; "
           f"A served {w['prefixes']} prefixes of {w['prefix_len']} tokens x {w['a_rounds']}; "
           f"B: {w['b_requests']} requests (prefix + {w['suffix_len']} tokens), one at a time, "
           f"after an untimed warm-up; "
           f"loopback Redis", "",
           f"  {'arm':<13}{'cpu hit share':>14}{'tokens computed':>17}{'TTFT p50':>10}"
           f"{'warm-up s':>11}{'warm-up MiB':>13}{'start s':>9}"]
    for arm, f in report["arms"].items():
        share = "-" if f["cpu_hit_share"] is None else f"{100 * f['cpu_hit_share']:.0f}%"
        out.append(f"  {arm:<13}{share:>14}{int(f['tokens_computed']):>17}"
                   f"{_ms(f['ttft_p50_ms']):>10}{f['prewarm_seconds']:>11.3f}"
                   f"{f['prewarm_bytes'] / 2**20:>13.1f}{f['start_s']:>9.1f}")
    warm, plain = report["arms"].get("warm"), report["arms"].get("plain")
    if warm and plain and warm["ttft_p50_ms"] and plain["ttft_p50_ms"]:
        out.append(f"  TTFT p50: plain / warm = {plain['ttft_p50_ms'] / warm['ttft_p50_ms']:.2f}x")
    out.append("")
    for goal, ok in report["verdict"].items():
        out.append(f"  {goal}: {({True: 'yes', False: 'NO', None: 'n/a'})[ok]}")
    for arm, err in report.get("errors", {}).items():
        out.append(f"arm {arm} FAILED: {err.strip().splitlines()[-1] if err.strip() else ''}")
    return "\n".join(out).rstrip()


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f} ms"


# -- I/O shell -------------------------------------------------------------------------------


def _log(msg: str) -> None:
    print(f"[bench warm {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def ttft(base_url: str, prompt: list[int], max_tokens: int) -> float:
    """Seconds to the first streamed token of one completion (the rest is read and dropped)."""
    body = {"model": "local", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    req = urllib.request.Request(base_url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = None
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("the server streamed no token")
    return first


def _metrics(server) -> dict:
    return parse_metrics(server.metrics())


def engine(arm: str, w: Workload, model: Path, namespace: str, redis_url: str, env: dict,
           dtype: str, workdir: Path):
    from kvpool_dev.testbed.engine import VllmServer

    return VllmServer(model, kv_transfer_config=transfer_config(arm, w, namespace, redis_url),
                      env=env, max_model_len=w.prefix_len + w.suffix_len + 256, dtype=dtype,
                      log_path=workdir / f"server-{arm}.log")


def serve(server, batch: list[list[int]], w: Workload) -> list[float]:
    """The requests one at a time; their TTFTs."""
    return [ttft(server.base_url, p, w.output_len) for p in batch]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvpool bench warm", description=(
        "a new engine with warm start vs without vs a plain cold replica, after engine A "
        "served a shared-prefix workload (loopback Redis)"))
    ap.add_argument("--quick", action="store_true", help="tiny model, 4 prefixes of 512 "
                    "tokens, 6 requests of B (a smoke run)")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma list from {','.join(ARMS)}")
    ap.add_argument("--prefixes", type=int, default=None)
    ap.add_argument("--prefix-len", type=int, default=None, help="a multiple of 256")
    ap.add_argument("--b-requests", type=int, default=None)
    ap.add_argument("--model", default=None, help="model path (default: the generated bench "
                    "model; --quick: the tiny one)")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--json-out", default=None, help="write the report here as JSON")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--workdir", default=None, help="server logs (default: a temp dir)")
    args = ap.parse_args(argv)

    from kvpool_dev.bench.serve_bench import check_paths, cpu_line, emit, warm_up, with_positive
    from kvpool_dev.testbed.dtype import DtypeError, engine_dtype
    from kvpool_dev.testbed.localmodel import ensure_model
    from kvpool_dev.testbed.servers import RedisServer

    arms = [a for a in args.arms.split(",") if a]
    try:
        w = with_positive(QUICK if args.quick else Workload(), args,
                          ("prefixes", "prefix_len", "b_requests"))
        check_paths(args)
        if w.prefix_len % w.chunk_tokens:
            raise ValueError(f"--prefix-len must be a multiple of {w.chunk_tokens}")
        for a in arms:
            transfer_config(a, w, "check", "redis://x")
        dtype = engine_dtype(args.dtype)
    except (ValueError, DtypeError) as exc:
        print(f"kvpool bench warm: {exc}", file=sys.stderr)
        return 2
    if not kv_configs.kvpool_connector_available():
        print("kvpool bench warm: kvpool_connector.vllm.KVPoolConnector does not import",
              file=sys.stderr)
        return 2
    model = Path(args.model) if args.model else ensure_model("tiny" if args.quick else "bench")
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kvpool-warm-"))
    workdir.mkdir(parents=True, exist_ok=True)
    namespace = f"bench-warm-{int(time.time())}"
    results: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    t0 = time.monotonic()
    with RedisServer(maxmemory="4gb") as redis:
        env = {**kv_configs.pool_key_env(), REDIS_PASSWORD_ENV: redis.password}
        _log(f"engine A serves {w.prefixes} prefixes x {w.a_rounds}, dtype {dtype}")
        server = engine("a", w, model, namespace, redis.url, env, dtype, workdir)
        try:
            server.start()
            serve(server, prompts(w, w.prefixes * w.a_rounds, 1), w)
            time.sleep(3 * w.refresh_seconds)  # A's next merge into the hot set manifest
        except Exception as exc:  # without A no arm means anything
            errors["a"] = f"{exc}\n{server.log_tail(30)}"
        finally:
            server.stop()
        for i, arm in enumerate(arms if not errors else []):
            server = engine(arm, w, model, namespace, redis.url, env, dtype, workdir)
            try:
                _log(f"arm {arm}: starting engine B")
                started = time.monotonic()
                server.start()
                start_s = time.monotonic() - started
                warm_up(server.base_url, 64)  # vLLM's first-call costs, out of the timing
                before = _metrics(server)
                batch = prompts(w, w.b_requests, 10 + i)
                times = serve(server, batch, w)
                time.sleep(1.0)  # the last step's stats reach the API server's /metrics
                results[arm] = arm_figures(before, _metrics(server), times,
                                           sum(len(p) for p in batch), start_s)
                f = results[arm]
                _log(f"arm {arm}: TTFT p50 {_ms(f['ttft_p50_ms'])}, computed "
                     f"{int(f['tokens_computed'])} tokens, cpu share {f['cpu_hit_share']}")
            except Exception as exc:
                errors[arm] = f"{exc}\n{server.log_tail(30)}"
                _log(f"arm {arm} failed: {str(exc)[-400:]}")
            finally:
                server.stop()
    report = {"cpu": cpu_line(), "dtype": dtype, "model": model.name, "workload": asdict(w),
              "arms": results, "verdict": verdict(results, w), "errors": errors,
              "wall_s": time.monotonic() - t0}
    return emit(report, args, render)


if __name__ == "__main__":
    sys.exit(main())
