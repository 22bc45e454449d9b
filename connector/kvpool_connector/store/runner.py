"""How the store calls one tier: `TierRunner` owns the tier's health, deadline, stats and
(for a lower tier) its bounded write queue and writer threads.

Health is kept apart for writes and reads (a full or read-only disk still serves what it
holds): an error or a timeout marks that side unhealthy (`Health`, a circuit breaker); it is
skipped until its backoff expires, then one call probes it again. Reads and lookups of a
blocking tier (disk, Redis, S3) run on a small pool with the store's deadline, each under a
`CallGuard`, so a call given up on never writes into the caller's buffers afterwards.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from typing import Any

from ..config import StoreConfig
from .format import Record
from .guard import CallGuard, run_guarded
from .metrics import TierStats
from .tiers import Tier

log = logging.getLogger("kvpool.store")
_STOP = object()
_NOT_WRITTEN = object()


class Health:
    """Circuit breaker of one side (reads or writes) of a tier.

    Closed (`healthy`) until `trip_after` calls in a row failed: below that, every call goes
    through, so one failed write (an ENOSPC, a timeout) never fails the next, independent one.
    Tripped, calls are skipped for a backoff (`initial`, doubled per further failure, at most
    `maximum`); when it is over, one caller probes, the others keep skipping until the probe's
    outcome. Any success closes it."""

    def __init__(self, initial: float, maximum: float, trip_after: int = 1) -> None:
        self.initial, self.maximum, self.trip_after = initial, maximum, trip_after
        self.healthy = True
        self.failures = 0  # in a row
        self._retry_at = 0.0
        self._lock = threading.Lock()

    def available(self) -> bool:
        if self.healthy:
            return True
        with self._lock:
            now = time.monotonic()
            if now < self._retry_at:
                return False
            # let this caller probe; the others keep skipping until the probe's outcome
            self._retry_at = now + self._backoff()
            return True

    def backing_off(self) -> bool:
        return not self.healthy and time.monotonic() < self._retry_at

    def _backoff(self) -> float:
        return min(self.maximum, self.initial * 2 ** max(0, self.failures - self.trip_after))

    def fail(self) -> None:
        with self._lock:
            self.failures += 1
            if self.failures >= self.trip_after:
                self.healthy = False
                self._retry_at = time.monotonic() + self._backoff()

    def ok(self) -> None:
        if not self.healthy or self.failures:
            with self._lock:
                self.healthy, self.failures = True, 0


class TierRunner:
    """One tier plus its health, timeout, stats and (for lower tiers) its write queue."""

    def __init__(self, name: str, tier: Tier, tier_cfg: Any, cfg: StoreConfig, stats: TierStats,
                 first: bool) -> None:
        self.name, self.tier, self.stats = name, tier, stats
        self.timeout = tier_cfg.timeout_seconds or cfg.timeout_seconds
        # writes trip after several failures in a row (a failed write costs no reader anything,
        # and independent writes must not fail with it); reads at the first (a lookup or load on
        # a failing tier costs its caller the deadline: a miss is cheaper)
        self.write_health = Health(cfg.backoff_initial_seconds, cfg.backoff_max_seconds,
                                   trip_after=cfg.write_failures_to_trip)
        self.read_health = Health(cfg.backoff_initial_seconds, cfg.backoff_max_seconds)
        self.batch_max = cfg.batch_max
        self._pool = (ThreadPoolExecutor(4, thread_name_prefix=f"kvpool-{name}")
                      if tier.blocking else None)
        # a write that may be given up on at the deadline while the tier still sends it
        self.puts_on_pool = self._pool is not None and not tier.local
        self.queue: queue.Queue | None = None
        self.queue_limit = tier_cfg.queue_bytes or cfg.queue_bytes
        self._queued = 0  # bytes of sealed objects waiting in the queue
        self._qlock = threading.Lock()
        self._workers: list[threading.Thread] = []
        if not first or tier.blocking:  # lower tiers; promotions into a blocking first tier
            self.queue = queue.Queue(maxsize=tier_cfg.queue_size or cfg.queue_size)
            for i in range(tier_cfg.workers):
                t = threading.Thread(target=self._work, daemon=True,
                                     name=f"kvpool-{name}-writer-{i}")
                t.start()
                self._workers.append(t)

    @property
    def healthy(self) -> bool:
        return self.write_health.healthy and self.read_health.healthy

    def _health(self, op: str) -> Health:
        return self.write_health if op == "put" else self.read_health

    def _set_health(self, op: str, ok: bool) -> None:
        h = self._health(op)
        was = h.healthy
        if ok:
            h.ok()
        else:
            h.fail()
        if was != h.healthy:
            side = "writes" if op == "put" else "reads"
            log.warning("store tier %s: %s %s", self.name, side,
                        "healthy again" if ok else f"failing ({h.failures} in a row): backing off")
            self.stats.set_healthy(self.healthy)

    def call(self, op: str, fn: Callable, *args, default=None, timeout: float | None = None,
             on_failure: Callable[[], None] | None = None):
        """fn(*args) within the timeout; errors and timeouts count, mark unhealthy, -> default
        (after on_failure(): the call may have left partial, unverified bytes in the
        caller's buffers, which the caller owns again once the call was cut off).

        Reads, lookups and remote writes of a blocking tier run on its pool with a deadline;
        a local tier's writes run in the caller's thread (the connector's saver, never the
        scheduler or a loader: promotions into a local first tier go through its queue), so
        a large batch of chunks is written whole instead of being cut off at the deadline."""
        if not self._health(op).available():
            return default
        t0 = time.perf_counter()
        try:
            if self._pool is not None and (op != "put" or self.puts_on_pool):
                guard = CallGuard()
                fut = self._pool.submit(run_guarded, guard, fn, args)
                try:
                    res = fut.result(timeout=self.timeout if timeout is None
                                     else max(timeout, 0.0))
                except FutureTimeout:
                    guard.cancel()  # from here on the call writes nothing the caller sees
                    raise
            else:
                res = fn(*args)
        except FutureTimeout:
            self.stats.inc("timeouts")
            self._set_health(op, False)
            if on_failure is not None:
                on_failure()
            return default
        except Exception as e:
            if on_failure is not None:
                on_failure()
            return self._failed(op, e, default)
        self.stats.observe(op, time.perf_counter() - t0)
        self._set_health(op, True)
        return res

    def contains(self, names: list[bytes], timeout: float) -> list[bool] | None:
        """Presence per name: from the tier's memory when it can tell, else a call."""
        known = self.tier.contains_known(names)
        if known is not None and self.read_health.available():
            return known
        return self.call("contains", self.tier.contains_many, names, timeout=timeout)

    def put_now(self, records: list[Record]) -> list[bool]:
        """Write synchronously; which records the tier holds now. Records the tier did not
        take (backing off, failed, timed out) are dropped and counted."""
        taken = self.call("put", self.tier.put_many, records, default=_NOT_WRITTEN)
        if taken is _NOT_WRITTEN:
            self.stats.inc("drops", len(records))
            return [False] * len(records)
        return [True] * len(records) if taken is None else list(taken)

    def _failed(self, op: str, e: Exception, default):
        self.stats.inc("errors")
        self._set_health(op, False)
        log.warning("store tier %s: %s failed: %s: %s", self.name, op, type(e).__name__, e)
        return default

    # -- asynchronous writes --------------------------------------------------------------
    def enqueue(self, records: list[Record]) -> None:
        """Queue frozen records; a full queue (count or bytes) or a backing-off tier drops
        (counted), never blocks."""
        q = self.queue
        assert q is not None, "enqueue on a tier without a write queue"
        if self.write_health.backing_off():
            self.stats.inc("drops", len(records))
            return
        for i, rec in enumerate(records):
            size = rec.sealed_size()
            with self._qlock:
                if self._queued + size > self.queue_limit:
                    self.stats.inc("drops", len(records) - i)
                    return
                self._queued += size
            try:
                q.put_nowait(rec)
            except queue.Full:
                with self._qlock:
                    self._queued -= size
                self.stats.inc("drops", len(records) - i)
                return

    def _work(self) -> None:
        q = self.queue
        assert q is not None  # workers start only with a queue
        while True:
            item = q.get()
            batch = [item]
            stop = item is _STOP  # each worker takes exactly one stop marker
            while not stop and len(batch) < self.batch_max:
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    break
                batch.append(item)
                stop = item is _STOP
            recs = [r for r in batch if r is not _STOP]
            try:
                if recs:
                    self._write(recs)
            finally:
                with self._qlock:
                    self._queued -= sum(r.sealed_size() for r in recs)
                for _ in batch:
                    q.task_done()
            if stop:
                return

    def _write(self, recs: list[Record]) -> None:
        if not self.write_health.available():
            self.stats.inc("drops", len(recs))
            return
        t0 = time.perf_counter()
        try:
            self.tier.put_many(recs)
        except Exception as e:
            self.stats.inc("drops", len(recs))
            self._failed("put", e, None)
            return
        self.stats.observe("put", time.perf_counter() - t0)
        self._set_health("put", True)

    def queued_bytes(self) -> int:
        return self._queued

    def wait_idle(self, deadline: float | None) -> bool:
        q = self.queue
        if q is None:
            return True
        with q.all_tasks_done:
            while q.unfinished_tasks:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                q.all_tasks_done.wait(left)
        return True

    def close(self) -> None:
        if self.queue is not None:
            for _ in self._workers:
                self.queue.put(_STOP)
            for t in self._workers:
                t.join(timeout=5)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            deadline = time.monotonic() + 5
            for t in list(getattr(self._pool, "_threads", ())):
                t.join(timeout=max(0.0, deadline - time.monotonic()))
            if any(t.is_alive() for t in getattr(self._pool, "_threads", ())):
                log.warning("store tier %s: a call is still hanging at close; leaving the "
                            "tier's resources to the process", self.name)
                return
        try:
            self.tier.close()
        except Exception as e:
            log.debug("store tier %s: close failed: %s", self.name, e)

    def snapshot(self) -> dict:
        d = self.stats.snapshot()
        d["type"] = self.tier.type
        d["healthy"] = self.healthy
        d["writes_healthy"] = self.write_health.healthy
        d["reads_healthy"] = self.read_health.healthy
        d["queue_depth"] = self.queue.qsize() if self.queue is not None else 0
        d["queue_bytes"] = self._queued
        with contextlib.suppress(Exception):
            d.update(self.tier.usage())
        return d
