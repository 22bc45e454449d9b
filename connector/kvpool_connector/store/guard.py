"""Calls into a tier that run on a pool may outlive the caller's deadline; `CallGuard`
makes sure such a call never writes into the caller's buffers once the caller has given up
(it may reuse them for another read by then)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable


class CallGuard:
    """Lets a tier call that runs on a pool write into the caller's buffers only while the
    caller still waits for it: a read that outlives its deadline (a hung mount) must never
    land in a buffer the caller has since reused."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.cancelled = False

    @contextlib.contextmanager
    def writing(self):
        """`with guard.writing() as ok:` write only if ok (the caller is still waiting)."""
        with self._lock:
            yield not self.cancelled

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True


class _Unguarded(CallGuard):
    """Calls in the caller's own thread (and writes into a tier's own memory) can always
    write."""

    def writing(self):
        return contextlib.nullcontext(True)


UNGUARDED = _Unguarded()
_local = threading.local()


def current_guard() -> CallGuard:
    """The guard of the tier call running in this thread."""
    return getattr(_local, "guard", None) or UNGUARDED


def run_guarded(guard: CallGuard, fn: Callable, args: tuple):
    """Run fn(*args) in this (pool) thread with `guard` as its current guard."""
    _local.guard = guard
    try:
        return fn(*args)
    finally:
        _local.guard = None
