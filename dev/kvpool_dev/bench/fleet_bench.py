"""`kvpool bench fleet`: routing policies in front of a pool of engines, side by side.

Starts N (default 2) real vLLM OpenAI servers, each with the kvpool connector (its own cpu
tier, one shared Redis, or a Redis Cluster with --redis-cluster), and runs the same
multi-turn chat workload through the real `vllm-router` once per policy: round_robin (what
a plain Service amounts to: a conversation's turns land anywhere) against cache_aware
(the router's approximate prefix tree) and consistent_hash (sticky by the x-session-id
header). Every prompt carries the conversation so far. Each policy's run uses its own
vLLM cache_salt, so its prefixes share nothing with another run's while the engines (and
their warm code paths) are the same; the order of the conversations in every round is
shuffled the same way for every policy. Per policy: where the prompt tokens came from
(vLLM's paged prefix cache, kvpool's cpu tier, the shared Redis, computed) from the
engines' /metrics, kvpool's per-tier chunk hit rates, TTFT p50/p95 and throughput from the
client, and how the router spread the requests. Ratios against round_robin are printed
next to the goals (cpu-tier tokens >= 1.5x, TTFT p50 >= 1.3x lower). A benchmark, not a
timed test: the numbers are measured in one run, side by side.
"""

from __future__ import annotations

import argparse
import json
import os
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
from kvpool_dev.demo import Settings as DemoSettings

POLICIES = ("round_robin", "cache_aware", "consistent_hash")
BASELINE = "round_robin"
GOAL_CPU_TOKENS = 1.5   # cpu-tier prompt tokens, cache-aware policy / round robin
GOAL_TTFT_P50 = 1.3     # TTFT p50, round robin / cache-aware policy
REDIS_PASSWORD_ENV = "KVPOOL_BENCH_REDIS_PASSWORD"
BLOCK_TOKENS = 128      # vLLM's block size on its CPU platform
# vllm-router's cache_aware asks each engine to render and tokenize the chat
# (/v1/chat/completions/render) and matches token prefixes; vLLM serves that only with
# --enable-scale-out. Without it the router finds no tokens and balances by load alone.
SCALE_OUT = ["--enable-scale-out"]
SOURCES = {"device": "vLLM prefix cache", "host": "kvpool cpu", "external_unspecified":
           "kvpool redis"}  # vLLM's hit sources, as the connector reports its tiers


@dataclass(frozen=True)
class Settings(DemoSettings):
    """The demo's workload shape (a document per conversation, rounds of turns) on a fleet."""

    preset: str = "bench"   # timings, not answers: the random-weight bench model
    engines: int = 2
    conversations: int = 9
    doc_tokens: int = 2048
    question_tokens: int = 48
    max_tokens: int = 32
    # one request at a time: TTFT shows what each tier costs a request. With 2 in flight on
    # 2 engines, sticky policies queue behind each other part of the time (--concurrency 2)
    concurrency: int = 1
    kv_cache_tokens: int = 4096   # each engine's own paged cache: a few conversations
    cpu_tier: str = "1Gi"

    @staticmethod
    def quick() -> Settings:
        # one request at a time: the arrival order, and so round robin's choices, are fixed
        return Settings(preset="tiny", conversations=4, turns=2, doc_tokens=300,
                        question_tokens=24, max_tokens=8, kv_cache_tokens=1024,
                        max_model_len=1536, cpu_tier="256Mi")


# -- pure parts -------------------------------------------------------------------------------


# vLLM's per-request histograms that split a TTFT (v1/metrics/stats.py): queued -> first
# scheduled in the engine, scheduled -> first token in the engine, and the API server's own
# arrival -> first token; counters() keeps their sums and counts as time:<stage>_sum/_count
TTFT_STAGES = {"vllm:request_queue_time_seconds": "queue",
               "vllm:request_prefill_time_seconds": "prefill",
               "vllm:time_to_first_token_seconds": "ttft"}


def counters(text: str) -> dict[str, float]:
    """The counters this bench compares, from a server's Prometheus text (summed over
    engine labels): prompt tokens, cached tokens by vLLM's source, kvpool tier hits, prompt
    tokens kvpool served by object kind and tier, the TTFT stages' sums and counts, the
    connector's time inside the engine's steps by phase."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}

    def add(key: str, v: float) -> None:
        out[key] = out.get(key, 0.0) + v

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "vllm:prompt_tokens_total":
                add("prompt_tokens", s.value)
            elif s.name == "vllm:prompt_tokens_cached_by_source_total":
                add(f"cached:{s.labels.get('source', '')}", s.value)
            elif s.name == "kvpool_hit_tokens_total":  # label kind/tier: served:prompt/cpu
                add(f"served:{s.labels.get('kind', '')}/{s.labels.get('tier', '')}", s.value)
            elif s.name in ("kvpool_tier_hit_chunks_total", "kvpool_tier_miss_chunks_total"):
                add(f"{s.name.split('_')[2]}:{s.labels.get('tier', '')}", s.value)
            elif s.name == "kvpool_step_seconds_total":  # step:load, step:save
                add(f"step:{s.labels.get('phase', '')}", s.value)
            elif s.name == "vllm_router_processed_requests_total":
                add(f"routed:{s.labels.get('worker', '')}", s.value)
            elif s.name == "vllm_router_prefix_routing_decisions_total":
                add(f"decision:{s.labels.get('outcome', '')}", s.value)
            elif s.name.endswith(("_sum", "_count")) and (
                    stage := TTFT_STAGES.get(s.name.rsplit("_", 1)[0])):
                add(f"time:{stage}_{s.name.rsplit('_', 1)[1]}", s.value)
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def turn_order(conversations: int, turn: int, seed: int = 0) -> list[int]:
    """The order in which a round's conversations arrive (the same for every policy)."""
    order = list(range(conversations))
    random.Random(seed * 1000 + turn).shuffle(order)
    return order


def summarize(policy: str, turns: list[dict], wall_s: float, engines: dict[str, float],
              routed: dict[str, float]) -> dict[str, Any]:
    """One policy's numbers (pure): client-side TTFT/throughput, server-side sources."""
    from kvpool_dev.demo_report import percentile

    ttfts = [t["ttft_s"] for t in turns]
    prompt = engines.get("prompt_tokens", 0.0)
    tokens = {src: engines.get(f"cached:{src}", 0.0) for src in SOURCES}
    tokens["computed"] = max(0.0, prompt - sum(tokens.values()))
    tiers = sorted({k.split(":", 1)[1] for k in engines if k.startswith(("hit:", "miss:"))})
    chunk_rates = {}
    for t in tiers:
        h, m = engines.get(f"hit:{t}", 0.0), engines.get(f"miss:{t}", 0.0)
        chunk_rates[t] = h / (h + m) if h + m else None
    return {
        "policy": policy,
        "requests": len(turns),
        "wall_s": wall_s,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p95_s": percentile(ttfts, 95),
        "ttft_p50_by_turn_s": [percentile([t["ttft_s"] for t in turns if t["turn"] == k], 50)
                               for k in sorted({t["turn"] for t in turns})],
        "requests_per_s": len(turns) / wall_s if wall_s else None,
        "output_tokens_per_s": sum(t["completion_tokens"] for t in turns) / wall_s if wall_s else None,
        "prompt_tokens": prompt,
        "tokens_by_source": tokens,
        "share_by_source": {k: (v / prompt if prompt else None) for k, v in tokens.items()},
        "chunk_hit_rate_by_tier": chunk_rates,
        "requests_per_engine": {k.split(":", 1)[1]: v for k, v in routed.items()
                                if k.startswith("routed:")},
        # cache_aware's own account: prefix_hit / prefix_miss (missing_tokens: it could
        # not tokenize, so it balanced by load)
        "router_decisions": {k.split(":", 1)[1]: v for k, v in routed.items()
                             if k.startswith("decision:")},
    }


def compare(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Ratios of every policy against round_robin, and the goals (pure)."""
    base = runs.get(BASELINE)
    ratios, goals = {}, []
    for name, r in runs.items():
        if base is None or name == BASELINE:
            continue
        cpu, cpu0 = r["tokens_by_source"]["host"], base["tokens_by_source"]["host"]
        x_cpu = cpu / cpu0 if cpu0 else (float("inf") if cpu else None)
        x_ttft = base["ttft_p50_s"] / r["ttft_p50_s"] if r["ttft_p50_s"] else None
        ratios[name] = {"cpu_tokens_x": x_cpu, "ttft_p50_x": x_ttft,
                        "ttft_p95_x": base["ttft_p95_s"] / r["ttft_p95_s"] if r["ttft_p95_s"] else None,
                        "throughput_x": (r["requests_per_s"] / base["requests_per_s"]
                                         if base["requests_per_s"] else None)}
        goals.append({"goal": f"{name}: cpu-tier prompt tokens >= {GOAL_CPU_TOKENS}x round_robin",
                      "value": x_cpu, "met": None if x_cpu is None else x_cpu >= GOAL_CPU_TOKENS})
        goals.append({"goal": f"{name}: TTFT p50 >= {GOAL_TTFT_P50}x lower than round_robin",
                      "value": x_ttft, "met": None if x_ttft is None else x_ttft >= GOAL_TTFT_P50})
    return {"ratios": ratios, "goals": goals}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def render(report: dict[str, Any]) -> str:
    """The side-by-side table (pure)."""
    s, runs = report["settings"], report["runs"]
    names = list(runs)
    rows: list[tuple[str, list[str]]] = [
        ("TTFT p50", [f"{runs[n]['ttft_p50_s']:.3f} s" for n in names]),
        ("TTFT p95", [f"{runs[n]['ttft_p95_s']:.3f} s" for n in names]),
        ("TTFT p50 by turn", ["/".join(f"{x:.2f}" for x in runs[n]["ttft_p50_by_turn_s"])
                              for n in names]),
        ("throughput", [f"{runs[n]['requests_per_s']:.2f} req/s, "
                        f"{runs[n]['output_tokens_per_s']:.0f} tok/s" for n in names]),
        ("prompt tokens", [f"{runs[n]['prompt_tokens']:.0f}" for n in names]),
    ]
    for src, label in (*SOURCES.items(), ("computed", "computed")):
        rows.append((f"  {label}", [f"{runs[n]['tokens_by_source'][src]:.0f} "
                                    f"({_pct(runs[n]['share_by_source'][src])})" for n in names]))
    for tier in sorted({t for n in names for t in runs[n]["chunk_hit_rate_by_tier"]}):
        rows.append((f"kvpool {tier} chunk hits", [_pct(runs[n]["chunk_hit_rate_by_tier"].get(tier))
                                                   for n in names]))
    rows.append(("router prefix decisions", [", ".join(f"{k} {v:.0f}" for k, v in
                                                        sorted(runs[n].get("router_decisions", {}).items()))
                                              or "-" for n in names]))
    rows.append(("requests per engine", ["/".join(f"{v:.0f}" for v in runs[n]["requests_per_engine"].values())
                                         for n in names]))
    ratios = report["comparison"]["ratios"]
    rows.append(("cpu tokens vs rr", [_x(ratios.get(n, {}).get("cpu_tokens_x")) if n != BASELINE
                                      else "1.00x" for n in names]))
    rows.append(("TTFT p50 vs rr", [_x(ratios.get(n, {}).get("ttft_p50_x")) if n != BASELINE
                                    else "1.00x" for n in names]))
    w = max(24, *(len(c) + 2 for _, cells in rows for c in cells))
    out = [f"kvpool bench fleet: {s['engines']} engines ({s['preset']} model, cpu tier "
           f"{s['cpu_tier']} each, shared {report['shared']}) behind vllm-router "
           f"{report['router_version']}; {s['conversations']} conversations x {s['turns']} turns, "
           f"concurrency {s['concurrency']}, engine KV cache {s['kv_cache_tokens']} tokens, "
           f"{report.get('repeat', 1)} pass(es) per policy in alternating order", "",
           f"{'':<26}" + "".join(f"{n:<{w}}" for n in names)]
    out += [f"{label:<26}" + "".join(f"{c:<{w}}" for c in cells) for label, cells in rows]
    out += ["", "goals:"]
    for g in report["comparison"]["goals"]:
        mark = {True: "met ", False: "MISS", None: "n/a "}[g["met"]]
        out.append(f"  [{mark}] {g['goal']}: {_x(g['value'])}")
    return "\n".join(out)


# -- I/O shell --------------------------------------------------------------------------------


def _log(msg: str) -> None:
    print(f"[bench fleet {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _scrape(url: str) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return counters(r.read().decode())


class Fleet:
    """The shared tier (Redis or a Redis Cluster) and N kvpool engines using it."""

    def __init__(self, s: Settings, model: Path, workdir: Path, redis_cluster: bool = False):
        from kvpool_dev.testbed.engine import VllmServer
        from kvpool_dev.testbed.servers import RedisCluster, RedisServer

        self.shared = "redis-cluster" if redis_cluster else "redis"
        self.redis = (RedisCluster(maxmemory="1gb") if redis_cluster
                      else RedisServer(maxmemory="2gb")).start()
        tier = kv_configs.redis_tier(self.redis.url, REDIS_PASSWORD_ENV)
        if redis_cluster:
            tier["cluster"] = True
        cfg = kv_configs.kvpool_config([kv_configs.cpu_tier(s.cpu_tier), tier],
                                       namespace=f"fleet-{uuid.uuid4().hex[:8]}")
        env = {**kv_configs.pool_key_env(), REDIS_PASSWORD_ENV: self.redis.password,
               "VLLM_CPU_KVCACHE_SPACE": "1"}
        blocks = max(s.kv_cache_tokens // BLOCK_TOKENS, -(-s.max_model_len // BLOCK_TOKENS) + 1)
        cores = os.cpu_count() or 1
        self.engines = [VllmServer(model, kv_transfer_config=cfg, max_model_len=s.max_model_len,
                                   env={**env, **({"VLLM_CPU_OMP_THREADS_BIND": str(i % cores)}
                                                  if cores >= s.engines else {})},
                                   extra_args=["--num-gpu-blocks-override", str(blocks), *SCALE_OUT],
                                   log_path=workdir / f"engine-{i}.log")
                        for i in range(s.engines)]

    def start(self) -> Fleet:
        errors: list[BaseException] = []

        def up(e):
            try:
                e.start()
            except BaseException as exc:  # reported below, after every start returned
                errors.append(exc)

        threads = [threading.Thread(target=up, args=(e,)) for e in self.engines]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            self.stop()
            raise RuntimeError(f"engine start failed: {errors[0]}")
        return self

    def stop(self) -> None:
        for e in self.engines:
            e.stop()
        self.redis.stop()


def run_policy(fleet: Fleet, policy: str, workload: list[dict[str, Any]], s: Settings,
               seed: int, workdir: Path) -> tuple[list[dict], float, dict, dict]:
    """The whole workload through a fresh router with `policy`, under its own cache_salt:
    (turns, wall seconds, engine counter deltas, router counters)."""
    from openai import OpenAI

    from kvpool_dev.demo import _chat_turn
    from kvpool_dev.testbed.router import VllmRouter

    salt = f"{policy}-{uuid.uuid4().hex[:8]}"
    histories = [[{"role": "system", "content": c["system"]}] for c in workload]
    turns: list[dict[str, Any]] = []
    lock = threading.Lock()
    urls = [e.base_url for e in fleet.engines]
    before = [_scrape(u) for u in urls]
    with VllmRouter(urls, policy, log_path=workdir / f"router-{policy}.log") as router:
        client = OpenAI(base_url=router.base_url + "/v1", api_key="kvpool-bench", timeout=600,
                        max_retries=0)

        def one(c: int, k: int) -> None:
            hist = histories[c]
            hist.append({"role": "user", "content": workload[c]["questions"][k]})
            answer, m = _chat_turn(client, hist, s.max_tokens,
                                   extra_headers={"x-session-id": f"conversation-{c}"},
                                   extra_body={"cache_salt": salt})
            hist.append({"role": "assistant", "content": answer})
            with lock:
                turns.append({"conversation": c, "turn": k, **m})

        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=s.concurrency) as pool:
            for k in range(s.turns):
                list(pool.map(lambda c, k=k: one(c, k), turn_order(len(workload), k, seed)))
        wall = time.perf_counter() - t0
        routed = {k: v for k, v in counters(router.metrics()).items()
                  if k.startswith(("routed:", "decision:"))}
    engines: dict[str, float] = {}
    for u, b in zip(urls, before, strict=True):
        for k, v in delta(_scrape(u), b).items():
            engines[k] = engines.get(k, 0.0) + v
    return turns, wall, engines, routed


def merge(passes: list[tuple[list[dict], float, dict, dict]]) -> tuple[list[dict], float, dict, dict]:
    """One policy's passes as one run: turns pooled, seconds and counters added (pure)."""
    turns = [t for p in passes for t in p[0]]
    totals: tuple[dict, dict] = ({}, {})
    for p in passes:
        for total, part in zip(totals, p[2:], strict=True):
            for k, v in part.items():
                total[k] = total.get(k, 0.0) + v
    return turns, sum(p[1] for p in passes), totals[0], totals[1]


def _warm_up(fleet: Fleet, s: Settings) -> None:
    """One request straight to each engine, so no policy pays for first-request costs."""
    from openai import OpenAI

    from kvpool_dev.demo import _chat_turn

    for e in fleet.engines:
        client = OpenAI(base_url=e.base_url + "/v1", api_key="kvpool-bench", max_retries=0)
        _chat_turn(client, [{"role": "user", "content": "warm up " * 60}], 4,
                   extra_body={"cache_salt": "warm-up"})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvpool bench fleet", description=__doc__.split("\n\n")[1])
    ap.add_argument("--quick", action="store_true", help="tiny model, 4 conversations x 2 turns")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help=f"comma list (default {','.join(POLICIES)}); round_robin is the baseline")
    ap.add_argument("--conversations", type=int, default=None)
    ap.add_argument("--turns", type=int, default=None)
    ap.add_argument("--engines", type=int, default=None)
    ap.add_argument("--concurrency", type=int, default=None, help="requests in flight (default 1)")
    ap.add_argument("--model", default=None, help="model path (default: the generated one)")
    ap.add_argument("--redis-cluster", action="store_true",
                    help="share a 3-master Redis Cluster instead of one Redis")
    ap.add_argument("--seed", type=int, default=0, help="the order conversations take their "
                    "turns in (the documents are kvpool's docs, as in the demo)")
    ap.add_argument("--repeat", type=int, default=None, help="passes over the policies, every other "
                    "one in reverse order, pooled per policy (default 2; --quick: 1)")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the report as JSON")
    ap.add_argument("--workdir", default=None, help="keep the engine and router logs here "
                    "(default: a temporary directory, removed at the end)")
    args = ap.parse_args(argv)

    from kvpool_dev.testbed.localmodel import ensure_model
    from kvpool_dev.testbed.router import POLICIES as ROUTER_POLICIES

    if not kv_configs.kvpool_connector_available():
        print("kvpool bench fleet: kvpool_connector.vllm.KVPoolConnector does not import",
              file=sys.stderr)
        return 2
    policies = [p for p in args.policies.split(",") if p]
    bad = [p for p in policies if p not in ROUTER_POLICIES]
    if bad:
        print(f"kvpool bench fleet: unknown policies {bad}; choose from {ROUTER_POLICIES}",
              file=sys.stderr)
        return 2
    s = Settings.quick() if args.quick else Settings()
    if args.repeat is None:
        args.repeat = 1 if args.quick else 2
    overrides = {k: v for k in ("conversations", "turns", "engines", "concurrency")
                 if (v := getattr(args, k)) is not None}
    if overrides:
        s = Settings(**{**asdict(s), **overrides})
    model = Path(args.model) if args.model else ensure_model(s.preset)
    from tokenizers import Tokenizer

    from kvpool_dev.demo import build_workload
    from kvpool_dev.demo_corpus import DOCS_DIR, load_corpus

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    workload = build_workload(s, lambda text: len(tok.encode(text).ids), load_corpus(DOCS_DIR))
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kvpool-fleet-"))
    workdir.mkdir(parents=True, exist_ok=True)
    import importlib.metadata as md

    report: dict[str, Any] = {"settings": asdict(s), "repeat": args.repeat,
                              "router_version": md.version("vllm-router"),
                              "shared": "redis-cluster" if args.redis_cluster else "redis",
                              "runs": {}, "logs": str(workdir) if args.workdir else None}
    t0 = time.monotonic()
    _log(f"starting {s.engines} engines ({s.preset}) and the shared tier ...")
    try:
        fleet = Fleet(s, model, workdir, redis_cluster=args.redis_cluster).start()
    except (RuntimeError, TimeoutError) as exc:
        print(f"kvpool bench fleet: {exc}", file=sys.stderr)
        return 1
    try:
        _log(f"engines up in {time.monotonic() - t0:.0f}s; warming up")
        _warm_up(fleet, s)
        passes: dict[str, list] = {p: [] for p in policies}
        for rep in range(args.repeat):  # every other pass in reverse: no policy always first
            for policy in (policies if rep % 2 == 0 else policies[::-1]):
                passes[policy].append(run_policy(fleet, policy, workload, s, args.seed, workdir))
                r = summarize(policy, *passes[policy][-1])
                _log(f"pass {rep + 1} {policy}: TTFT p50 {r['ttft_p50_s']:.3f}s, cpu-tier "
                     f"tokens {r['tokens_by_source']['host']:.0f}, {r['wall_s']:.0f}s")
        report["runs"] = {p: summarize(p, *merge(passes[p])) for p in policies}
    finally:
        fleet.stop()
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    report["comparison"] = compare(report["runs"])
    report["wall_s"] = time.monotonic() - t0
    print(render(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
