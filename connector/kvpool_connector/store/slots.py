"""The cpu tier's bookkeeping without its bytes: which objects a slotted arena holds, in
which slots, and which leave when a new one needs room.

An object takes ceil(size / slot_size) slots (slot_size is set by the first object, rounded
up to 4 KiB, when not configured). Room is made by evicting objects marked evict-first
(the connector's tail objects) least recently used first, then whatever the eviction
policy (eviction.py: LRU, ARC) picks. The cpu tier copies bytes into the slots this index
hands out; `kvpool plan` replays a trace through the same index with no bytes at all, so
a planned tier evicts exactly as the real one does.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .eviction import Policy, make_policy

SLOT_ROUND = 4096


@dataclass(slots=True)
class Entry:
    slots: tuple[int, ...]
    length: int
    layout: bytes


@dataclass(slots=True)
class Taken:
    """Slots handed out for a new object, and the keys that left to make room."""

    slots: tuple[int, ...]
    released: list[bytes]   # every key no longer held (a replaced one and the evicted)
    evicted: int            # how many of them the policy or evict-first order chose


class SlotIndex:
    def __init__(self, capacity: int, eviction: str = "lru", slot_size: int = 0) -> None:
        self.capacity = capacity
        self.eviction = eviction
        self.entries: dict[bytes, Entry] = {}
        # keys put evict-first, least recently used first: they go before the policy's pick
        self.first: OrderedDict[bytes, None] = OrderedDict()
        self.slot_size = 0
        self.nslots = 0
        # free slots: those freed (reused first, last freed first) and the never used ones
        # from `fresh` on, not listed, so a planned terabyte tier costs no memory up front
        self.freed: list[int] = []
        self.fresh = 0
        self.policy: Policy = make_policy(eviction, 1)  # resized with the slots
        if slot_size:
            self.size_slots(slot_size)

    def size_slots(self, slot_size: int) -> None:
        self.slot_size = min(slot_size, self.capacity)
        self.nslots = self.capacity // self.slot_size if self.slot_size else 0
        self.freed, self.fresh = [], 0
        self.policy = make_policy(self.eviction, self.nslots)

    def units(self, n: int) -> int:
        return max(1, -(-n // self.slot_size))

    def free_slots(self) -> int:
        return len(self.freed) + self.nslots - self.fresh

    def used_bytes(self) -> int:
        return (self.nslots - self.free_slots()) * self.slot_size

    def _pop_free(self) -> int:
        if self.freed:
            return self.freed.pop()
        self.fresh += 1
        return self.fresh - 1

    def release(self, key: bytes, evicted: bool) -> Entry:
        """Forget `key` (evicted=True: the policy keeps a ghost of it, as ARC does)."""
        e = self.entries.pop(key)
        self.first.pop(key, None)
        self.freed.extend(e.slots)
        self.policy.remove(key, evicted)
        return e

    def touch(self, key: bytes) -> Entry | None:
        """A read hit: the entry, now most recently used (None when not held)."""
        e = self.entries.get(key)
        if e is not None:
            self.policy.touch(key)
            if key in self.first:
                self.first.move_to_end(key)
        return e

    def take(self, name: bytes, n: int) -> Taken | None:
        """Slots for an n-byte object named `name`, making room by eviction; None when it is
        larger than the whole arena (nothing changes then). The slots belong to `name` only
        once `commit` records it; `give_back` returns them unused."""
        if not self.slot_size:
            self.size_slots(-(-max(n, 1) // SLOT_ROUND) * SLOT_ROUND)
        units = self.units(n)
        if units > self.nslots:
            return None
        released: list[bytes] = []
        if name in self.entries:
            self.release(name, evicted=False)
            released.append(name)
        self.policy.admit(name)
        evicted = 0
        while self.free_slots() < units:
            victim = next(iter(self.first), None) or self.policy.victim()
            assert victim is not None  # fewer free slots than all: something is stored
            self.release(victim, evicted=True)
            released.append(victim)
            evicted += 1
        return Taken(tuple(self._pop_free() for _ in range(units)), released, evicted)

    def give_back(self, slots: tuple[int, ...]) -> None:
        self.freed.extend(slots)

    def commit(self, name: bytes, slots: tuple[int, ...], n: int, layout: bytes,
               evict_first: bool) -> None:
        self.entries[name] = Entry(slots, n, layout)
        self.policy.insert(name, len(slots))
        if evict_first:
            self.first[name] = None

    def clear(self) -> None:
        self.entries.clear()
        self.first.clear()
        self.freed, self.fresh = [], self.nslots  # nothing free: the arena is gone
