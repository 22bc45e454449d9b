"""Threads for the store's CPU-bound work that releases the GIL (MACs, AES-GCM): on a
machine with a core to spare, the objects of a batch are sealed side by side. Only CPU work
runs here, never I/O, so a hung mount or a slow server can never tie these threads up.

(Checking a disk read's pieces here while the next piece is read was tried and measured
slower: the hand-off per 512 KiB piece costs more than the overlap saves.)
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

PARALLEL_MIN_BYTES = 1 << 20  # below this, a thread hand-off costs more than it saves

_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def pool() -> ThreadPoolExecutor:
    """The process's CPU pool (one per process: every store and tier shares it)."""
    global _pool
    if _pool is None:
        with _lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2)),
                                           thread_name_prefix="kvpool-cpu")
    return _pool


def run_each(fn: Callable, items: list, nbytes: int) -> None:
    """fn(item) for every item, side by side on the pool when there are several and they
    add up to PARALLEL_MIN_BYTES; the first exception is raised after all finished.
    (Writing each item as soon as it is sealed, overlapping sealing with the tier's I/O, was
    tried too and measured no better on 2 cores.)"""
    if len(items) < 2 or nbytes < PARALLEL_MIN_BYTES:
        for item in items:
            fn(item)
        return
    futures = [pool().submit(fn, item) for item in items[1:]]
    try:
        fn(items[0])  # the caller's thread works too
    finally:
        errors = [f.exception() for f in futures]
    for e in errors:
        if e is not None:
            raise e
