"""The interface every tier implements, and the checks they share.

Tiers are plain, synchronous and may raise on backend errors: the orchestrator
(`..tiered`) owns timeouts, health, queues and never lets an error reach the caller.
Tiers see object names (derived from the caller's keys with the pool key), store sealed
objects (format.py) and verify what they read against the pool key before returning it;
a corrupt or forged object is deleted, an authentic object of another layout is left alone
(another engine of a mixed fleet may own it).
"""

from __future__ import annotations

import abc
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from ..format import Record, Status, open_blob
from ..guard import current_guard
from ..metrics import TierStats
from ..sealing import PoolKey

log = logging.getLogger("kvpool.store")


class Tier(abc.ABC):
    """A storage backend of the tiered store.

    A new tier is one module with a subclass of this class (its five abstract methods, the
    capability attributes below where the defaults do not fit) and its config model (a
    `kvpool_connector.config.TierConfigBase` subclass), plus one `register_tier` call
    (`tiers/__init__.py`). The store and the connector decide by the capability
    attributes, never by a tier's type name.
    """

    #: the config `type` this class serves; labels logs and the tier events
    type: ClassVar[str] = ""
    #: node-local (cpu, disk): writes run in the caller's thread (the connector's saver);
    #: what it holds tells a router where a prefix is (vLLM KV events); as a first tier,
    #: the scheduler tracks what the workers stored in it. Its config has a `size` (bytes:
    #: register_tier checks; `local_size` reads it).
    local: ClassVar[bool] = False
    #: shared with other hosts (Redis, S3): lookups may take a network round trip, so the
    #: scheduler runs them off its step loop
    remote: ClassVar[bool] = False
    #: other processes read what it holds (disk, Redis, S3): objects are sealed, so a store
    #: with such a tier needs the pool key; it may hold objects under a previous pool key,
    #: and the connector's scheduler process opens it for lookups. An unshared tier (cpu)
    #: lives in one process's memory only.
    shared: ClassVar[bool] = True
    #: the engine process's own memory (cpu): a read or write is a memcpy under the tier's
    #: lock, never a disk or network round trip. A store of only such a tier takes saves in
    #: the step, loads from it run in the step, and warm start fills such a first tier.
    process_memory: ClassVar[bool] = False
    #: where vLLM reports a hit served by this tier (a `CacheHitSource` value: "host",
    #: "disk", "external_unspecified"), in the connector's hit metrics
    hit_source: ClassVar[str] = "external_unspecified"
    #: calls may block on I/O (a hung NFS mount, a FIFO, a network): the orchestrator runs
    #: them on a pool and gives up at the store's deadline
    blocking: ClassVar[bool] = False
    #: put_many needs Record.blob (one contiguous sealed buffer)
    needs_blob: ClassVar[bool] = True
    #: contains_many answers every name on its own, in one round trip (never False for a
    #: name only because an earlier one is missing): TieredStore.first_present asks it for
    #: unrelated names (the connector's tail candidates) once; any other tier is asked
    #: again from the name after each miss it reports
    answers_each: ClassVar[bool] = False
    #: (stored, object name) of what a local tier took in (True) or let go (False), while
    #: someone listens (TieredStore.enable_events); None: nothing is recorded
    events: deque | None = None

    def __init__(self, cfg: Any, namespace: str, stats: TierStats, *,
                 timeout: float = 0.5, max_object_size: int = 1 << 30) -> None:
        self.cfg = cfg
        self.namespace = namespace
        self.stats = stats
        self.timeout = timeout
        self.max_object_size = max_object_size

    @abc.abstractmethod
    def put_many(self, records: list[Record]) -> list[bool] | None:
        """Store each record under its name (replacing an older object of that name). A
        tier may refuse (count `rejected`) or evict what does not fit: it then returns
        which records it stored (None: all of them); raises on a backend error (the
        orchestrator counts and drops the batch)."""

    @abc.abstractmethod
    def get_many(self, names: list[bytes], layout: bytes, key: PoolKey) -> list[Record | None]:
        """Each name's record if present, authentic and of `layout`; None otherwise."""

    @abc.abstractmethod
    def get_many_into(self, names: list[bytes], layout: bytes, key: PoolKey,
                      outs: list[memoryview]) -> list[Record | None]:
        """Each hit's payload into its output buffer, never served unless its tag checks
        out; a tier that checks pieces as they land zeroes the buffer when the tag fails."""

    @abc.abstractmethod
    def contains_many(self, names: list[bytes]) -> list[bool]:
        """Presence per name; may answer False for names after the first missing one
        (callers only need the present prefix)."""

    @abc.abstractmethod
    def delete_many(self, names: list[bytes]) -> None:
        """Remove these objects where present."""

    def read_in_place(self, names: list[bytes], layout: bytes,
                      use: Callable[[int, memoryview], bool]) -> list[bool]:
        """Hand objects of `layout` to `use(i, view)` without copying them out: `view` is
        the stored bytes, read-only and valid during the call only; per name whether
        `use` took it. Only a tier of this process's memory can; the rest take none, and
        the caller reads those names the usual way. `use` runs under the tier's lock: it
        must not call into the store (the lock is not reentrant) and should only copy."""
        return [False] * len(names)

    def in_place_limit(self) -> int:
        """The largest object write_in_place takes (0: none)."""
        return 0

    def write_in_place(self, names: list[bytes], sizes: list[int], layout: bytes,
                       evict_first: list[bool], fill: Callable[[int, memoryview], bool]
                       ) -> list[bool]:
        """Store objects whose bytes `fill(i, view)` writes straight into the tier's memory
        (view: `sizes[i]` writable bytes, valid during the call only); per name whether it
        holds the object now (a `fill` returning False stores nothing; room made for it by
        eviction stays made). An object already held under the name, in this layout and
        size, is kept and `fill` not called: names are content addresses. Only a tier of
        this process's memory can (in_place_limit > 0). `fill` runs under the tier's lock:
        it must not call into the store."""
        return [False] * len(names)

    def contains_known(self, names: list[bytes]) -> list[bool] | None:
        """Presence of every name from memory alone (no I/O, so no deadline needed), or None
        when that cannot be told without asking the backend."""
        return None

    def forget_absent(self, names: list[bytes]) -> None:  # noqa: B027 -- optional hook
        """These objects were just written elsewhere (another process): a tier that caches
        presence drops what it remembered as missing."""

    def usage(self) -> dict:
        """objects / used_bytes / capacity_bytes where the tier knows them."""
        return {}

    def close(self) -> None:  # noqa: B027 -- optional hook: most tiers hold nothing
        """Release connections, threads and memory; the tier is not called afterwards."""

    def note(self, stored: bool, names) -> None:
        """Record stores/removals for a listener (local tiers call this)."""
        if self.events is not None:
            self.events.extend((stored, n) for n in names)

    def read_limit(self, name: bytes, out: memoryview | None) -> int:
        """The largest object this read accepts: one that fits `out`, else the store's bound."""
        from ..format import header_size
        from ..sealing import TAG_SIZE

        if out is None:
            return self.max_object_size
        return header_size(name) + len(out) + TAG_SIZE

    def verify(self, name: bytes, layout: bytes, key: PoolKey, blob,
               out: memoryview | None = None) -> Record | None:
        """The record in blob if it is authentic and ours (payload copied or decrypted into
        `out` when given); else count it, delete it if corrupt, and return None."""
        if out is None:
            status, rec = open_blob(blob, name, layout, key)
        else:
            with current_guard().writing() as ok:
                if not ok:  # the caller gave up on this call: its buffers are not ours
                    return None
                status, rec = open_blob(blob, name, layout, key, out)
        if status is Status.OK:
            return rec
        self.reject(name, status)
        return None

    def verify_all(self, names: list[bytes], layout: bytes, key: PoolKey, blobs: list,
                   outs: list[memoryview] | None = None) -> list[Record | None]:
        """verify() for a batch of fetched blobs (None = absent); counts bytes read."""
        into: Sequence[memoryview | None] = outs if outs is not None else [None] * len(names)
        out: list[Record | None] = []
        for name, blob, o in zip(names, blobs, into, strict=True):
            if blob is None:
                out.append(None)
            elif o is not None and _payload_len(blob) > len(o):
                self.stats.inc("rejected")  # cannot be ours: the caller's layout fits its buffer
                out.append(None)
            else:
                out.append(self.verify(name, layout, key, blob, o))
        self.stats.inc("bytes_out", sum(len(r.payload) for r in out if r is not None))
        return out

    def reject(self, name: bytes, status: Status) -> None:
        self.stats.inc(status.value)
        if status is Status.FOREIGN_LAYOUT:  # authentic, another engine's layout: not ours to drop
            log.info("%s tier: object %s was written for another KV layout (a miss here)",
                     self.type, name.hex()[:16])
            return
        log.warning("%s tier: %s object %s removed", self.type, status.value, name.hex()[:16])
        try:
            self.delete_many([name])
        except Exception as e:  # the next reader will find it again and retry
            log.debug("%s tier: delete of a bad object failed: %s", self.type, e)


GCM_SLACK = 15  # GCM's update_into wants room for a block more than it writes


class PieceBuffers(threading.local):
    """Per-thread scratch for reads checked piece by piece: `raw` receives a piece, `plain`
    takes a decrypted piece where the caller's buffer lacks the room GCM's update_into
    wants (16 bytes more than it writes)."""

    def __init__(self, piece: int) -> None:
        self.raw = memoryview(bytearray(piece))
        self.plain = memoryview(bytearray(piece + 16))


def _payload_len(blob) -> int:
    """Payload length a blob's header claims (0 when it has none: verify rejects it)."""
    from ..format import FIXED_SIZE

    try:
        return int.from_bytes(bytes(memoryview(blob)[8:16]), "little") \
            if len(blob) >= FIXED_SIZE else 0
    except (TypeError, ValueError):
        return 0
