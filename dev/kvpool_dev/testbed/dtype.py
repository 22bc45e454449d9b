"""The dtype the test bed's engines compute in: bfloat16 where the CPU has it natively,
float32 elsewhere.

The generated models are stored in bfloat16, so vLLM's `auto` would run them in bfloat16.
CPUs without AVX-512 BF16 or AMX emulate it: on a 2-core AVX2 EPYC a torch bf16 matmul ran
at 1.3 GFLOPS against 98 in float32, and every demo, bench and test engine ran many times
slower than it had to. The CPU's flags say whether bf16 is native; where they claim it, a
short timed matmul confirms it (a flag can be present while the kernel still emulates).
`KVPOOL_DTYPE` (or a tool's `--dtype`) overrides the choice.

Comparisons stay fair: every engine of one run uses the same choice, and the KV layout
fingerprint includes the dtype, so an object saved in one dtype is never a hit in another.
"""

from __future__ import annotations

import functools
import os
import platform
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

ENV = "KVPOOL_DTYPE"
CHOICES = ("auto", "bfloat16", "float32", "float16")
# /proc/cpuinfo flags (x86) or Features (aarch64) that mean bf16 matmuls run in hardware
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
# a flagged CPU must also measure bf16 at no less than this share of float32's speed
PROBE_MIN_RATIO = 0.5


class DtypeError(ValueError):
    """A dtype override that vLLM would not take; the message names the variable."""


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str                        # what engines get as --dtype / LLM(dtype=...)
    reason: str
    cpu: str
    bf16_gflops: float | None = None  # the probe's figures, when it ran
    fp32_gflops: float | None = None

    def describe(self) -> str:
        probe = ""
        if self.bf16_gflops is not None and self.fp32_gflops is not None:
            probe = f"; probe: bf16 {self.bf16_gflops:.1f} vs float32 {self.fp32_gflops:.1f} GFLOPS"
        return f"engine dtype: {self.dtype} ({self.reason}{probe}) on {self.cpu}"


def read_cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The first processor's flags (x86 `flags`, aarch64 `Features`); pure."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_model(cpuinfo: str) -> str:
    """`lscpu`'s model name, from /proc/cpuinfo; pure."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model name", "CPU part") and value.strip():
            return value.strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def matmul_gflops(dtype_name: str, n: int = 256, seconds: float = 0.15) -> float:
    """GFLOPS of an n x n matmul in `dtype_name` on this process's threads, timed for about
    `seconds` (at least one product)."""
    import torch

    dt = getattr(torch, dtype_name)
    a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
    a @ b  # first call: kernel selection, caches
    runs, t0 = 0, time.perf_counter()
    while True:
        a @ b
        runs += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return 2 * n ** 3 * runs / elapsed / 1e9


def decide(flags: frozenset[str], cpu: str, override: str | None,
           probe: Callable[[str], float] = matmul_gflops, source: str = ENV) -> DtypeChoice:
    """The dtype for this CPU (pure but for `probe`, which runs only on a flagged CPU);
    `override` comes from `source` (named in errors)."""
    if override:
        value = override.strip().lower()
        if value not in CHOICES:
            raise DtypeError(f"{source}={override!r}: expected one of {', '.join(CHOICES)}")
        return DtypeChoice(value, f"set by {source}", cpu)
    native = sorted(f for f in NATIVE_BF16_FLAGS if f in flags)
    if not native:
        return DtypeChoice("float32", "no native bf16: none of "
                           f"{'/'.join(NATIVE_BF16_FLAGS)} in the CPU flags", cpu)
    bf16, fp32 = probe("bfloat16"), probe("float32")
    if bf16 >= PROBE_MIN_RATIO * fp32:
        return DtypeChoice("bfloat16", f"native bf16 ({'/'.join(native)})", cpu, bf16, fp32)
    return DtypeChoice("float32", f"{'/'.join(native)} flagged but bf16 measured slow", cpu,
                       bf16, fp32)


@functools.cache
def _choose(override: str | None) -> DtypeChoice:
    info = read_cpuinfo()
    return decide(cpu_flags(info), cpu_model(info), override)


def choose(env: Mapping[str, str] | None = None) -> DtypeChoice:
    """This machine's choice (once per process), honouring `KVPOOL_DTYPE`."""
    env = os.environ if env is None else env
    return _choose(env.get(ENV) or None)


def engine_dtype(explicit: str | None = None) -> str:
    """The dtype an engine should get: `explicit` (a tool's --dtype) or `choose()`."""
    if explicit:
        return decide(frozenset(), "", explicit, source="--dtype").dtype
    return choose().dtype
