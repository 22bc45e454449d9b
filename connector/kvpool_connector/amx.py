"""AMX tile state for vLLM's CPU attention kernel, asked for before a step can need it.

Linux hands a process the AMX tile registers only after it asks (`arch_prctl`
ARCH_REQ_XCOMP_PERM); a tile instruction before that is an illegal instruction, and the
engine dies without a word. vLLM's CPU attention kernel uses AMX tiles for bfloat16 caches
with blocks of a multiple of 32 tokens, but it never asks: the permission comes from oneDNN,
the first time a bfloat16 matmul is large enough for its AMX kernels. A fresh engine whose
first step is a connector's full hit computes one token, a matmul oneDNN runs without AMX,
and its attention then dies (measured: SIGILL at `tilezero` in
`cpu_attention::TileGemm122`, on an Intel Xeon with amx_bf16, for the first request of a
P/D decode engine and of a fresh native engine hitting a secondary tier; a plain engine's
first request computes a whole prompt, so plain vLLM never meets it). kvpool's connectors
make that first step, so they ask at registration.
"""

from __future__ import annotations

import logging

log = logging.getLogger("kvpool.connector")


def ask_for_amx_tiles(device_type: str) -> bool:
    """Ask for the AMX tile state when the KV caches are in host memory on a CPU with AMX
    (through torch, which makes the call); whether the process has it. Idempotent."""
    if device_type != "cpu":
        return False
    import torch

    try:
        if not torch.cpu._is_amx_tile_supported():
            return False
        granted = bool(torch.cpu._init_amx())
    except (AttributeError, RuntimeError) as e:  # an older torch: oneDNN still asks, later
        log.warning("kvpool: could not ask for the AMX tile state (%s); vLLM's AMX attention "
                    "may die on a fresh engine's first hit", e)
        return False
    if not granted:
        log.warning("kvpool: Linux refused the AMX tile state; vLLM's AMX attention may die "
                    "on a fresh engine's first hit")
    return granted
