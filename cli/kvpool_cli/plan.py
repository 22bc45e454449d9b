"""`kvpool plan TRACE`: size a pool from a request trace.

Replays a Mooncake or Bailian trace (kvpool_connector.plan.trace) through a model of the pool
(kvpool_connector.plan.sim, on the cpu tier's own bookkeeping; -f reads it from a KVCachePool
the operator's validator accepts: plan_pool.py): engines
behind a router, each with vLLM's own prefix cache and a kvpool cpu tier, and optionally one
shared tier. Prints prompt tokens served per source and computed, the hit ratio beside the
bound of one infinite shared cache, the shared tier's traffic, and with `--sweep` the hit
ratio as a function of one tier's size with the smallest size that reaches the curve's knee.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvpool_cli.plan_pool import PoolFileError, managed_memory, managed_storage, read_pool
from kvpool_connector.config import format_size, parse_size
from kvpool_connector.plan.sim import ROUTINGS, PoolModel, Result, TierModel, replay
from kvpool_connector.plan.trace import FORMATS, MAX_REQUESTS, Trace, TraceError, read_trace

DEFINITION = ("hit ratio = prompt tokens served from any cache / prompt tokens, every request "
              "counted, a prefix's first sight a miss; bound = the same for one infinite cache "
              "all engines share")
SWEEPABLE = ("cpu", "shared", "engine", "disk", "redis", "s3")
KNEE_POINTS = 0.01   # the knee: the smallest size within 1 point of the sweep's best ratio
DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1,
               "fp8_e4m3": 1, "fp8_e5m2": 1}


@dataclass(frozen=True)
class KVShape:
    """KV bytes per token of a model: its full-attention layers, and its sliding-window layers
    with their window (0: none)."""

    full: int
    window: int = 0
    window_tokens: int = 0


def kv_shape(config: dict, kv_dtype: str = "auto") -> KVShape:
    """A model's KV bytes per token from its config.json (pure): MLA (DeepSeek-style
    `kv_lora_rank`) stores one latent of kv_lora_rank + rope dims per layer; other models K
    and V of every KV head; sliding-window layers (`layer_types`, or Gemma's
    `sliding_window_pattern`: every n-th layer full) are counted apart, since kvpool keeps
    only a window's last blocks of them per chunk (docs/connector.md, Hybrid models)."""
    if kv_dtype not in DTYPE_BYTES:
        raise ValueError(f"--kv-dtype {kv_dtype!r}: not one of {', '.join(DTYPE_BYTES)}")
    width = DTYPE_BYTES[kv_dtype]
    cfg = config.get("text_config") or config
    try:
        layers = int(cfg["num_hidden_layers"])
        if cfg.get("kv_lora_rank"):
            return KVShape(layers * (int(cfg["kv_lora_rank"])
                                     + int(cfg.get("qk_rope_head_dim", 0))) * width)
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        window = int(cfg.get("sliding_window") or 0)
        types = cfg.get("layer_types")
        pattern = int(cfg.get("sliding_window_pattern") or 0)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"--model: config.json lacks a usable {e} for the KV size") from None
    per_layer = 2 * kv_heads * head_dim * width
    sliding = 0
    if window and isinstance(types, list):
        sliding = sum(t == "sliding_attention" for t in types[:layers])
    elif window and pattern > 1:
        sliding = layers - layers // pattern
    if not sliding:
        return KVShape(layers * per_layer)
    return KVShape((layers - sliding) * per_layer, sliding * per_layer, window)


def bytes_per_token(config: dict, kv_dtype: str = "auto") -> int:
    """Every layer's KV bytes per token (a sliding-window model's before its windows)."""
    shape = kv_shape(config, kv_dtype)
    return shape.full + shape.window


def engine_cache(explicit: int, shape: KVShape, *, num_gpu_blocks: int = 0, block_size: int = 16,
                 gpu_memory: int = 0, utilization: float = 0.9, gpus: int = 1, weights: int = 0,
                 manifest: int = 0) -> tuple[int, str]:
    """(bytes of vLLM's own KV cache per engine, where the figure comes from) (pure), first of:
    --engine-cache; vLLM's block count (its log's "GPU KV cache size" / num_gpu_blocks) x the
    block's bytes; GPU memory x utilization x GPUs less the weights (vLLM's profile also keeps
    activations and CUDA graphs back: an upper bound); a CPU pool's cpuKvCacheGiB x TP."""
    if explicit:
        return explicit, "--engine-cache"
    if num_gpu_blocks:
        return (num_gpu_blocks * block_size * (shape.full + shape.window),
                f"--num-gpu-blocks {num_gpu_blocks} of {block_size} tokens")
    if gpu_memory:
        cache = int(gpus * gpu_memory * utilization) - weights
        if cache <= 0:
            raise ValueError(f"--gpu-memory {gib(gpu_memory)} x {gpus} x {utilization} leaves "
                             f"nothing for the KV cache after {gib(weights)} of weights")
        return cache, (f"{gpus} x {gib(gpu_memory)} x {utilization} less {gib(weights)} of "
                       "weights (activations not counted: an upper bound)")
    if manifest:
        return manifest, "the manifest's cpuKvCacheGiB x tensorParallelSize"
    return 0, "none modelled (--engine-cache, --num-gpu-blocks or --gpu-memory)"


def weights_bytes(model: Path) -> int:
    """The bytes of a model directory's safetensors files (0 for a lone config.json)."""
    if not model.is_dir():
        return 0
    return sum(f.stat().st_size for f in model.glob("*.safetensors"))


def parse_sweep(spec: str) -> tuple[str, list[int]]:
    """'cpu=8Gi..256Gi' -> ('cpu', sizes doubling from 8Gi to 256Gi) (pure)."""
    name, sep, rng = spec.partition("=")
    lo, dots, hi = rng.partition("..")
    if not sep or not dots or name not in SWEEPABLE:
        raise ValueError(f"--sweep {spec!r}: use TIER=LOW..HIGH with TIER one of "
                         f"{', '.join(SWEEPABLE)}, e.g. cpu=8Gi..256Gi")
    a, b = parse_size(lo), parse_size(hi)
    if not 0 < a <= b:
        raise ValueError(f"--sweep {spec!r}: LOW must be > 0 and <= HIGH")
    sizes = [a]
    while sizes[-1] * 2 <= b:
        sizes.append(sizes[-1] * 2)
    if sizes[-1] != b:
        sizes.append(b)
    return name, sizes


def with_size(pool: PoolModel, name: str, size: int) -> PoolModel:
    """The pool with one cache resized (pure)."""
    if name == "engine":
        return replace(pool, engine_cache_bytes=size)
    tiers = tuple(replace(t, size=size) if t.name == name else t for t in pool.tiers)
    if not any(t.name == name for t in pool.tiers):
        raise ValueError(f"--sweep {name}: the pool has no {name} tier")
    return replace(pool, tiers=tiers)


@dataclass
class Sweep:
    """One tier's curve: (size, figures) per swept size, and its knee."""

    tier: str
    points: list[tuple[int, Result]]

    @property
    def knee(self) -> int:
        return knee(self.points)


def knee(points: list[tuple[int, Result]]) -> int:
    """The smallest size whose hit ratio is within KNEE_POINTS of the best (pure)."""
    best = max(r.hit_ratio for _, r in points)
    return min(size for size, r in points if r.hit_ratio >= best - KNEE_POINTS)


def gib(n: float) -> str:
    for unit, div in (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)):
        if n >= div:
            v = n / div
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.1f}{unit}"
    return f"{n:.0f}"


def result_json(r: Result, pool: PoolModel) -> dict[str, Any]:
    out: dict[str, Any] = {
        "hit_ratio": r.hit_ratio, "bound": r.bound, "block_hit_ratio": r.block_hit_ratio,
        "block_bound": r.block_bound, "requests": r.requests, "prompt_tokens": r.prompt_tokens,
        "served_tokens": dict(r.served), "computed_tokens": r.computed_tokens,
        "reads": dict(r.reads), "writes": dict(r.writes)}
    obj = pool.object_bytes()
    if r.duration_s > 0:
        out["read_bytes_per_s"] = {k: v * obj / r.duration_s for k, v in r.reads.items()}
        out["write_bytes_per_s"] = {k: v * obj / r.duration_s for k, v in r.writes.items()}
    return out


def describe(trace: Trace, pool: PoolModel, source: str) -> str:
    tiers = ", ".join(f"{t.name} {gib(t.size)}{' shared' if t.shared else ' per engine'} "
                      f"({t.eviction})" for t in pool.tiers) or "no kvpool tiers"
    return (f"kvpool plan: {source} ({trace.format}, {len(trace.requests)} requests, "
            f"{trace.block_tokens}-token blocks, {trace.duration_s:.0f} s)\n"
            f"pool: {pool.engines} engine(s), {pool.routing}; vLLM cache "
            f"{gib(pool.engine_cache_bytes) if pool.engine_cache_bytes else 'none'} per engine; "
            f"{tiers}; {pool.chunk_tokens}-token chunks of {pool.bytes_per_token} B/token "
            f"({gib(pool.object_bytes())} objects{_windows(pool)})\n{DEFINITION}")


def _windows(pool: PoolModel) -> str:
    if not pool.window_tokens:
        return ""
    return (f"; sliding-window layers, {pool.window_bytes_per_token} B/token, keep their "
            f"{pool.window_tokens}-token window's last blocks of {pool.block_tokens}")


def render(r: Result, pool: PoolModel) -> str:
    """The served/computed table, hit ratio vs bound, the tiers' traffic (pure)."""
    total = r.prompt_tokens or 1
    rows = [("prompt tokens", r.prompt_tokens, "")]
    names = {"engine": "vLLM prefix cache"}
    for src, n in r.served.items():
        rows.append((f"  from {names.get(src, src + ' tier')}", n, f"{n / total:6.1%}"))
    rows.append(("  computed", r.computed_tokens, f"{r.computed_tokens / total:6.1%}"))
    lines = [f"{a:<26}{b:>16,}  {c}" for a, b, c in rows]
    lines.append(f"{'hit ratio':<26}{r.hit_ratio:>16.1%}  (bound {r.bound:.1%}: "
                 f"{r.hit_ratio / r.bound if r.bound else 0:.0%} of it)")
    lines.append(f"{'per chunk':<26}{r.block_hit_ratio:>16.1%}  (bound {r.block_bound:.1%})")
    obj = pool.object_bytes()
    for t in pool.tiers:
        rate = ""
        if r.duration_s > 0:
            rate = (f", {r.reads[t.name] * obj / r.duration_s / 1e9:.2f} / "
                    f"{r.writes[t.name] * obj / r.duration_s / 1e9:.2f} GB/s over the trace")
        lines.append(f"{t.name} tier: {r.reads[t.name]:,} objects read, "
                     f"{r.writes[t.name]:,} written{rate}")
    return "\n".join(lines)


def render_sweep(name: str, points: list[tuple[int, Result]], best: int) -> str:
    lines = [f"sweep of the {name} {'tier' if name != 'engine' else 'cache'}:",
             f"  {'size':>8}  {'hit ratio':>9}  {'of bound':>8}  {'served by it':>12}"]
    spread = max(r.hit_ratio for _, r in points) - min(r.hit_ratio for _, r in points)
    for size, r in points:
        mark = "  <- knee" if size == best else ""
        own = r.served.get(name, 0) / (r.prompt_tokens or 1)
        lines.append(f"  {gib(size):>8}  {r.hit_ratio:>9.1%}  "
                     f"{r.hit_ratio / r.bound if r.bound else 0:>8.0%}  {own:>12.1%}{mark}")
    if spread < KNEE_POINTS:
        lines.append(f"  (its size moves the hit ratio by under {KNEE_POINTS * 100:.0f} point "
                     f"across the sweep: here it serves what the caches above it already hold)")
    return "\n".join(lines)


def tiers_block(pool: PoolModel, shared_type: str = "redis") -> str:
    """The pool's tiers as a KVCachePool `spec.tiers` block (pure): the cpu tier per engine;
    Redis as a managed Redis whose maxmemory (85% of `memory`) holds the planned size, MinIO
    likewise (its quota: 90% of `storage`); a disk tier at its size (a shared one on a claim
    every node mounts)."""
    lines = ["tiers:"]
    for t in pool.tiers:
        kind = shared_type if t.name == "shared" else t.name
        if kind == "cpu":
            lines.append(f"  cpu: {{size: {format_size(t.size)}, evictionPolicy: {t.eviction}}}")
        elif kind == "redis":
            lines.append(f"  redis:\n    managed: {{memory: {format_size(managed_memory(t.size))}}}")
        elif kind == "s3":
            lines.append(f"  s3:\n    managed: {{storage: {format_size(managed_storage(t.size))}}}")
        else:
            volume = ("persistentVolumeClaim: {claimName: shared-kv}  # ReadWriteMany, every node"
                      if t.shared else "hostPath: {path: /mnt/nvme/kvpool}  # a node-local NVMe")
            lines.append(f"  disk:\n    size: {format_size(t.size)}\n    volume:\n      {volume}")
    return "\n".join(lines)


def _progress(total: int) -> Any:
    """A progress bar on a terminal (tqdm, which vLLM brings; none in an image without it,
    or when stderr is not a terminal)."""
    try:
        from tqdm import tqdm  # type: ignore[import-untyped]
    except ImportError:
        return None
    return tqdm(total=total, unit="req", file=sys.stderr, disable=None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvpool plan", description=__doc__.split("\n\n")[1])
    ap.add_argument("trace", help="JSON-lines trace (Mooncake or Bailian format)")
    ap.add_argument("-f", "--filename", default=None, metavar="POOL.yaml", help="plan this "
                    "KVCachePool: its replicas, router policy, chunkTokens and tiers (checked by "
                    "the operator's validator); --engines and --routing override")
    ap.add_argument("--format", choices=sorted(FORMATS), default=None,
                    help="trace format (default: detected from the first line)")
    ap.add_argument("--block-tokens", type=int, default=None,
                    help="tokens per hash block (default: the format's, 512 or 16)")
    ap.add_argument("--engines", type=int, default=None, help="vLLM replicas (default 1)")
    ap.add_argument("--routing", choices=ROUTINGS, default=None,
                    help="how requests reach engines (default round_robin)")
    ap.add_argument("--engine-cache", default="0", metavar="SIZE", help="each engine's own "
                    "vLLM KV cache, e.g. 20Gi (default: from --num-gpu-blocks, --gpu-memory or a "
                    "CPU pool's manifest; else none modelled)")
    ap.add_argument("--num-gpu-blocks", type=int, default=0, metavar="N",
                    help="vLLM's KV blocks per engine (its log: num_gpu_blocks)")
    ap.add_argument("--gpu-memory", default="0", metavar="SIZE", help="memory of one GPU, e.g. "
                    "80Gi: the KV cache is GPUs x it x --gpu-memory-utilization less the "
                    "weights (--model DIR's safetensors)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--gpus", type=int, default=None, help="GPUs per engine (default 1, or "
                    "the manifest's)")
    ap.add_argument("--cpu", default="0", metavar="SIZE", help="kvpool cpu tier per engine "
                    "(0: none)")
    ap.add_argument("--shared", default="0", metavar="SIZE", help="one tier all engines share "
                    "(0: none); with -f, the capacity of an external Redis or S3")
    ap.add_argument("--shared-type", default="redis", choices=("redis", "disk"),
                    help="what the shared tier is, for the printed tiers block")
    ap.add_argument("--eviction", choices=("lru", "arc"), default="lru",
                    help="the cpu tier's eviction policy")
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--no-tails", action="store_true", help="no tail objects (the connector's "
                    "tail_objects: false): a prompt's blocks past its last chunk are not stored")
    ap.add_argument("--model", default=None, metavar="CONFIG", help="a model's config.json "
                    "(or its directory): KV bytes per token")
    ap.add_argument("--kv-dtype", default="auto", help="KV cache dtype (auto = bfloat16)")
    ap.add_argument("--block-size", type=int, default=16, help="vLLM's KV block size (16 on "
                    "CUDA): a sliding-window layer keeps its window's last blocks per chunk")
    ap.add_argument("--bytes-per-token", type=int, default=None,
                    help="KV bytes per token, instead of --model (default: 131072, "
                    "a Llama-3-8B-shaped model in bfloat16)")
    ap.add_argument("--sweep", action="append", default=[], metavar="TIER=LOW..HIGH",
                    help="replay once per size, doubling: cpu=8Gi..256Gi; repeat it to sweep "
                    "several tiers, each with the others as given")
    ap.add_argument("--max-requests", type=int, default=MAX_REQUESTS)
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the figures")
    ap.add_argument("--png", default=None, metavar="FILE", help="also draw the sweep's curve "
                    "(hit ratio and each source's share against the size, the bound, the knee); "
                    "needs matplotlib")
    args = ap.parse_args(argv)

    def fail(msg: str) -> int:
        print(f"kvpool plan: {msg}", file=sys.stderr)
        return 2

    try:
        if args.model:
            cfg_path = Path(args.model)
            cfg_path = cfg_path / "config.json" if cfg_path.is_dir() else cfg_path
            try:
                config = json.loads(cfg_path.read_text())
            except OSError as e:
                return fail(f"--model {args.model}: {e.strerror or e}")
            except json.JSONDecodeError as e:
                return fail(f"--model {args.model}: not a JSON config.json ({e.msg})")
            shape = kv_shape(config, args.kv_dtype)
        else:
            shape = KVShape(args.bytes_per_token or 131072)
        bpt = shape.full
        if bpt <= 0 or args.chunk_tokens <= 0:
            return fail("--bytes-per-token and --chunk-tokens must be > 0")
        sizes = {k: parse_size(getattr(args, k))
                 for k in ("engine_cache", "cpu", "shared", "gpu_memory")}
        if args.num_gpu_blocks < 0 or not 0 < args.gpu_memory_utilization <= 1:
            return fail("--num-gpu-blocks must be >= 0 and --gpu-memory-utilization in (0, 1]")
        if args.engines is not None and args.engines < 1:
            return fail(f"--engines must be >= 1, not {args.engines}")
        notes: list[str] = []
        if args.filename:
            if sizes["cpu"]:
                return fail("--cpu with -f: the manifest's tiers are the pool (--sweep cpu=... "
                            "varies its cpu tier)")
            planned = read_pool(args.filename, bytes_per_token=bpt, engines=args.engines,
                                routing=args.routing, external_size=sizes["shared"])
            pool, notes = planned.pool, planned.notes
            gpus, manifest_cache = planned.gpus, planned.cpu_kv_cache
        else:
            gpus, manifest_cache = 1, 0
            tiers = []
            if sizes["cpu"]:
                tiers.append(TierModel("cpu", sizes["cpu"], shared=False, eviction=args.eviction))
            if sizes["shared"]:
                tiers.append(TierModel("shared", sizes["shared"], shared=True))
            pool = PoolModel(engines=args.engines or 1, bytes_per_token=bpt, tiers=tuple(tiers),
                             routing=args.routing or "round_robin", chunk_tokens=args.chunk_tokens)
        if args.block_size < 1:
            return fail(f"--block-size must be >= 1, not {args.block_size}")
        cache, cache_source = engine_cache(
            sizes["engine_cache"], shape, num_gpu_blocks=args.num_gpu_blocks,
            block_size=args.block_size, gpu_memory=sizes["gpu_memory"],
            utilization=args.gpu_memory_utilization, gpus=args.gpus or gpus or 1,
            weights=weights_bytes(Path(args.model)) if args.model else 0,
            manifest=manifest_cache)
        notes.append(f"vLLM's own cache: {gib(cache) if cache else 0} per engine, {cache_source}")
        pool = replace(pool, window_bytes_per_token=shape.window, engine_cache_bytes=cache,
                       window_tokens=shape.window_tokens, block_tokens=args.block_size,
                       tails=not args.no_tails)
        sweeps = [parse_sweep(spec) for spec in args.sweep]
        if args.png and not sweeps:
            return fail("--png draws a sweep's curve: add --sweep TIER=LOW..HIGH")
        names = [name for name, _ in sweeps]
        if len(set(names)) < len(names):
            return fail(f"--sweep: each tier once ({', '.join(names)})")
        for name, sizes_ in sweeps:
            with_size(pool, name, sizes_[0])  # refuses a tier the pool lacks
        t0 = time.monotonic()
        trace = read_trace(args.trace, args.format, args.block_tokens, args.max_requests)
    except (TraceError, PoolFileError, ValueError) as e:
        return fail(str(e))

    runs = [(name, size, with_size(pool, name, size)) for name, sizes_ in sweeps
            for size in sizes_] or [("", 0, pool)]
    bar = _progress(len(trace.requests) * (len(runs) + (len(sweeps) > 1)))
    try:
        results = [(name, size, replay(trace, p, bar.update if bar else None))
                   for name, size, p in runs]
        curves = [Sweep(name, [(size, r) for n, size, r in results if n == name])
                  for name, _ in sweeps]
        chosen = pool
        for curve in curves:
            chosen = with_size(chosen, curve.tier, curve.knee)
        if len(curves) > 1:  # each knee found with the others as given: the set, replayed
            summary = replay(trace, chosen, bar.update if bar else None)
        elif curves:
            summary = dict(curves[0].points)[curves[0].knee]
        else:
            summary = results[0][2]
    except ValueError as e:  # chunk size vs the trace's blocks, sessions for consistent_hash
        return fail(str(e))
    finally:
        if bar:
            bar.close()
    elapsed = time.monotonic() - t0
    print(describe(trace, pool, Path(args.trace).name))
    for note in notes:
        print(f"note: {note}")
    print()
    report: dict[str, Any] = {"definition": DEFINITION, "trace": {
        "format": trace.format, "requests": len(trace.requests),
        "block_tokens": trace.block_tokens, "duration_s": trace.duration_s},
        "bytes_per_token": bpt, "wall_s": elapsed}
    for curve in curves:
        print(render_sweep(curve.tier, curve.points, curve.knee))
        print()
    print(render(summary, chosen))
    if curves:
        print(f"\nrecommended (each swept tier at its knee: the smallest size within "
              f"{KNEE_POINTS * 100:.0f} percentage point of its sweep's best hit ratio):")
        print(tiers_block(chosen, args.shared_type))
        report["sweeps"] = [{"tier": c.tier, "knee": c.knee, "points": [
            {"size": size, **result_json(r, with_size(pool, c.tier, size))}
            for size, r in c.points]} for c in curves]
    report.update(result_json(summary, chosen))
    replays = len(runs) + (len(curves) > 1)
    print(f"\n({len(trace.requests) * replays:,} requests replayed in {elapsed:.1f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if args.png and curves:  # --png without --sweep was refused above
        from kvpool_cli.plan_chart import chart

        try:
            chart(curves, Path(args.png), f"{Path(args.trace).name}: {pool.engines} "
                  f"engine(s), {pool.routing}")
        except ImportError:
            return fail("--png needs matplotlib (pip install matplotlib)")
        except OSError as e:
            return fail(f"--png {args.png}: {e.strerror or e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
