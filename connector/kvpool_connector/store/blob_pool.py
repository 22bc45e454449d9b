"""Reused buffers for sealed objects (the one copy `Record.freeze` makes per write).

A fresh multi-MiB buffer costs a page fault per 4 KiB page whenever the allocator has given
the memory back to the OS, which glibc does as soon as a batch's buffers are freed: for a
2 MiB object that is ~0.2 ms, as long as encrypting it. So buffers of written objects go
back to a small free list, keyed by size (a pool's chunks all have the same size), and the
next write takes one from there.

A buffer is reused only when nothing references it any more: `give` checks the array's
reference count, so a memoryview that escaped (and pins numpy's array) keeps it out of the
pool for good. The free list holds at most MAX_BYTES.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

MAX_BYTES = 128 << 20
MIN_SIZE = 256 << 10  # smaller buffers come cheap from the allocator's own free lists

_free: dict[int, list[np.ndarray]] = {}
_held = 0
_lock = threading.Lock()


def take(n: int) -> np.ndarray:
    """n writable bytes, not zeroed (every byte is written next)."""
    if n >= MIN_SIZE:
        with _lock:
            bufs = _free.get(n)
            if bufs:
                global _held
                _held -= n
                return bufs.pop()
    return np.empty(n, dtype=np.uint8)


def give(arr: np.ndarray) -> None:
    """Return a buffer from take() that its user is done with (and holds no view of)."""
    global _held
    n = arr.nbytes
    # the caller's reference and getrefcount's argument: any more is a view still alive
    if n < MIN_SIZE or sys.getrefcount(arr) > 3:
        return
    with _lock:
        if _held + n <= MAX_BYTES:
            _free.setdefault(n, []).append(arr)
            _held += n


def held_bytes() -> int:
    return _held
