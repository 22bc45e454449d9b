"""Host-memory tier: one preallocated arena split into fixed-size slots.

No allocation per object: an object takes ceil(size / slot_size) slots from a free list
(objects bigger than a slot span several slots, not necessarily adjacent; objects bigger
than the whole arena are rejected and counted). The arena is pinned when CUDA is available
so device copies from it are DMA-able. Memory is trusted: the index (key, length, layout)
replaces the stored header, so reads check the layout but compute no MAC, and payloads
are kept in plaintext (the arena lives in the engine's own process).

Reads copy once: `get_many` returns `bytes`, `get_many_into` fills the caller's buffers.
Returning views into the arena would let a concurrent eviction overwrite bytes the caller
holds; `read_in_place` lends one to a callback instead, under the lock, for a caller that
copies the bytes elsewhere anyway (the connector's scatter into the paged cache: one copy
where a read and a scatter made two).
"""

from __future__ import annotations

import functools
import logging
import mmap
import sys
import threading
from collections.abc import Callable

from ..format import Record, Status
from ..sealing import PoolKey
from ..slots import Entry, SlotIndex
from .base import Tier

log = logging.getLogger("kvpool.store")
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14


def allocate_arena(size: int, pin: bool | None) -> tuple[memoryview, object]:
    """(flat byte view, owner) of `size` bytes; pages are committed on first touch.

    pin=None pins when torch is already loaded (as in vLLM) and CUDA is available; the store
    never imports torch just to find out."""
    if pin or (pin is None and sys.modules.get("torch") is not None):
        try:
            import torch

            if pin or torch.cuda.is_available():
                t = torch.empty(size, dtype=torch.uint8, pin_memory=True)
                return memoryview(t.numpy()), t
        except Exception as e:  # no torch, no CUDA: fall back to pageable memory
            if pin:
                log.warning("cpu tier: pinned arena unavailable (%s); using pageable memory", e)
    # Anonymous memory, on transparent huge pages where allowed, committed up front: the
    # arena is really preallocated and the hot path never page-faults (first-touch faults
    # cost ~50x a memcpy on VMs).
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
        m.madvise(_MADV_POPULATE_WRITE)
    except (OSError, AttributeError):  # kernel < 5.14: populate at map time instead
        m.close()
        m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                      | getattr(mmap, "MAP_POPULATE", 0))
    return memoryview(m), m


class CpuTier(Tier):
    type = "cpu"
    local = True
    shared = False  # the arena lives in the engine's own process
    process_memory = True
    hit_source = "host"
    needs_blob = False
    answers_each = True  # its index, in memory

    def __init__(self, cfg, namespace, stats, **kw) -> None:
        super().__init__(cfg, namespace, stats, **kw)
        self.capacity = cfg.size
        self._arena, self._owner = allocate_arena(cfg.size, cfg.pin_memory)
        self._lock = threading.Lock()
        # which objects the arena holds, in which slots, and what leaves for a new one
        self._slots = SlotIndex(cfg.size, cfg.eviction, cfg.slot_size)

    @property
    def slot_size(self) -> int:
        return self._slots.slot_size

    @property
    def nslots(self) -> int:
        return self._slots.nslots

    def _release(self, key: bytes, evicted: bool) -> None:
        self._slots.release(key, evicted)
        self.note(False, (key,))

    def put_many(self, records: list[Record]) -> list[bool]:
        return [self._put(rec) for rec in records]

    def _put(self, rec: Record) -> bool:
        return self._store(rec.name, len(rec.payload), rec.layout, rec.evict_first,
                           rec.payload, None)

    def in_place_limit(self) -> int:
        return self.slot_size  # one slot, contiguous (0 until the slots are sized)

    def write_in_place(self, names: list[bytes], sizes: list[int], layout: bytes,
                       evict_first: list[bool], fill: Callable[[int, memoryview], bool]
                       ) -> list[bool]:
        """Each object filled straight into its one slot under the lock (Tier.write_in_place):
        no staging buffer for put_many to copy from."""
        out = []
        for i, (name, n, first) in enumerate(zip(names, sizes, evict_first, strict=True)):
            ok = 0 < n <= self.slot_size and self._store(
                name, n, layout, first, None, functools.partial(fill, i))
            out.append(bool(ok))
        return out

    def _store(self, name: bytes, n: int, layout: bytes, evict_first: bool,
               src: memoryview | None, fill: Callable[[memoryview], bool] | None) -> bool:
        """Make room for n bytes (evicting), then copy `src` in, or let `fill` write the
        one slot (its False frees the slot again: nothing stored)."""
        with self._lock:
            index = self._slots
            held = index.entries.get(name)
            if fill is not None and held and held.layout == layout and held.length == n:
                # the same content address: kept, not filled again, so a failing fill can
                # never lose an object that was already here (Tier.write_in_place)
                index.touch(name)
                return True
            taken = index.take(name, n)
            if taken is None:  # larger than the whole arena
                self.stats.inc("rejected")
                return False
            for key in taken.released:
                self.note(False, (key,))
            if taken.evicted:
                self.stats.inc("evictions", taken.evicted)
            slots, slot, arena = taken.slots, index.slot_size, self._arena
            if fill is not None:  # units == 1: write_in_place checks the size
                ok = False
                try:
                    ok = bool(fill(arena[slots[0] * slot:slots[0] * slot + n]))
                finally:
                    if not ok:  # also when fill raised: the slot is free again
                        index.give_back(slots)
                if not ok:
                    return False
            else:
                assert src is not None
                for i, s in enumerate(slots):
                    chunk = src[i * slot:(i + 1) * slot]
                    arena[s * slot:s * slot + len(chunk)] = chunk
            index.commit(name, slots, n, layout, evict_first)
            self.note(True, (name,))
        self.stats.inc("bytes_in", n)
        return True

    def _lookup(self, key: bytes, layout: bytes) -> Entry | None:
        """Entry of key under the lock; a foreign-layout entry is dropped and counted."""
        e = self._slots.entries.get(key)
        if e is None:
            return None
        if e.layout != layout:
            self._release(key, evicted=False)
            self.stats.inc(Status.FOREIGN_LAYOUT.value)
            return None
        return self._slots.touch(key)

    def _copy_out(self, e: Entry, out: memoryview) -> None:
        slot, arena = self.slot_size, self._arena
        for i, s in enumerate(e.slots):
            m = min(slot, e.length - i * slot)
            out[i * slot:i * slot + m] = arena[s * slot:s * slot + m]

    def read_in_place(self, names: list[bytes], layout: bytes,
                      use: Callable[[int, memoryview], bool]) -> list[bool]:
        """Objects held in one slot, lent to `use` under the lock: no eviction or put can
        reuse the slot while it copies (see Tier.read_in_place). An object spanning slots is
        not contiguous: left to get_many_into."""
        taken: list[bool] = []
        nbytes = 0
        for i, name in enumerate(names):
            with self._lock:
                e = self._lookup(name, layout)
                if e is None or len(e.slots) != 1:
                    taken.append(False)
                    continue
                s = e.slots[0] * self.slot_size
                ok = bool(use(i, self._arena[s:s + e.length].toreadonly()))
            taken.append(ok)
            nbytes += e.length if ok else 0
        self.stats.inc("bytes_out", nbytes)
        return taken

    def get_many(self, names: list[bytes], layout: bytes, key: PoolKey) -> list[Record | None]:
        out: list[Record | None] = []
        nbytes = 0
        for name in names:
            with self._lock:
                e = self._lookup(name, layout)
                if e is None:
                    out.append(None)
                    continue
                if len(e.slots) == 1:
                    s = e.slots[0] * self.slot_size
                    data: bytes | bytearray = bytes(self._arena[s:s + e.length])
                else:
                    buf = bytearray(e.length)
                    self._copy_out(e, memoryview(buf))
                    data = buf
            nbytes += e.length
            out.append(Record(name, layout, memoryview(data), key=key))
        self.stats.inc("bytes_out", nbytes)
        return out

    def get_many_into(self, names: list[bytes], layout: bytes, key: PoolKey,
                      outs: list[memoryview]) -> list[Record | None]:
        recs: list[Record | None] = []
        nbytes = 0
        for name, out in zip(names, outs, strict=True):
            with self._lock:
                e = self._lookup(name, layout)
                if e is None or e.length > len(out):  # too big for the caller: a miss
                    if e is not None:
                        self.stats.inc("rejected")
                    recs.append(None)
                    continue
                self._copy_out(e, out)
            nbytes += e.length
            recs.append(Record(name, layout, out[:e.length], key=key))
        self.stats.inc("bytes_out", nbytes)
        return recs

    def contains_many(self, names: list[bytes]) -> list[bool]:
        entries = self._slots.entries
        return [k in entries for k in names]

    def delete_many(self, names: list[bytes]) -> None:
        with self._lock:
            for k in names:
                if k in self._slots.entries:
                    self._release(k, evicted=False)

    def usage(self) -> dict:
        with self._lock:
            return {"objects": len(self._slots.entries), "used_bytes": self._slots.used_bytes(),
                    "capacity_bytes": self.capacity, "slot_size": self.slot_size}

    def close(self) -> None:
        with self._lock:
            self._slots.clear()
            self._arena = memoryview(b"")
            self._owner = None  # unmapped once the last view into it is gone
