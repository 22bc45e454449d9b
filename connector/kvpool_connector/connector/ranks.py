"""The store as one rank sees it, and the lookups that need every rank (keys.py, "Ranks").

The scheduler and the workers exchange logical keys. Each worker stores its part of a
chunk (its tensor-parallel heads, its pipeline stage's layers) under its rank key; a chunk
is a hit only when every rank's part is there, or a request would load some ranks' KV and
recompute the others' into a cache that mixes the two.

- `RankedStore` wraps a worker's store: every key in is rewritten to the rank's key, so
  the worker (its plans, reports, warm start, audit) deals in logical keys only.
- `AllRanksLookup` wraps the scheduler's store of shared tiers: a key is present only when
  the objects of every rank tag are.
- `PartReports` counts the workers' reports of their parts: a chunk is stored (and a hit in
  the scheduler's index) once every worker reported its part.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from .keys import rank_key


def reporting_workers(parallel: Any) -> int:
    """The workers of one engine, each of which reports every save and load: tensor x
    pipeline parallel ranks. Not `parallel.world_size`: under vLLM's external_launcher it
    counts the data-parallel ranks too (other engines, which never report here), and the
    scheduler would wait for their reports forever."""
    return int(parallel.tensor_parallel_size) * int(parallel.pipeline_parallel_size)


class PartReports:
    """Which chunks every worker of the engine has stored: each worker reports its own part of
    a chunk (metadata.py), and a chunk counts as stored only at the last one. A part dropped by
    any worker forgets the chunk's count, which then never completes (a miss, saved again by a
    later request). Counts are kept for at most `keep` chunks (the oldest go first)."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._parts: OrderedDict[bytes, int] = OrderedDict()  # chunk -> reports so far

    def complete(self, reports: list[bytes], dropped: list[bytes], keep: int) -> list[bytes]:
        """The chunks `reports` (one entry per worker and chunk) complete."""
        if self.workers == 1:
            return list(reports)
        parts = self._parts
        done = []
        for k in reports:
            n = parts.pop(k, 0) + 1
            if n >= self.workers:
                done.append(k)
            else:
                parts[k] = n
        if dropped:
            gone = set(dropped)
            for k in gone:
                parts.pop(k, None)
            done = [k for k in done if k not in gone]
        while len(parts) > keep:
            parts.popitem(last=False)
        return done


class RankedStore:
    """A worker's store under its rank tag (non-empty: rank 0 of stage 0 needs no wrapper).

    Tier events are this rank's own: the KV events announce the tiers of the rank whose
    keys are the logical ones, so this wrapper reports none."""

    def __init__(self, store: Any, tag: bytes) -> None:
        assert tag, "rank 0 of stage 0 uses the store as it is"
        self.store = store
        self.tag = tag

    def own(self, keys: Sequence[bytes]) -> list[bytes]:
        return [rank_key(bytes(k), self.tag) for k in keys]

    def put_many(self, keys, payloads, layout=None):
        return self.store.put_many(self.own(keys), payloads, layout)

    def put_many_through(self, keys, payloads, layout=None):
        return self.store.put_many_through(self.own(keys), payloads, layout)

    def write_in_place(self, keys, sizes, fill, layout=None):
        return self.store.write_in_place(self.own(keys), sizes, fill, layout)

    def get_many(self, keys, layout=None, promote: bool = True):
        return self.store.get_many(self.own(keys), layout, promote)

    def get_many_into(self, keys, outs, layout=None, served_by=None):
        return self.store.get_many_into(self.own(keys), outs, layout, served_by)

    def read_in_place(self, keys, use: Callable, layout=None):
        return self.store.read_in_place(self.own(keys), use, layout)

    def in_memory(self, keys) -> bool:
        return self.store.in_memory(self.own(keys))

    def contains_many(self, keys) -> list[bool]:
        return self.store.contains_many(self.own(keys))

    def contains_prefix(self, keys) -> int:
        return self.store.contains_prefix(self.own(keys))

    def delete_many(self, keys) -> None:
        self.store.delete_many(self.own(keys))

    def put(self, key, payload, layout=None) -> bool:
        return self.store.put(rank_key(bytes(key), self.tag), payload, layout)

    def get(self, key, layout=None, promote: bool = True):
        return self.store.get(rank_key(bytes(key), self.tag), layout, promote)

    def get_into(self, key, out, layout=None):
        return self.store.get_into(rank_key(bytes(key), self.tag), out, layout)

    def first_present(self, keys) -> int | None:
        return self.store.first_present(self.own(keys))

    def forget_absent(self, keys) -> None:
        self.store.forget_absent(self.own(keys))

    def object_names(self, keys) -> list[bytes]:
        return self.store.object_names(self.own(keys))

    def take_events(self) -> list:
        self.store.take_events()  # drained, so they do not pile up in the store
        return []

    def __getattr__(self, name: str) -> Any:
        """The store's methods that take no keys; any other is refused: passed through, it
        would read or write logical keys, i.e. rank 0's heads, with a valid MAC."""
        if name in KEYLESS:
            return getattr(self.store, name)
        raise AttributeError(f"RankedStore does not pass {name!r} through: a store method that "
                             "takes keys must be wrapped to rewrite them to this rank's")


# TieredStore's methods that take no keys (every method that does is wrapped above)
KEYLESS = frozenset({"usage_samples", "set_evict_first", "tier_names", "memory_only", "flush",
                     "enable_events", "stats", "telemetry", "close"})


class AllRanksLookup:
    """Presence in the shared tiers, a key counting only when every rank tag's object is
    there (tags: KeySpace.rank_tags(), more than one)."""

    def __init__(self, store: Any, tags: Sequence[bytes]) -> None:
        assert len(tags) > 1, "one rank: ask the store itself"
        self.store = store
        self.tags = list(tags)

    def _expand(self, keys: Sequence[bytes]) -> list[bytes]:
        return [rank_key(bytes(k), t) for k in keys for t in self.tags]

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """Leading keys whose every rank's object is present: one question for all of them."""
        return self.store.contains_prefix(self._expand(keys)) // len(self.tags)

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        n = len(self.tags)
        found = self.store.contains_many(self._expand(keys))
        return [all(found[i * n:(i + 1) * n]) for i in range(len(keys))]

    def first_present(self, keys: Sequence[bytes]) -> int | None:
        """The first key (of unrelated candidates, longest first) whose every rank's object
        is present: rank 0's candidates first, then the other ranks of the one found."""
        keys = list(keys)
        start = 0
        while start < len(keys):
            i = self.store.first_present(keys[start:])
            if i is None:
                return None
            i += start
            if self.contains_prefix([keys[i]]) == 1:
                return i
            start = i + 1
        return None

    def forget_absent(self, keys: Sequence[bytes]) -> None:
        self.store.forget_absent(self._expand(keys))

    def __getattr__(self, name: str) -> Any:  # get, put (the manifest), close, stats, ...
        return getattr(self.store, name)
