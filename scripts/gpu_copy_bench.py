#!/usr/bin/env python3
"""The connector's copy path on a GPU: gather/scatter of paged KV blocks GPU <-> pinned host,
against a plain `torch` pinned copy of the same bytes.

Uses the connector's own `KVLayout.gather` / `KVLayout.scatter` (connector/kvpool_connector/
connector/layout.py), loaded straight from its file when the package cannot be imported
(a GPU machine may have torch with CUDA but no vLLM). Needs only torch.

    python scripts/gpu_copy_bench.py                  # CUDA if available
    python scripts/gpu_copy_bench.py --device cpu     # same code path on the CPU (smaller)
    python scripts/gpu_copy_bench.py --json

Paged caches are one tensor per layer in a FlashAttention-style layout
`[2, num_blocks, block_size, kv_heads, head_size]` (block dimension 1; `--layout standard`
puts blocks first). A chunk is `--chunk-tokens` tokens of every layer; each iteration moves
`--chunks` chunks made of random (non-contiguous) blocks. Not part of CI.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

LAYOUT_FILE = Path(__file__).resolve().parents[1] / "connector/kvpool_connector/connector/layout.py"


def load_kvlayout():
    """The connector's KVLayout class: from the package, else from its file (torch only)."""
    try:
        from kvpool_connector.connector.layout import KVLayout
        return KVLayout, "kvpool_connector.connector.layout"
    except ImportError:
        spec = importlib.util.spec_from_file_location("kvpool_layout", LAYOUT_FILE)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look their module up there
        spec.loader.exec_module(mod)
        return mod.KVLayout, str(LAYOUT_FILE)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, iters: int) -> float:
    """Seconds per call, after one warm-up call."""
    fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / iters


def run(args) -> dict:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    pin = device.type == "cuda"
    KVLayout, source = load_kvlayout()
    shape = ((2, args.num_blocks, args.block_size, args.kv_heads, args.head_size)
             if args.layout == "flash" else
             (args.num_blocks, 2, args.block_size, args.kv_heads, args.head_size))
    names = [f"model.layers.{i}.self_attn.attn" for i in range(args.layers)]
    caches = {n: torch.randn(shape, dtype=dtype, device=device) for n in names}
    layout = KVLayout(caches, names, args.num_blocks, backend=f"bench-{args.layout}")

    blocks_per_chunk = args.chunk_tokens // args.block_size
    chunk_bytes = layout.chunk_nbytes(blocks_per_chunk)
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(args.num_blocks, generator=gen)
    block_ids = [perm[i * blocks_per_chunk:(i + 1) * blocks_per_chunk].clone()
                 for i in range(args.chunks)]
    host = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=pin) for _ in range(args.chunks)]
    rows = list(range(blocks_per_chunk))            # scatter takes Python lists
    block_lists = [ids.tolist() for ids in block_ids]
    total = chunk_bytes * args.chunks

    def gather():
        for ids, buf in zip(block_ids, host, strict=True):
            layout.gather(ids, buf)

    def scatter():
        for ids, buf in zip(block_lists, host, strict=True):
            layout.scatter(buf, blocks_per_chunk, rows, ids)

    # The plain baseline: the same bytes, one contiguous device tensor <-> pinned host.
    dev_flat = [torch.empty(chunk_bytes, dtype=torch.uint8, device=device) for _ in range(args.chunks)]
    host_flat = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=pin) for _ in range(args.chunks)]

    def plain_d2h():
        for d, h in zip(dev_flat, host_flat, strict=True):
            h.copy_(d, non_blocking=pin)

    def plain_h2d():
        for d, h in zip(dev_flat, host_flat, strict=True):
            d.copy_(h, non_blocking=pin)

    gather()
    sync(device)
    check = [b.clone() for b in host]
    results = {}
    for name, fn in (("gather (device -> host)", gather), ("plain copy (device -> host)", plain_d2h),
                     ("scatter (host -> device)", scatter), ("plain copy (host -> device)", plain_h2d)):
        s = timed(fn, device, args.iters)
        results[name] = {"seconds": s, "GBps": total / s / 1e9}
    # Round trip is exact: scatter the gathered bytes back, gather again, compare.
    scatter()
    gather()
    sync(device)
    exact = all(torch.equal(a, b) for a, b in zip(check, host, strict=True))
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "layout_source": source, "layout": args.layout,
        "pinned": pin, "dtype": args.dtype, "layers": args.layers,
        "block_size": args.block_size, "chunk_tokens": args.chunk_tokens,
        "chunk_bytes": chunk_bytes, "chunks_per_iter": args.chunks, "bytes_per_iter": total,
        "round_trip_exact": exact, "results": results,
        "ratio_gather_vs_plain": results["gather (device -> host)"]["GBps"]
        / results["plain copy (device -> host)"]["GBps"],
        "ratio_scatter_vs_plain": results["scatter (host -> device)"]["GBps"]
        / results["plain copy (host -> device)"]["GBps"],
    }


def render(r: dict) -> str:
    lines = [f"kvpool copy path on {r['device']} (torch {r['torch']}, {r['layout']} layout, "
             f"{'pinned' if r['pinned'] else 'pageable'} host memory)",
             f"{r['layers']} layers, {r['chunk_tokens']}-token chunks of "
             f"{r['chunk_bytes'] / 2**20:.1f} MiB, {r['chunks_per_iter']} chunks per iteration "
             f"(KVLayout from {r['layout_source']})", ""]
    for name, v in r["results"].items():
        lines.append(f"  {name:<30} {v['GBps']:8.2f} GB/s   ({v['seconds'] * 1e3:.2f} ms)")
    lines += ["", f"  gather / plain:  {r['ratio_gather_vs_plain']:.2f}",
              f"  scatter / plain: {r['ratio_scatter_vs_plain']:.2f}",
              f"  round trip byte-exact: {r['round_trip_exact']}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layout", choices=("flash", "standard"), default="flash")
    ap.add_argument("--layers", type=int, default=None, help="default 32 (cuda) / 8 (cpu)")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=None, help="default 4096 (cuda) / 512 (cpu)")
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=None, help="default 8 (cuda) / 4 (cpu)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--iters", type=int, default=None, help="default 20 (cuda) / 5 (cpu)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("no CUDA device; use --device cpu", file=sys.stderr)
        return 2
    for name, gpu, cpu in (("layers", 32, 8), ("num_blocks", 4096, 512), ("chunks", 8, 4),
                           ("iters", 20, 5)):
        if getattr(args, name) is None:
            setattr(args, name, gpu if cuda else cpu)
    if args.chunk_tokens % args.block_size or \
            args.chunks * (args.chunk_tokens // args.block_size) > args.num_blocks:
        print("--chunk-tokens must be a multiple of --block-size and the chunks must fit in "
              "--num-blocks", file=sys.stderr)
        return 2
    r = run(args)
    print(json.dumps(r, indent=2) if args.json else render(r))
    return 0 if r["round_trip_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
