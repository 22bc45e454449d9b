"""The scheduler's lookup jobs: the threads that ask the remote tiers (Redis, S3) off the
engine core's step loop, and how long a step may wait for them.

A job (a remote lookup, a handover's visibility check) is waited for up to `wait_s`
(`lookup_wait_ms`) when it is submitted, before the request is told to ask again next step:
a Redis lookup takes a few milliseconds, a step of waiting is tens to hundreds of the
request's TTFT. One step waits INLINE_BUDGET_WAITS such bounds at most however many requests
arrive in it (`new_step` renews the budget); while the jobs' recent durations (a running
mean, JOB_EWMA) exceed the bound (S3, a backend in trouble) nobody waits, and every answer
comes off the step loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

INLINE_BUDGET_WAITS = 2
LOOKUP_BATCH = 16  # keys per remote presence check, each check with the store's time bound
JOB_EWMA = 0.25  # weight of the latest job in the running mean of job durations


class LookupJobs:
    """The lookup threads (only with remote tiers: local ones are answered inline) and the
    per-step wait budget."""

    def __init__(self, remote: bool, wait_ms: float) -> None:
        self._pool = (ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvpool-lookup")
                      if remote else None)
        self.wait_s = wait_ms / 1000  # per job
        self.budget_s = INLINE_BUDGET_WAITS * self.wait_s  # per step
        self.left = self.budget_s  # what is left of this step's budget
        self.mean_s = 0.0  # running mean of the jobs' durations

    @property
    def remote(self) -> bool:
        """Whether lookups go to the threads (else they are answered inline)."""
        return self._pool is not None

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """fn on the lookup threads, its duration folded into the running mean."""
        def timed() -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.mean_s += JOB_EWMA * (time.perf_counter() - t0 - self.mean_s)
        assert self._pool is not None
        return self._pool.submit(timed)

    def answered(self, fut: Future) -> bool:
        """Whether a job just submitted is done, waiting for it up to wait_s within what is
        left of this step's budget, unless recent jobs took longer than that (then waiting
        would only delay the step)."""
        if not fut.done() and self.left > 0 and self.mean_s <= self.wait_s:
            t0 = time.perf_counter()
            wait([fut], timeout=min(self.wait_s, self.left))
            self.left -= time.perf_counter() - t0
        return fut.done()

    def new_step(self) -> None:
        self.left = self.budget_s

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def remote_prefix(lower, keys: list[bytes]) -> int:
    """Leading keys in the lower tiers, asked in batches: a long prompt on a slow tier (S3)
    is found as long as each batch answers within the store's bound."""
    n = 0
    for start in range(0, len(keys), LOOKUP_BATCH):
        part = keys[start:start + LOOKUP_BATCH]
        found = lower.contains_prefix(part)
        n += found
        if found < len(part):
            break
    return n
