"""The tiered store: the first tier written synchronously, lower tiers through bounded
queues served by writer threads, reads probing tiers in order and promoting hits upwards.

Every call into a tier goes through its `TierRunner` (runner.py): the tier's health
(skipped with backoff while failing), the store's deadline and the lower tiers' bounded
write queues. Nothing raises into the caller except misuse (wrong argument types or
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
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..config import StoreConfig, tier_names, transport_warnings
from . import cpu_pool
from .format import MAX_NAME, Record, layout_digest, to_view
from .metrics import EVENTS, USAGE, TierStats
from .runner import TierRunner
from .sealing import Keyring, PoolKey
from .tiers import tier_class

log = logging.getLogger("kvpool.store")


_callback_failures: dict[str, int] = {}


def _callers_own(op: str, fn: Callable[[int, memoryview], bool], i: int,
                 view: memoryview) -> bool:
    """The caller's callback of read_in_place/write_in_place: its error is the caller's,
    not the tier's, so it must not reach the runner (which would mark the tier unhealthy):
    logged (the 1st, 2nd, 4th, 8th... failure of each op: a bug that fails every chunk of
    every step must not flood the log), and that object is not taken."""
    try:
        return bool(fn(i, view))
    except Exception:
        n = _callback_failures[op] = _callback_failures.get(op, 0) + 1
        if n & (n - 1) == 0:
            log.warning("%s: the caller's callback failed on key %d (%d failures so far)",
                        op, i, n, exc_info=True)
        return False

EVENTS_MAX = 1 << 16           # tier events kept between two take_events calls
EVENT_NAMES_MAX = 1 << 17      # object name -> key of what this store wrote, for events


def _zero_all(buffers: list[memoryview]) -> None:
    """What a cut-off read may have left in the caller's buffers is no byte of anything."""
    for b in buffers:
        b[:] = bytes(len(b))


# A write-through goes to a shared tier in calls of at most this many bytes, each within the
# store's deadline: one call of a whole large handover (512 MiB) timed out whole.
THROUGH_BATCH_BYTES = 64 << 20


def _batches(records: list[Record], max_bytes: int) -> list[list[Record]]:
    """`records` in order, cut into runs of at most `max_bytes` (a larger record alone)."""
    out: list[list[Record]] = []
    size = 0
    for rec in records:
        if not out or size + rec.size > max_bytes:
            out.append([])
            size = 0
        out[-1].append(rec)
        size += rec.size
    return out


class TieredStore:
    """See the package docstring for the API; build it with `open_store`."""

    def __init__(self, cfg: StoreConfig, layout: bytes | str | None = None,
                 shared_writes: bool = True) -> None:
        self.cfg = cfg
        # False: another process writes what this one would put in the shared tiers (a
        # replica: the tensor ranks of an MLA model hold the same KV); this store reads them
        # all but writes and promotes into its unshared tiers only
        self.shared_writes = shared_writes
        self.namespace = cfg.namespace
        self.layout = layout_digest(layout)
        shared = any(tier_class(t.type).shared for t in cfg.tiers)
        self.keyring = Keyring.from_config(cfg.security, needs_key=shared)
        for warning in transport_warnings(cfg):
            log.warning("%s", warning)
        self._closed = False
        self._evict_first: Callable[[bytes], bool] | None = None
        self._event_keys: OrderedDict[bytes, bytes] | None = None  # enable_events()
        self._event_lock = threading.Lock()  # saver, loader and the worker's step thread
        self.runners: list[TierRunner] = []
        try:
            names = tier_names(cfg.tiers)
            for i, (name, tier_cfg) in enumerate(zip(names, cfg.tiers, strict=True)):
                stats = TierStats(cfg.namespace, name, cfg.metrics)
                tier = tier_class(tier_cfg.type)(
                    tier_cfg, cfg.namespace, stats,
                    timeout=tier_cfg.timeout_seconds or cfg.timeout_seconds,
                    max_object_size=cfg.max_object_size)
                self.runners.append(TierRunner(name, tier, tier_cfg, cfg, stats, first=(i == 0)))
        except BaseException:
            self.close()
            raise
        if cfg.metrics:
            USAGE.stores.add(self)

    def usage_samples(self) -> Iterator[tuple[str, str, int | None, int]]:
        """(namespace, tier, used bytes or None, queue depth) per tier, for the usage gauges."""
        for r in self.runners:
            try:
                used = r.tier.usage().get("used_bytes")
            except Exception:
                used = None
            yield self.namespace, r.name, used, r.queue.qsize() if r.queue is not None else 0

    # -- helpers --------------------------------------------------------------------------
    def _layout(self, layout: Any) -> bytes:
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

    def _record(self, key: bytes, layout_id: bytes, payload: memoryview,
                pool_key: PoolKey) -> Record:
        return Record(pool_key.object_name(key), layout_id, payload, key=pool_key,
                      encrypt=self.keyring.encrypt, evict_first=self._is_evict_first(key))

    def set_evict_first(self, predicate: Callable[[bytes], bool] | None) -> None:
        """Keys for which `predicate` is true are evicted first by the local tiers (cpu,
        disk) when they need room, least recently used of them first, before any other
        object. The tiers see only sealed object names, so the caller, who knows its keys,
        decides (the connector: its tail objects, connector/tails.py)."""
        self._evict_first = predicate

    def _is_evict_first(self, key: bytes) -> bool:
        pred = self._evict_first
        return bool(pred is not None and pred(key))

    # -- writes ---------------------------------------------------------------------------
    def put_many(self, keys: Sequence[bytes], payloads: Sequence[Any],
                 layout: bytes | str | None = None) -> list[bool]:
        """Store the payloads; per key whether the first tier holds it now (the lower tiers
        are written behind it, best effort: a full queue or a failing tier drops)."""
        records = self._records(keys, payloads, layout)
        return self._write(records) if records else [False] * len(keys)

    def _records(self, keys: Sequence[bytes], payloads: Sequence[Any],
                 layout: bytes | str | None) -> list[Record]:
        """Records to write under the current key (none when closed)."""
        keys = self._check_keys(keys)
        if len(keys) != len(payloads):
            raise ValueError(f"{len(keys)} keys but {len(payloads)} payloads")
        if not keys or self._closed:
            return []
        layout_id = self._layout(layout)
        cur = self.keyring.current
        records = [self._record(k, layout_id, to_view(p), cur)
                   for k, p in zip(keys, payloads, strict=True)]
        self._remember_names(keys, [r.name for r in records])
        return records

    def put_many_through(self, keys: Sequence[bytes], payloads: Sequence[Any],
                         layout: bytes | str | None = None) -> tuple[list[bool], list[bool]]:
        """Store the payloads and write them to every shared tier (disk, Redis, S3) before
        returning, each within the store's deadline, instead of behind the first tier: a
        prefill's handover (connector/handover.py) must know that another engine can read
        them. (per key whether the first tier holds it, per key whether every shared tier
        does; False for all when no tier is shared)."""
        records = self._records(keys, payloads, layout)
        if not records:
            return [False] * len(keys), [False] * len(keys)
        durable: list[list[bool]] = []
        landed = self._write(records, durable)
        if not self.shared_writes:  # the process that writes the shared tiers answers that
            return landed, [True] * len(keys)
        ok = [all(col) for col in zip(*durable, strict=True)] if durable else []
        return landed, ok or [False] * len(keys)

    def _write(self, records: list[Record], through: list[list[bool]] | None = None
               ) -> list[bool]:
        """Write the first tier now, queue the lower ones; with `through` (a list), write the
        shared tiers now too and append each one's per-record answer to it."""
        first, lower = self.runners[0], self.runners[1:]
        if not self.shared_writes:
            lower = [r for r in lower if not r.tier.shared]
            if first.tier.shared:  # the first tier's copy is the other process's to write
                if lower:
                    cpu_pool.run_each(Record.freeze, records, sum(r.size for r in records))
                for runner in lower:
                    runner.enqueue(records)
                return [False] * len(records)
        nbytes = sum(r.size for r in records)
        # one owned sealed copy, shared by every lower tier; also when a write given up on
        # at the deadline could go on reading the caller's buffers after this returns
        if lower or first.tier.needs_blob or first.puts_on_pool:
            cpu_pool.run_each(Record.freeze, records, nbytes)
        elif first.tier.shared:  # MAC'd (or encrypted) for the one tier, side by side
            cpu_pool.run_each(Record.parts, records, nbytes)
        landed = first.put_now(records)
        if through is not None and first.tier.shared:
            through.append(list(landed))
        for runner in lower:
            if through is not None and runner.tier.shared:
                through.append(self._put_through(runner, records))
            else:
                runner.enqueue(records)
        return landed

    def _put_through(self, runner: TierRunner, records: list[Record]) -> list[bool]:
        """Write `records` to a shared tier now, but those it already holds (asked by name,
        within the store's deadline): a handover of a prompt the pool holds re-wrote every
        object. An object planted under a name fails its MAC at the reader, which then
        recomputes, as when the object is gone; the handover promises no more than that."""
        held = runner.contains([r.name for r in records], self.cfg.timeout_seconds)
        if held is None:  # the tier cannot say: write them all
            held = [False] * len(records)
        missing = [r for r, h in zip(records, held, strict=True) if not h]
        written = iter([ok for batch in _batches(missing, THROUGH_BATCH_BYTES)
                        for ok in runner.put_now(batch)])
        return [True if h else next(written) for h in held]

    def write_in_place(self, keys: Sequence[bytes], sizes: Sequence[int],
                       fill: Callable[[int, memoryview], bool],
                       layout: bytes | str | None = None) -> list[bool] | None:
        """put_many for a caller that would copy into a buffer only for put_many to copy it
        again (the connector's gather out of the paged cache): a store that is only this
        process's memory (memory_only) lends each object's slot, `sizes[i]` bytes, to
        `fill(i, view)` under the tier's lock, and holds the object once `fill` returns
        True; per key whether it does. None: not such a store, or an object larger than a
        slot (or the slots not sized yet): use put_many."""
        keys = self._check_keys(keys)
        if len(keys) != len(sizes):
            raise ValueError(f"{len(keys)} keys but {len(sizes)} sizes")
        if self._closed or not self.memory_only():
            return None
        first = self.runners[0]
        limit = first.tier.in_place_limit()
        if not keys or any(n > limit or n <= 0 for n in sizes):
            return None
        cur = self.keyring.current
        names = [cur.object_name(k) for k in keys]
        self._remember_names(keys, names)
        landed = first.call("put", first.tier.write_in_place, names, list(sizes),
                            self._layout(layout), [self._is_evict_first(k) for k in keys],
                            functools.partial(_callers_own, "write_in_place", fill))
        if landed is None:  # the tier failed (counted): nothing landed
            first.stats.inc("drops", len(keys))
            return [False] * len(keys)
        return [bool(x) for x in landed]

    def put(self, key: bytes, payload: Any, layout: bytes | str | None = None) -> bool:
        return self.put_many([key], [payload], layout)[0]

    # -- reads ----------------------------------------------------------------------------
    def _probe(self, keys: list[bytes], layout_id: bytes, outs: list[memoryview] | None,
               served_by: list[str | None] | None = None, promote: bool = True
               ) -> list[Record | None]:
        """Every tier in order, under the current key then the previous one, within one
        deadline; promotes what lower tiers (or the previous key) served, unless `promote`
        is False. `served_by`: set to the name of the tier that served each key (None: a
        miss)."""
        found: list[Record | None] = [None] * len(keys)
        pending = list(range(len(keys)))
        deadline = time.monotonic() + self.cfg.timeout_seconds
        hits: list[tuple[int, int, Record]] = []  # (tier, index, record) to promote
        for generation, pool_key in enumerate(self.keyring.generations()):
            names = {i: pool_key.object_name(keys[i]) for i in pending}
            for tier_index, runner in enumerate(self.runners):
                if not pending or self._remaining(deadline) <= 0:
                    break
                if generation and not runner.tier.shared:
                    continue  # an in-process tier only ever held current-key objects
                args: tuple[Any, ...] = ([names[i] for i in pending], layout_id, pool_key)
                wipe = None
                fn: Callable[..., list[Record | None]]
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
                for i, rec in zip(pending, res, strict=True):
                    if rec is not None and self._refused(runner, rec, outs, i):
                        rec = None
                    if rec is None:
                        still.append(i)
                        continue
                    found[i] = rec
                    if served_by is not None:
                        served_by[i] = runner.name
                    if tier_index or generation:
                        source = tier_index if not generation else len(self.runners)
                        hits.append((source, i, rec))
                runner.stats.inc("hits", len(pending) - len(still))
                runner.stats.inc("misses", len(still))
                pending = still
        if promote:
            self._promote(hits, keys, layout_id)
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
                 layout_id: bytes) -> None:
        """Copy lower-tier hits into every faster tier (a local first tier synchronously).
        A hit under the previous key goes only into the unshared tiers (under the current
        key's name, which is all they are probed with): sealing it again under the current
        key would make a forgery made with a leaked previous key outlive the rotation."""
        for tier_index, i, rec in hits:
            self._remember_names([keys[i]], [rec.name])
            rec.evict_first = self._is_evict_first(keys[i])
            if tier_index == len(self.runners):  # found under the previous key
                rec = self._record(keys[i], layout_id, rec.payload, self.keyring.current)
                self._remember_names([keys[i]], [rec.name])
                targets = [j for j, r in enumerate(self.runners) if not r.tier.shared]
            else:
                targets = list(range(tier_index))
            if not self.shared_writes:
                targets = [j for j in targets if not self.runners[j].tier.shared]
            if not self.cfg.promote or not targets:
                continue
            if self.keyring.encrypt and not rec.encrypt and any(
                    self.runners[j].tier.shared for j in targets):
                # written before encryption was on: never copied on in plaintext
                rec = self._record(keys[i], layout_id, rec.payload, self.keyring.current)
            if tier_index < len(self.runners):
                self.runners[tier_index].stats.inc("promotions")
            for j in targets:
                runner = self.runners[j]
                if j == 0 and runner.queue is None:
                    runner.put_now([rec])
                else:
                    runner.enqueue([rec.freeze()])

    def get_many(self, keys: Sequence[bytes], layout: bytes | str | None = None,
                 promote: bool = True) -> list[memoryview | bytes | None]:
        """The payloads (None: a miss); `promote=False` leaves what a lower tier served out
        of the faster tiers (an object read once, such as the warm start manifest)."""
        keys = self._check_keys(keys)
        if not keys or self._closed:
            return [None] * len(keys)
        return [None if r is None else r.payload
                for r in self._probe(keys, self._layout(layout), None, promote=promote)]

    def get(self, key: bytes, layout: bytes | str | None = None,
            promote: bool = True) -> memoryview | bytes | None:
        return self.get_many([key], layout, promote)[0]

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[Any],
                      layout: bytes | str | None = None,
                      served_by: list[str | None] | None = None) -> list[int | None]:
        """Read each object into the caller's buffer; bytes written per key, None = miss
        (also for an object larger than its buffer: it cannot be of the caller's layout).
        `served_by` (a list as long as `keys`): set to the name of the tier each object came
        from, for the caller's own accounting (the connector's per-tier hits).

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
        if served_by is not None and len(served_by) != len(keys):
            raise ValueError(f"{len(keys)} keys but served_by holds {len(served_by)}")
        if not keys or self._closed:
            return [None] * len(keys)
        return [None if r is None else len(r.payload)
                for r in self._probe(keys, self._layout(layout), views, served_by)]

    def read_in_place(self, keys: Sequence[bytes], use: Callable[[int, memoryview], bool],
                      layout: bytes | str | None = None) -> list[bool]:
        """Lend each key the first tier holds in this process's memory (the cpu tier) to
        `use(i, view)`: the stored bytes, read-only, valid during the call only (the tier
        holds its lock: nothing evicts or overwrites them meanwhile); per key whether `use`
        took it (it returns False for bytes it cannot use). No copy out and nothing to
        verify: the tier is the process's own memory, which reads never MAC. Keys not taken
        (elsewhere, spanning slots, refused): read them with get_many_into. Counted as that
        tier's hits. `use` must not call into this store: the tier's lock is held."""
        keys = self._check_keys(keys)
        first = self.runners[0] if self.runners else None
        if not keys or self._closed or first is None or first.tier.shared:
            return [False] * len(keys)
        res = first.call("get", first.tier.read_in_place, self.object_names(keys),
                         self._layout(layout), functools.partial(_callers_own, "read_in_place",
                                                                 use))
        if res is None:  # the tier failed (counted): the caller reads the usual way
            return [False] * len(keys)
        taken = [bool(x) for x in res]
        first.stats.inc("hits", sum(taken))
        return taken

    def get_into(self, key: bytes, out: Any, layout: bytes | str | None = None) -> int | None:
        return self.get_many_into([key], [out], layout)[0]

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys some tier holds (presence only: the MAC and layout are
        checked on read)."""
        present = self._presence(keys, leading=True)
        return next((i for i, ok in enumerate(present) if not ok), len(present))

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key whether some tier holds it (presence only, as contains_prefix): one
        batched question per tier, e.g. for the longest of several candidates."""
        return self._presence(keys, leading=False)

    def _presence(self, keys: Sequence[bytes], leading: bool) -> list[bool]:
        """Which keys some tier holds, each tier asked about the keys not found yet, within
        one deadline; `leading`: only up to the first key no tier holds."""
        keys = self._check_keys(keys)
        present = [False] * len(keys)
        if not keys or self._closed:
            return present
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
                for i, ok in zip(idx, res, strict=True):
                    if ok:
                        present[i] = True
                if leading:
                    while prefix < len(keys) and present[prefix]:
                        prefix += 1
                elif all(present):
                    prefix = len(keys)
        return present

    def first_present(self, keys: Sequence[bytes]) -> int | None:
        """The index of the first of `keys` some tier holds, each key asked on its own
        (presence only, like contains_prefix), or None: unrelated keys, such as the
        connector's tail candidates, longest first. Each tier is asked for all the keys
        before the first one found so far; a tier that answers every name of a call
        (`Tier.answers_each`: Redis, one pipeline; cpu) answers in that one call. Another
        (disk, S3) may stop at its first missing name: its yes answers count, and it is
        asked again from the name after that miss (S3 answers a wave of names at once and
        remembers them, so the next calls cost no request)."""
        keys = self._check_keys(keys)
        if not keys or self._closed:
            return None
        best = len(keys)  # the first key found so far
        deadline = time.monotonic() + self.cfg.timeout_seconds
        for pool_key in self.keyring.generations():
            names = [pool_key.object_name(k) for k in keys]
            for runner in self.runners:
                i = 0
                while i < best and self._remaining(deadline) > 0:
                    res = runner.contains(names[i:best], self._remaining(deadline))
                    if res is None:  # failing or backing off: the next tier
                        break
                    found = next((j for j, ok in enumerate(res) if ok), None)
                    if found is not None:
                        best = i + found
                    if runner.tier.answers_each or found == 0:
                        break
                    i += 1  # names[i] is missing there; what came after it may be unknown
        return best if best < len(keys) else None

    def tier_names(self) -> list[str]:
        """The tiers' labels in stats and metrics, first tier first."""
        return [r.name for r in self.runners]

    def memory_only(self) -> bool:
        """One tier, the process's own memory (cpu): a write is a memcpy under the tier's
        lock, never a network or disk round trip."""
        return (len(self.runners) == 1 and self.runners[0].tier.process_memory
                and not self.runners[0].tier.blocking and not self.runners[0].tier.shared)

    def in_memory(self, keys: Sequence[bytes]) -> bool:
        """True when the first tier is the process's own memory (cpu: never a network or disk
        round trip, never blocking) and holds every key now. A read may still miss (evicted
        in between): it is only a hint for where to run the read."""
        first = self.runners[0] if self.runners else None
        if first is None or self._closed or first.tier.shared or first.tier.blocking \
                or not first.tier.process_memory or not first.read_health.available():
            return False
        keys = self._check_keys(keys)
        return all(first.tier.contains_many(self.object_names(keys)))

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

    def _remember_names(self, keys: list[bytes], object_names: list[bytes]) -> None:
        names = self._event_keys
        if names is None:
            return
        with self._event_lock:
            for k, name in zip(keys, object_names, strict=True):
                names[name] = k
                names.move_to_end(name)
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

    def stats(self) -> dict[str, Any]:
        return {"namespace": self.namespace, "layout": self.layout.hex(),
                "tiers": {r.name: r.snapshot() for r in self.runners}}

    def telemetry(self) -> dict[str, Any]:
        """Everything the store's Prometheus series show, as plain data (totals since open
        and current gauges): `{"store", "tiers": {name: {"events", "bytes", "latency",
        "healthy", "queue_depth", "used_bytes", "shared"}}}`. The connector ships differences of it
        through vLLM's KV connector stats (connector/stats.py)."""
        tiers = {}
        for r in self.runners:
            counts = r.stats.snapshot()
            try:
                used = r.tier.usage().get("used_bytes")
            except Exception:
                used = None
            tiers[r.name] = {
                "events": {e: counts[e] for e in EVENTS},
                "bytes": {"in": counts["bytes_in"], "out": counts["bytes_out"]},
                "latency": r.stats.latency_snapshot(),
                "healthy": bool(r.healthy),
                "queue_depth": r.queue.qsize() if r.queue is not None else 0,
                "used_bytes": used,
                "shared": bool(r.tier.shared),  # other processes see the same bytes
            }
        return {"store": self.namespace, "tiers": tiers}

    def close(self, flush_timeout: float = 5.0) -> None:
        if self._closed:
            return
        self.flush(flush_timeout)
        self._closed = True
        USAGE.stores.discard(self)
        for r in self.runners:
            r.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
