"""Eviction policies of the cpu tier, in slots (the disk tier keeps its own LRU index).

Objects written with `Record.evict_first` (the connector's tail objects) never reach a
policy's choice: the cpu and disk tiers evict them first, least recently used first.

A policy only orders keys; the tier owns the space. Protocol:
  admit(key)           before making room for a new key (ARC adapts to ghost hits here)
  insert(key, units)   after the key was stored
  touch(key)           on a read hit
  victim() -> key      the key to evict next (None when empty); the tier then calls
  remove(key, evicted) evicted=True keeps a ghost entry (ARC), False forgets the key
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol


class Policy(Protocol):
    """The protocol of the module docstring (LRU and ARC implement it)."""

    def admit(self, key: bytes) -> None: ...
    def insert(self, key: bytes, units: int) -> None: ...
    def touch(self, key: bytes) -> None: ...
    def victim(self) -> bytes | None: ...
    def remove(self, key: bytes, evicted: bool = False) -> None: ...
    def __len__(self) -> int: ...


class LRU:
    def __init__(self, capacity: int = 0) -> None:
        self._od: OrderedDict[bytes, int] = OrderedDict()

    def admit(self, key: bytes) -> None:
        pass

    def insert(self, key: bytes, units: int) -> None:
        self._od[key] = units
        self._od.move_to_end(key)

    def touch(self, key: bytes) -> None:
        if key in self._od:
            self._od.move_to_end(key)

    def victim(self) -> bytes | None:
        return next(iter(self._od), None)

    def remove(self, key: bytes, evicted: bool = False) -> None:
        self._od.pop(key, None)

    def __len__(self) -> int:
        return len(self._od)


class ARC:
    """Adaptive Replacement Cache (Megiddo & Modha, FAST '03) with sized entries.

    T1 holds keys seen once recently, T2 keys seen at least twice; B1/B2 remember keys
    recently evicted from them. A hit in B1 (recency was evicted too early) grows the target
    size p of T1, a hit in B2 shrinks it. A one-off scan therefore only cycles through T1 and
    leaves the frequently used keys in T2 alone, which plain LRU cannot do.
    """

    def __init__(self, capacity: int) -> None:
        self.c = max(1, capacity)
        self.p = 0.0
        self.t1: OrderedDict[bytes, int] = OrderedDict()
        self.t2: OrderedDict[bytes, int] = OrderedDict()
        self.b1: OrderedDict[bytes, int] = OrderedDict()
        self.b2: OrderedDict[bytes, int] = OrderedDict()
        self._u = {"t1": 0, "t2": 0, "b1": 0, "b2": 0}

    def _add(self, name: str, key: bytes, units: int) -> None:
        getattr(self, name)[key] = units
        self._u[name] += units

    def _pop(self, name: str, key: bytes) -> int | None:
        units = getattr(self, name).pop(key, None)
        if units is not None:
            self._u[name] -= units
        return units

    def admit(self, key: bytes) -> None:
        u = self._u
        if key in self.b1:
            self.p = min(self.c, self.p + max(u["b2"] / max(u["b1"], 1), 1.0) * self.b1[key])
        elif key in self.b2:
            self.p = max(0.0, self.p - max(u["b1"] / max(u["b2"], 1), 1.0) * self.b2[key])

    def insert(self, key: bytes, units: int) -> None:
        ghost = self._pop("b1", key) is not None or self._pop("b2", key) is not None
        self._pop("t1", key)
        self._pop("t2", key)
        self._add("t2" if ghost else "t1", key, units)
        u = self._u
        while u["t1"] + u["b1"] > self.c and self.b1:
            self._pop("b1", next(iter(self.b1)))
        while sum(u.values()) > 2 * self.c and self.b2:
            self._pop("b2", next(iter(self.b2)))

    def touch(self, key: bytes) -> None:
        units = self._pop("t1", key)
        if units is None:
            units = self._pop("t2", key)
        if units is not None:
            self._add("t2", key, units)

    def victim(self) -> bytes | None:
        if self.t1 and (self._u["t1"] > self.p or not self.t2):
            return next(iter(self.t1))
        return next(iter(self.t2), None)

    def remove(self, key: bytes, evicted: bool = False) -> None:
        for live, ghost in (("t1", "b1"), ("t2", "b2")):
            units = self._pop(live, key)
            if units is not None:
                if evicted:
                    self._add(ghost, key, units)
                return

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)


def make_policy(name: str, capacity: int) -> Policy:
    return {"lru": LRU, "arc": ARC}[name](capacity)
