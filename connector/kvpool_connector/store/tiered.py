"""The tiered store: the first tier written synchronously, lower tiers through bounded
queues served by writer threads, reads probing tiers in order and promoting hits upwards.

Every call into a tier goes through its `TierRunner`, which owns the tier's health, kept
apart for writes and reads (a full or read-only disk still serves what it holds): an error
or a timeout marks that side unhealthy; it is skipped until its backoff expires, then one
call probes it again (success makes it healthy). Remote tiers (redis, s3) run on a small
pool so the caller waits at most the timeout even when a backend hangs. Nothing raises into
the caller except misuse (wrong argument types, a too-small output buffer).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Sequence

from ..config import StoreConfig, tier_names
from .format import MAX_KEY, Record, layout_digest, to_view
from .metrics import USAGE, TierStats
from .tiers import Tier, tier_class
from .tiers.base import BufferTooSmall

log = logging.getLogger("kvpool.store")
_STOP = object()


class Health:
    """Circuit breaker with exponential backoff and a single probe per backoff window."""

    def __init__(self, initial: float, maximum: float) -> None:
        self.initial, self.maximum = initial, maximum
        self.healthy = True
        self.failures = 0
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
        return min(self.maximum, self.initial * 2 ** max(0, self.failures - 1))

    def fail(self) -> None:
        with self._lock:
            self.failures += 1
            self.healthy = False
            self._retry_at = time.monotonic() + self._backoff()

    def ok(self) -> None:
        if not self.healthy or self.failures:
            with self._lock:
                self.healthy, self.failures = True, 0


class TierRunner:
    """One tier plus its health, timeout, stats and (for lower tiers) its write queue."""

    def __init__(self, name: str, tier: Tier, tcfg: Any, cfg: StoreConfig, stats: TierStats,
                 first: bool) -> None:
        self.name, self.tier, self.stats = name, tier, stats
        self.timeout = tcfg.timeout_seconds or cfg.timeout_seconds
        self.write_health = Health(cfg.backoff_initial_seconds, cfg.backoff_max_seconds)
        self.read_health = Health(cfg.backoff_initial_seconds, cfg.backoff_max_seconds)
        self.batch_max = cfg.batch_max
        self._pool = (ThreadPoolExecutor(4, thread_name_prefix=f"kvpool-{name}")
                      if tier.remote else None)
        self.queue: queue.Queue | None = None
        self._workers: list[threading.Thread] = []
        if not first:
            self.queue = queue.Queue(maxsize=tcfg.queue_size or cfg.queue_size)
            for i in range(tcfg.workers):
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
        if was != ok:
            side = "writes" if op == "put" else "reads"
            log.warning("store tier %s: %s %s", self.name, side,
                        "healthy again" if ok else "failing")
            self.stats.set_healthy(self.healthy)

    def call(self, op: str, fn: Callable, *args, default=None, timeout: float | None = None):
        """fn(*args) within the timeout; errors and timeouts count, mark unhealthy, -> default."""
        if not self._health(op).available():
            return default
        t0 = time.perf_counter()
        try:
            if self._pool is not None:
                fut = self._pool.submit(fn, *args)
                res = fut.result(timeout=self.timeout if timeout is None else max(timeout, 0.0))
            else:
                res = fn(*args)
        except FutureTimeout:
            self.stats.inc("timeouts")
            self._set_health(op, False)
            return default
        except BufferTooSmall:
            raise  # the caller's mistake, not the backend's
        except Exception as e:
            return self._failed(op, e, default)
        self.stats.observe(op, time.perf_counter() - t0)
        self._set_health(op, True)
        return res

    def _failed(self, op: str, e: Exception, default):
        self.stats.inc("errors")
        self._set_health(op, False)
        log.warning("store tier %s: %s failed: %s: %s", self.name, op, type(e).__name__, e)
        return default

    # -- asynchronous writes --------------------------------------------------------------
    def enqueue(self, records: list[Record]) -> None:
        """Queue frozen records; full queue or a backing-off tier drops (counted), never blocks."""
        q = self.queue
        if self.write_health.backing_off():
            self.stats.inc("drops", len(records))
            return
        for i, rec in enumerate(records):
            try:
                q.put_nowait(rec)
            except queue.Full:
                self.stats.inc("drops", len(records) - i)
                return

    def _work(self) -> None:
        q = self.queue
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
        try:
            d.update(self.tier.usage())
        except Exception:
            pass
        return d


class TieredStore:
    """See the package docstring for the API; build it with `open_store`."""

    def __init__(self, cfg: StoreConfig, layout: bytes | str | None = None) -> None:
        self.cfg = cfg
        self.namespace = cfg.namespace
        self.layout = layout_digest(layout)
        self._closed = False
        self.runners: list[TierRunner] = []
        try:
            for i, (name, tcfg) in enumerate(zip(tier_names(cfg.tiers), cfg.tiers)):
                stats = TierStats(cfg.namespace, name, cfg.metrics)
                cls = tier_class(tcfg.type)
                timeout = tcfg.timeout_seconds or cfg.timeout_seconds
                tier = (cls(tcfg, cfg.namespace, stats, timeout=timeout) if cls.remote
                        else cls(tcfg, cfg.namespace, stats))
                self.runners.append(TierRunner(name, tier, tcfg, cfg, stats, first=(i == 0)))
        except BaseException:
            self.close()
            raise
        if cfg.metrics:
            USAGE.stores.add(self)

    def usage_samples(self):
        """(namespace, tier, used bytes or None, queue depth) per tier, for the usage gauges."""
        for r in self.runners:
            try:
                used = r.tier.usage().get("used_bytes")
            except Exception:
                used = None
            yield self.namespace, r.name, used, r.queue.qsize() if r.queue is not None else 0

    # -- helpers --------------------------------------------------------------------------
    def _layout(self, layout) -> bytes:
        return self.layout if layout is None else layout_digest(layout)

    @staticmethod
    def _check_keys(keys: Sequence[bytes]) -> list[bytes]:
        keys = list(keys)
        for k in keys:
            if not isinstance(k, (bytes, bytearray)) or not 0 < len(k) <= MAX_KEY:
                raise TypeError(f"keys must be non-empty bytes of at most {MAX_KEY} bytes, "
                                f"got {type(k).__name__}")
        return [bytes(k) for k in keys]

    def _remaining(self, deadline: float) -> float:
        return deadline - time.monotonic()

    # -- writes ---------------------------------------------------------------------------
    def put_many(self, keys: Sequence[bytes], payloads: Sequence[Any],
                 layout: bytes | str | None = None) -> None:
        keys = self._check_keys(keys)
        if len(keys) != len(payloads):
            raise ValueError(f"{len(keys)} keys but {len(payloads)} payloads")
        if not keys or self._closed:
            return
        lay = self._layout(layout)
        records = [Record(k, lay, to_view(p)) for k, p in zip(keys, payloads)]
        first, lower = self.runners[0], self.runners[1:]
        if lower or first.tier.needs_blob:
            for r in records:  # one owned copy, shared by every lower tier
                r.freeze()
        first.call("put", first.tier.put_many, records)
        for runner in lower:
            runner.enqueue(records)

    def put(self, key: bytes, payload: Any, layout: bytes | str | None = None) -> None:
        self.put_many([key], [payload], layout)

    # -- reads ----------------------------------------------------------------------------
    def _promote(self, hits: list[tuple[int, Record]]) -> None:
        """Copy lower-tier hits into every faster tier (the first synchronously if local)."""
        if not self.cfg.promote:
            return
        for ti, rec in hits:
            for j in range(ti):
                runner = self.runners[j]
                if j == 0 and not runner.tier.remote:
                    runner.call("put", runner.tier.put_many, [rec])
                else:
                    runner.enqueue([rec.freeze()])
            self.runners[ti].stats.inc("promotions")

    def _records(self, keys: list[bytes], lay: bytes) -> list[Record | None]:
        out: list[Record | None] = [None] * len(keys)
        pending = list(range(len(keys)))
        deadline = time.monotonic() + self.cfg.timeout_seconds
        promote: list[tuple[int, Record]] = []
        for ti, runner in enumerate(self.runners):
            if not pending:
                break
            left = self._remaining(deadline)
            if left <= 0:
                break
            res = runner.call("get", runner.tier.get_many, [keys[i] for i in pending], lay,
                              timeout=left)
            if res is None:
                continue
            still = []
            for i, rec in zip(pending, res):
                if rec is None:
                    still.append(i)
                else:
                    out[i] = rec
                    if ti:
                        promote.append((ti, rec))
            runner.stats.inc("hits", len(pending) - len(still))
            runner.stats.inc("misses", len(still))
            pending = still
        self._promote(promote)
        return out

    def get_many(self, keys: Sequence[bytes], layout: bytes | str | None = None
                 ) -> list[memoryview | bytes | None]:
        keys = self._check_keys(keys)
        if not keys or self._closed:
            return [None] * len(keys)
        return [None if r is None else r.payload for r in self._records(keys, self._layout(layout))]

    def get(self, key: bytes, layout: bytes | str | None = None) -> memoryview | bytes | None:
        return self.get_many([key], layout)[0]

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[Any],
                      layout: bytes | str | None = None) -> list[int | None]:
        """Read each object into the caller's buffer; bytes written per key, None = miss.

        cpu and disk tiers copy straight into `outs` (no intermediate buffer); remote tiers
        read a batch, verify it and copy once. Raises BufferTooSmall (a ValueError) if an
        object does not fit.
        """
        keys = self._check_keys(keys)
        if len(keys) != len(outs):
            raise ValueError(f"{len(keys)} keys but {len(outs)} output buffers")
        views = [to_view(o) for o in outs]
        if any(v.readonly for v in views):
            raise ValueError("output buffers must be writable")
        result: list[int | None] = [None] * len(keys)
        if not keys or self._closed:
            return result
        lay = self._layout(layout)
        pending = list(range(len(keys)))
        deadline = time.monotonic() + self.cfg.timeout_seconds
        for ti, runner in enumerate(self.runners):
            if not pending or self._remaining(deadline) <= 0:
                break
            res = runner.call("get", runner.tier.get_many_into, [keys[i] for i in pending], lay,
                              [views[i] for i in pending], timeout=self._remaining(deadline))
            if res is None:  # the tier failed or is backing off: try the next one
                continue
            still, promote = [], []
            for i, rec in zip(pending, res):
                if rec is None:
                    still.append(i)
                else:
                    result[i] = len(rec.payload)
                    if ti:
                        promote.append((ti, rec))
            runner.stats.inc("hits", len(pending) - len(still))
            runner.stats.inc("misses", len(still))
            self._promote(promote)
            pending = still
        return result

    def get_into(self, key: bytes, out: Any, layout: bytes | str | None = None) -> int | None:
        return self.get_many_into([key], [out], layout)[0]

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys some tier holds (presence only: the layout is checked on read)."""
        keys = self._check_keys(keys)
        if not keys or self._closed:
            return 0
        present = [False] * len(keys)
        prefix = 0
        deadline = time.monotonic() + self.cfg.timeout_seconds
        for runner in self.runners:
            if prefix == len(keys) or self._remaining(deadline) <= 0:
                break
            idx = [i for i in range(prefix, len(keys)) if not present[i]]
            res = runner.call("contains", runner.tier.contains_many, [keys[i] for i in idx],
                              timeout=self._remaining(deadline))
            if res is None:
                continue
            for i, ok in zip(idx, res):
                if ok:
                    present[i] = True
            while prefix < len(keys) and present[prefix]:
                prefix += 1
        return prefix

    # -- lifecycle ------------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write reached its tier or was dropped; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        return all(r.wait_idle(deadline) for r in self.runners)

    def delete_many(self, keys: Sequence[bytes]) -> None:
        keys = self._check_keys(keys)
        for runner in self.runners:
            runner.call("delete", runner.tier.delete_many, keys)

    def stats(self) -> dict:
        return {"namespace": self.namespace, "layout": self.layout.hex(),
                "tiers": {r.name: r.snapshot() for r in self.runners}}

    def close(self, flush_timeout: float = 5.0) -> None:
        if self._closed:
            return
        self.flush(flush_timeout)
        self._closed = True
        USAGE.stores.discard(self)
        for r in self.runners:
            r.close()

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
