"""The tiered store: the first tier written synchronously, lower tiers through bounded
queues served by writer threads, reads probing tiers in order and promoting hits upwards.

Every call into a tier goes through its `TierRunner`, which owns the tier's health, kept
apart for writes and reads (a full or read-only disk still serves what it holds): an error
or a timeout marks that side unhealthy; it is skipped until its backoff expires, then one
call probes it again (success makes it healthy). Reads and lookups of blocking tiers (disk,
Redis, S3) run on a small pool so the caller waits at most the deadline even when a backend
or a mount hangs; a call given up on may no longer write into the caller's buffers
(`CallGuard`). Nothing raises into the caller except misuse (wrong argument types or
lengths).

Keys become object names with the pool key (sealing.py); lower-tier writes carry sealed
objects. With a previous key configured (a rotation), a miss under the current key is
looked up under the previous one; what is found there is served, and copied only into the
process's own (unshared) tiers, never sealed again under the current key into a shared
one: if the previous key leaked, whatever its holder forged must not outlive the rotation.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Sequence

from ..config import StoreConfig, tier_names
from . import cpu_pool
from .guard import CallGuard, run_guarded
from .format import MAX_NAME, Record, layout_digest, to_view
from .metrics import USAGE, TierStats
from .sealing import Keyring, PoolKey
from .tiers import Tier, tier_class

log = logging.getLogger("kvpool.store")
_STOP = object()
_NOT_WRITTEN = object()
EVENTS_MAX = 1 << 16           # tier events kept between two take_events calls
EVENT_NAMES_MAX = 1 << 17      # object name -> key of what this store wrote, for events


def _zero_all(buffers: list[memoryview]) -> None:
    """What a cut-off read may have left in the caller's buffers is no byte of anything."""
    for b in buffers:
        b[:] = bytes(len(b))


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
                      if tier.blocking else None)
        # a write that may be given up on at the deadline while the tier still sends it
        self.puts_on_pool = self._pool is not None and not tier.local
        self.queue: queue.Queue | None = None
        self.queue_limit = tcfg.queue_bytes or cfg.queue_bytes
        self._queued = 0  # bytes of sealed objects waiting in the queue
        self._qlock = threading.Lock()
        self._workers: list[threading.Thread] = []
        if not first or tier.blocking:  # lower tiers; promotions into a blocking first tier
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
        shared = any(tier_class(t.type).shared for t in cfg.tiers)
        self.keyring = Keyring.from_config(cfg.security, needs_key=shared)
        self._closed = False
        self._event_keys: OrderedDict[bytes, bytes] | None = None  # enable_events()
        self._event_lock = threading.Lock()  # saver, loader and the worker's step thread
        self.runners: list[TierRunner] = []
        try:
            for i, (name, tcfg) in enumerate(zip(tier_names(cfg.tiers), cfg.tiers)):
                stats = TierStats(cfg.namespace, name, cfg.metrics)
                tier = tier_class(tcfg.type)(
                    tcfg, cfg.namespace, stats, timeout=tcfg.timeout_seconds or cfg.timeout_seconds,
                    max_object_size=cfg.max_object_size)
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
            if not isinstance(k, (bytes, bytearray)) or not 0 < len(k) <= MAX_NAME:
                raise TypeError(f"keys must be non-empty bytes of at most {MAX_NAME} bytes, "
                                f"got {type(k).__name__}")
        return [bytes(k) for k in keys]

    def _remaining(self, deadline: float) -> float:
        return deadline - time.monotonic()

    def _record(self, key: bytes, lay: bytes, payload, pool_key: PoolKey) -> Record:
        return Record(pool_key.object_name(key), lay, payload, key=pool_key,
                      encrypt=self.keyring.encrypt)

    # -- writes ---------------------------------------------------------------------------
    def put_many(self, keys: Sequence[bytes], payloads: Sequence[Any],
                 layout: bytes | str | None = None) -> list[bool]:
        """Store the payloads; per key whether the first tier holds it now (the lower tiers
        are written behind it, best effort: a full queue or a failing tier drops)."""
        keys = self._check_keys(keys)
        if len(keys) != len(payloads):
            raise ValueError(f"{len(keys)} keys but {len(payloads)} payloads")
        if not keys or self._closed:
            return [False] * len(keys)
        lay = self._layout(layout)
        cur = self.keyring.current
        records = [self._record(k, lay, to_view(p), cur) for k, p in zip(keys, payloads)]
        self._remember_names(keys, records)
        return self._write(records)

    def _write(self, records: list[Record]) -> list[bool]:
        first, lower = self.runners[0], self.runners[1:]
        nbytes = sum(r.size for r in records)
        # one owned sealed copy, shared by every lower tier; also when a write given up on
        # at the deadline could go on reading the caller's buffers after this returns
        if lower or first.tier.needs_blob or first.puts_on_pool:
            cpu_pool.run_each(Record.freeze, records, nbytes)
        elif first.tier.shared:  # MAC'd (or encrypted) for the one tier, side by side
            cpu_pool.run_each(Record.parts, records, nbytes)
        landed = first.put_now(records)
        for runner in lower:
            runner.enqueue(records)
        return landed

    def put(self, key: bytes, payload: Any, layout: bytes | str | None = None) -> bool:
        return self.put_many([key], [payload], layout)[0]

    # -- reads ----------------------------------------------------------------------------
    def _probe(self, keys: list[bytes], lay: bytes, outs: list[memoryview] | None
               ) -> list[Record | None]:
        """Every tier in order, under the current key then the previous one, within one
        deadline; promotes what lower tiers (or the previous key) served."""
        found: list[Record | None] = [None] * len(keys)
        pending = list(range(len(keys)))
        deadline = time.monotonic() + self.cfg.timeout_seconds
        promote: list[tuple[int, int, Record]] = []  # (tier, index, record)
        for gen, pool_key in enumerate(self.keyring.generations()):
            names = {i: pool_key.object_name(keys[i]) for i in pending}
            for ti, runner in enumerate(self.runners):
                if not pending or self._remaining(deadline) <= 0:
                    break
                if gen and not runner.tier.shared:
                    continue  # an in-process tier only ever held current-key objects
                args: tuple = ([names[i] for i in pending], lay, pool_key)
                wipe = None
                if outs is None:
                    fn = runner.tier.get_many
                else:
                    into = [outs[i] for i in pending]
                    fn, args = runner.tier.get_many_into, args + (into,)
                    wipe = functools.partial(_zero_all, into)
                res = runner.call("get", fn, *args, timeout=self._remaining(deadline),
                                  on_failure=wipe)
                if res is None:  # the tier failed or is backing off: try the next one
                    continue
                still = []
                for i, rec in zip(pending, res):
                    if rec is not None and self._refused(runner, rec, outs, i):
                        rec = None
                    if rec is None:
                        still.append(i)
                        continue
                    found[i] = rec
                    if ti or gen:
                        promote.append((ti if not gen else len(self.runners), i, rec))
                runner.stats.inc("hits", len(pending) - len(still))
                runner.stats.inc("misses", len(still))
                pending = still
        self._promote(promote, keys, lay)
        return found

    def _refused(self, runner: TierRunner, rec: Record, outs: list[memoryview] | None,
                 i: int) -> bool:
        """`security.refuse_plaintext`: an authentic object of a shared tier that is only
        MAC'd (written before encryption was on) is a miss; whatever of it landed in the
        caller's buffer is wiped. Counted as rejected; left in place to age out."""
        if not self.keyring.refuse_plaintext or rec.encrypt or not runner.tier.shared:
            return False
        runner.stats.inc("rejected")
        if outs is not None:
            _zero_all([outs[i][:len(rec.payload)]])
        return True

    def _promote(self, hits: list[tuple[int, int, Record]], keys: list[bytes],
                 lay: bytes) -> None:
        """Copy lower-tier hits into every faster tier (a local first tier synchronously).
        A hit under the previous key goes only into the unshared tiers (under the current
        key's name, which is all they are probed with): sealing it again under the current
        key would make a forgery made with a leaked previous key outlive the rotation."""
        for ti, i, rec in hits:
            self._remember_names([keys[i]], [rec])
            if ti == len(self.runners):  # found under the previous key
                rec = self._record(keys[i], lay, rec.payload, self.keyring.current)
                self._remember_names([keys[i]], [rec])
                targets = [j for j, r in enumerate(self.runners) if not r.tier.shared]
            else:
                targets = list(range(ti))
            if not self.cfg.promote or not targets:
                continue
            if self.keyring.encrypt and not rec.encrypt and any(
                    self.runners[j].tier.shared for j in targets):
                # written before encryption was on: never copied on in plaintext
                rec = self._record(keys[i], lay, rec.payload, self.keyring.current)
            if ti < len(self.runners):
                self.runners[ti].stats.inc("promotions")
            for j in targets:
                runner = self.runners[j]
                if j == 0 and runner.queue is None:
                    runner.put_now([rec])
                else:
                    runner.enqueue([rec.freeze()])

    def get_many(self, keys: Sequence[bytes], layout: bytes | str | None = None
                 ) -> list[memoryview | bytes | None]:
        keys = self._check_keys(keys)
        if not keys or self._closed:
            return [None] * len(keys)
        return [None if r is None else r.payload
                for r in self._probe(keys, self._layout(layout), None)]

    def get(self, key: bytes, layout: bytes | str | None = None) -> memoryview | bytes | None:
        return self.get_many([key], layout)[0]

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[Any],
                      layout: bytes | str | None = None) -> list[int | None]:
        """Read each object into the caller's buffer; bytes written per key, None = miss
        (also for an object larger than its buffer: it cannot be of the caller's layout).

        Nothing is served unless its tag checks out; a buffer whose read failed (a bad tag,
        an error, a call cut off at the deadline) holds no byte of the object. When this
        returns, no tier call writes into `outs` anymore.
        """
        keys = self._check_keys(keys)
        if len(keys) != len(outs):
            raise ValueError(f"{len(keys)} keys but {len(outs)} output buffers")
        views = [to_view(o) for o in outs]
        if any(v.readonly for v in views):
            raise ValueError("output buffers must be writable")
        if not keys or self._closed:
            return [None] * len(keys)
        return [None if r is None else len(r.payload)
                for r in self._probe(keys, self._layout(layout), views)]

    def get_into(self, key: bytes, out: Any, layout: bytes | str | None = None) -> int | None:
        return self.get_many_into([key], [out], layout)[0]

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys some tier holds (presence only: the MAC and layout are
        checked on read)."""
        keys = self._check_keys(keys)
        if not keys or self._closed:
            return 0
        present = [False] * len(keys)
        prefix = 0
        deadline = time.monotonic() + self.cfg.timeout_seconds
        for pool_key in self.keyring.generations():
            for runner in self.runners:
                if prefix == len(keys) or self._remaining(deadline) <= 0:
                    break
                idx = [i for i in range(prefix, len(keys)) if not present[i]]
                res = runner.contains([pool_key.object_name(keys[i]) for i in idx],
                                      self._remaining(deadline))
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
        for pool_key in self.keyring.generations():
            names = [pool_key.object_name(k) for k in keys]
            for runner in self.runners:
                runner.call("delete", runner.tier.delete_many, names)

    def forget_absent(self, keys: Sequence[bytes]) -> None:
        """Another process just stored these keys: drop cached "missing" answers for them,
        so the next lookup asks the tier instead of repeating a stale miss."""
        keys = self._check_keys(keys)
        for pool_key in self.keyring.generations():
            names = [pool_key.object_name(k) for k in keys]
            for r in self.runners:
                r.tier.forget_absent(names)

    # -- events of the local tiers (vLLM KV events, see connector/events.py) -------------------
    def enable_events(self) -> None:
        """From now on, record what the local tiers (cpu, disk) store and evict."""
        self._event_keys = OrderedDict()
        for r in self.runners:
            if r.tier.local:
                r.tier.events = deque(maxlen=EVENTS_MAX)

    def _remember_names(self, keys: list[bytes], records: list[Record]) -> None:
        names = self._event_keys
        if names is None:
            return
        with self._event_lock:
            for k, rec in zip(keys, records):
                names[rec.name] = k
                names.move_to_end(rec.name)
            while len(names) > EVENT_NAMES_MAX:
                names.popitem(last=False)

    def take_events(self) -> list[tuple[str, bool, bytes]]:
        """(tier type, stored (True) or removed, key) since the last call, the last one per
        object and tier; objects this store never wrote (another process's, on a shared
        disk) are left out: their keys are unknown here."""
        names = self._event_keys
        if names is None:
            return []
        out: dict[tuple[str, bytes], bool] = {}
        for r in self.runners:
            ev = r.tier.events
            while ev:
                stored, name = ev.popleft()
                with self._event_lock:
                    key = names.get(name)
                if key is not None:
                    out.pop((r.tier.type, key), None)  # the last state wins, in its order
                    out[(r.tier.type, key)] = stored
        return [(t, stored, k) for (t, k), stored in out.items()]

    def object_names(self, keys: Sequence[bytes]) -> list[bytes]:
        """The names the tiers store these keys under (current pool key)."""
        return [self.keyring.current.object_name(k) for k in self._check_keys(keys)]

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
