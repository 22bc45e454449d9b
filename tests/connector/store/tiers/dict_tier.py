"""A tier defined outside kvpool's package, the way a third party writes one: this module
(a `Tier` subclass and its config model) and one `register_tier` call, nothing else.

Objects live in a dict per namespace that every store of this process shares: a stand-in
for a remote backend other stores read, so what it holds is sealed with the pool key and
checked on read like Redis's objects (the base class's `verify_all` does that).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import ClassVar, Literal

from pydantic import Field

from kvpool_connector.config import PositiveSize, TierConfigBase
from kvpool_connector.store.format import Record
from kvpool_connector.store.sealing import PoolKey
from kvpool_connector.store.tiers import Tier, register_tier


class DictTierConfig(TierConfigBase):
    type: Literal["dict"] = "dict"
    size: PositiveSize = Field(description="bytes held; the oldest objects go beyond it")


class DictTier(Tier):
    type = "dict"
    remote = True  # "another host": lookups leave the scheduler's step loop

    #: namespace -> object name -> sealed object, oldest first: the "backend"
    backends: ClassVar[dict[str, OrderedDict[bytes, bytes]]] = {}
    _lock = threading.Lock()

    def __init__(self, cfg: DictTierConfig, namespace: str, stats, **kw) -> None:
        super().__init__(cfg, namespace, stats, **kw)
        with self._lock:
            self.objects = self.backends.setdefault(namespace, OrderedDict())

    def put_many(self, records: list[Record]) -> None:
        with self._lock:
            for rec in records:
                self.objects[rec.name] = rec.blob_bytes()
                self.objects.move_to_end(rec.name)
            while sum(map(len, self.objects.values())) > self.cfg.size:
                self.objects.popitem(last=False)
                self.stats.inc("evictions")
        self.stats.inc("bytes_in", sum(len(r.payload) for r in records))

    def _blobs(self, names: list[bytes]) -> list[bytes | None]:
        with self._lock:
            return [self.objects.get(n) for n in names]

    def get_many(self, names: list[bytes], layout: bytes, key: PoolKey) -> list[Record | None]:
        return self.verify_all(names, layout, key, self._blobs(names))

    def get_many_into(self, names: list[bytes], layout: bytes, key: PoolKey,
                      outs: list[memoryview]) -> list[Record | None]:
        return self.verify_all(names, layout, key, self._blobs(names), outs)

    def contains_many(self, names: list[bytes]) -> list[bool]:
        with self._lock:
            return [n in self.objects for n in names]

    def delete_many(self, names: list[bytes]) -> None:
        with self._lock:
            for n in names:
                self.objects.pop(n, None)

    def usage(self) -> dict:
        with self._lock:
            return {"objects": len(self.objects),
                    "used_bytes": sum(map(len, self.objects.values())),
                    "capacity_bytes": self.cfg.size}


register_tier("dict", DictTier, DictTierConfig)
