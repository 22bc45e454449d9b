"""Host buffers for saves and loads, allocated once and reused.

Pinned (page-locked) memory is slow to allocate and easy to leak; pageable memory grows
with load. Every chunk that leaves or enters the paged KV cache goes through a buffer of
one chunk's size taken from a pool whose total size is fixed at start, so the connector's
host memory stays bounded however slow a tier gets: when the save pool is exhausted, a save
is dropped (a future miss, counted) instead of allocating more.
"""

from __future__ import annotations

import threading

import torch


class BufferPool:
    """`count` buffers of `nbytes` each (pinned on CUDA), handed out and given back."""

    def __init__(self, nbytes: int, count: int, pin: bool) -> None:
        self.nbytes = nbytes
        self.count = count
        self._free = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(count)]
        self._lock = threading.Lock()

    def take(self, n: int) -> list[torch.Tensor] | None:
        """n buffers, or None (nothing taken) when fewer are free."""
        with self._lock:
            if len(self._free) < n:
                return None
            out, self._free = self._free[-n:], self._free[:-n]
            return out

    def give(self, bufs: list[torch.Tensor]) -> None:
        with self._lock:
            self._free.extend(bufs)
            assert len(self._free) <= self.count, "a buffer was given back twice"

    @property
    def free(self) -> int:
        return len(self._free)
