"""kvpool asks Linux for the AMX tile state (amx.py): vLLM's CPU attention uses AMX tiles
without asking, and a fresh engine whose first step is a full hit dies at its first tile
instruction (the e2e tests of P/D decode engines and of fresh native engines hitting a
secondary tier did, on an AMX host, before this)."""

from __future__ import annotations

import ctypes
import platform

import pytest
import torch

from kvpool_connector.amx import ask_for_amx_tiles

ARCH_GET_XCOMP_PERM = 0x1022
XFEATURE_XTILEDATA = 18
SYS_ARCH_PRCTL = 158  # x86-64


def _tiles_permitted() -> bool:
    """Whether Linux lets this process use the AMX tile data (arch_prctl, read only)."""
    libc = ctypes.CDLL(None, use_errno=True)
    features = ctypes.c_ulong(0)
    assert libc.syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ctypes.byref(features)) == 0
    return bool(features.value & (1 << XFEATURE_XTILEDATA))


def test_caches_off_the_host_ask_for_nothing():
    assert ask_for_amx_tiles("cuda") is False


@pytest.mark.skipif(platform.machine() != "x86_64", reason="arch_prctl is x86-64's")
def test_host_caches_get_the_tile_state_where_the_cpu_has_amx():
    """On an AMX CPU the process holds the tile state afterwards; elsewhere nothing is
    asked (the same assertions, the answer taken from the CPU)."""
    has_amx = torch.cpu._is_amx_tile_supported()
    assert ask_for_amx_tiles("cpu") is has_amx
    assert _tiles_permitted() is has_amx
    assert ask_for_amx_tiles("cpu") is has_amx  # asking again changes nothing
