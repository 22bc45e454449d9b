"""`kvpool bench copy`: the connector's chunk copies between the paged KV cache and host
memory, against a plain copy of the same bytes, side by side in one run.

A chunk of a Llama-3-8B-shaped cache (32 layers, 8 KV heads of 128, 16-token blocks,
bfloat16; vLLM's FlashAttention layout `[2, blocks, block_size, heads, head]` on CUDA, the
CPU backend's `[blocks, heads, block_size, 2*head]` on the CPU) is saved (`KVLayout.gather`:
the cache's blocks -> a host buffer, pinned on CUDA) and loaded (`KVLayout.scatter`: the
host buffer -> other blocks), with random block ids, as the worker does. The bound: the same
number of bytes copied as one contiguous tensor between the device and a pinned buffer
(memcpy on the CPU). Arms alternate (bound, kvpool, kvpool, bound, ...), so drift falls on
both. Prints GB/s per direction and kvpool / bound. A benchmark (ratios of one run), not a
timed test; needs no vLLM, so it runs on a GPU machine with torch alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

LAYERS, HEADS, HEAD, BLOCK = 32, 8, 128, 16


def caches(device: str, num_blocks: int, layers: int = LAYERS) -> dict[str, torch.Tensor]:
    """Random caches in the backend's layout for the device (bfloat16)."""
    if device == "cuda":
        shape: tuple[int, ...] = (2, num_blocks, BLOCK, HEADS, HEAD)
    else:
        shape = (num_blocks, HEADS, BLOCK, 2 * HEAD)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(shape, device=device).to(
        torch.bfloat16) for i in range(layers)}


def chunk_bytes(chunk_tokens: int, layers: int) -> int:
    """Bytes of one chunk of the bench's cache, either layout (pure)."""
    return layers * 2 * chunk_tokens * HEADS * HEAD * 2  # K and V, bfloat16


def check_args(args: argparse.Namespace, device: str, free: int) -> None:
    """ValueError naming the option for input the run cannot take: a device that is not
    here, a count that is not positive, a chunk of partial blocks, or caches (8 chunks, plus
    the host and device copies of one) larger than the `free` bytes of that device (pure)."""
    if device not in ("cuda", "cpu") or (device == "cuda" and not torch.cuda.is_available()):
        raise ValueError(f"--device {device}: not available here")
    for name in ("chunk_tokens", "layers", "reps"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive number")
    if args.chunk_tokens % BLOCK:
        raise ValueError(f"--chunk-tokens must be a positive number of whole {BLOCK}-token "
                         "blocks")
    need = 10 * chunk_bytes(args.chunk_tokens, args.layers)
    if need > free:
        raise ValueError(f"--chunk-tokens/--layers: the run needs {need / 2**30:.1f} GiB, "
                         f"{device} has {free / 2**30:.1f} GiB free")


def free_bytes(device: str) -> int:
    """Free memory of the device: CUDA's own count, or MemAvailable on the host."""
    if device == "cuda":
        return torch.cuda.mem_get_info()[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def rate(nbytes: int, seconds: list[float]) -> float:
    """GB/s of the median time (pure)."""
    return nbytes / statistics.median(seconds) / 1e9


def render(r: dict[str, Any]) -> str:
    out = [f"kvpool bench copy: {r['device']} ({r['device_name']}), a {r['chunk_tokens']}-token "
           f"chunk of a {r['layers']}-layer cache ({r['chunk_bytes'] / 2**20:.0f} MiB), "
           f"{r['reps']} reps per arm, medians",
           f"  {'direction':<26}{'bound GB/s':>12}{'kvpool GB/s':>13}{'kvpool / bound':>16}"]
    for d in ("save (cache -> host)", "load (host -> cache)"):
        b, k = r["gbps"][d]["bound"], r["gbps"][d]["kvpool"]
        out.append(f"  {d:<26}{b:>12.1f}{k:>13.1f}{k / b:>16.2f}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvpool bench copy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if there is one)")
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        check_args(args, device, free_bytes(device) if device in ("cuda", "cpu") else 0)
    except ValueError as exc:
        print(f"kvpool bench copy: {exc}", file=sys.stderr)
        return 2
    from kvpool_connector.connector.layout import KVLayout

    n = args.chunk_tokens // BLOCK
    num_blocks = 8 * n
    kv = caches(device, num_blocks, args.layers)
    layout = KVLayout(kv, list(kv), num_blocks, "BENCH")
    nbytes = layout.chunk_nbytes(n)
    pin = device == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    gen = torch.Generator().manual_seed(0)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def timed(fn) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    def ids() -> list[int]:
        return torch.randperm(num_blocks, generator=gen)[:n].tolist()

    picks: list[list[int]] = [ids()]  # each rep's block ids, drawn outside the timings

    arms = {
        ("save (cache -> host)", "bound"): lambda: host.copy_(flat, non_blocking=True),
        ("save (cache -> host)", "kvpool"): lambda: layout.gather(torch.tensor(picks[-1]),
                                                                  host),
        ("load (host -> cache)", "bound"): lambda: flat.copy_(host, non_blocking=True),
        ("load (host -> cache)", "kvpool"): lambda: layout.scatter(host, n, list(range(n)),
                                                                   picks[-1]),
    }
    for fn in arms.values():  # warm-up: first-call costs out of the timings
        timed(fn)
    samples: dict[tuple[str, str], list[float]] = {k: [] for k in arms}
    for rep in range(args.reps):
        picks.append(ids())
        for direction in ("save (cache -> host)", "load (host -> cache)"):
            order = ("bound", "kvpool") if rep % 2 == 0 else ("kvpool", "bound")
            for arm in order:
                samples[(direction, arm)].append(timed(arms[(direction, arm)]))
    report = {"device": device,
              "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "chunk_tokens": args.chunk_tokens, "layers": args.layers, "chunk_bytes": nbytes,
              "reps": args.reps,
              "gbps": {d: {a: rate(nbytes, samples[(d, a)]) for a in ("bound", "kvpool")}
                       for d in ("save (cache -> host)", "load (host -> cache)")},
              "ms": {f"{d} / {a}": statistics.median(v) * 1000 for (d, a), v in samples.items()}}
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
