"""`kvpool bench dtype`: the generated model's prefill speed in each dtype, in one run.

Why the test bed picks its engine dtype from the CPU (kvpool_dev.testbed.dtype): on a CPU
without native bf16 every bfloat16 engine emulates its matmuls. This starts one offline
engine per dtype (both at once: a boot is mostly imports), then times the same prefills on
each in alternating order (bf16, f32, f32, bf16, ...), so drift on a shared machine falls on
both arms alike. Prints prefill tokens/s per dtype and their ratio, and the test bed's choice.
A benchmark script (timings side by side), not a timed test.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from kvpool_dev.testbed import dtype as dtype_choice

DTYPES = ("bfloat16", "float32")


def make_prompt(n: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def order(rounds: int) -> list[str]:
    """ABBA order of the arms over `rounds` rounds (pure)."""
    out: list[str] = []
    for r in range(rounds):
        out += list(DTYPES if r % 2 == 0 else reversed(DTYPES))
    return out


def report(samples: dict[str, list[float]], tokens: int, choice: str) -> str:
    """The side-by-side table (pure): prefill tokens/s = tokens / median TTFT."""
    rate = {d: tokens / statistics.median(v) for d, v in samples.items() if v}
    lines = [f"prefill of {tokens} tokens (max_tokens=1), median of {len(samples[DTYPES[0]])} "
             "runs per dtype, alternating order", ""]
    for d in DTYPES:
        if d in rate:
            lines.append(f"  {d:<9} {rate[d]:>9.0f} tokens/s  (TTFT median "
                         f"{statistics.median(samples[d]):.2f} s)")
    if all(d in rate for d in DTYPES):
        lines.append(f"  float32 / bfloat16: {rate['float32'] / rate['bfloat16']:.1f}x")
    lines.append(f"  test bed's choice here: {choice}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvpool bench dtype", description=(
        "prefill tokens/s of the generated model in bfloat16 and float32, same run"))
    ap.add_argument("--preset", default="bench", help="generated model preset (default bench)")
    ap.add_argument("--tokens", type=int, default=256, help="prompt length (default 256: a "
                    "bf16 prefill of the bench model takes ~1 min on a CPU that emulates bf16)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds (default 2)")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the samples as JSON")
    args = ap.parse_args(argv)

    from kvpool_dev.testbed.engine import OfflineEngine
    from kvpool_dev.testbed.localmodel import ensure_model

    choice = dtype_choice.choose()
    print(choice.describe(), file=sys.stderr, flush=True)
    model = ensure_model(args.preset)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    engines = {d: OfflineEngine(model, dtype=d, max_model_len=args.tokens + 64,
                                enable_prefix_caching=False) for d in DTYPES}
    samples: dict[str, list[float]] = {d: [] for d in DTYPES}
    try:
        for eng in engines.values():  # boot together, serve one at a time
            eng.launch()
        for d, eng in engines.items():
            eng.wait_ready()
            eng.generate([make_prompt(16, 7, vocab)], max_tokens=1)  # warm-up
            print(f"{d} engine up", file=sys.stderr, flush=True)
        for i, d in enumerate(order(args.rounds)):
            t0 = time.perf_counter()
            out = engines[d].generate([make_prompt(args.tokens, 100 + i, vocab)], max_tokens=1)[0]
            ttft = out["ttft_s"] or (time.perf_counter() - t0)
            samples[d].append(ttft)
            print(f"  {d}: {args.tokens / ttft:.0f} tokens/s", file=sys.stderr, flush=True)
    finally:
        for eng in engines.values():
            eng.stop()
    print(report(samples, args.tokens, choice.dtype))
    if args.json:
        Path(args.json).write_text(json.dumps({"tokens": args.tokens, "samples": samples,
                                               "choice": choice.dtype, "cpu": choice.cpu}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
