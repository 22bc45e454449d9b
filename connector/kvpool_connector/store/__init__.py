"""Tiered KV store: cpu arena, local disk, Redis and S3 tiers behind one batch API.

    from kvpool_connector.store import open_store
    store = open_store(config, layout=b"llama-8b|bf16|kv:2x32x8x128|blk16")
    store.put_many(keys, payloads) -> [bool, ...]  # returns once the first tier holds them
                                                 # (True) or refused/failed (False)
    store.put_many_through(keys, payloads) -> ([bool], [bool])  # also written to every
                         # shared tier before it returns: (first tier holds, all shared do)
    store.get_many(keys) -> [memoryview | bytes | None, ...]   # None = miss
    store.get_many_into(keys, buffers) -> [nbytes | None, ...]  # fill caller buffers
                                     # (served_by=[None] * n: filled with the serving tiers)
    store.set_evict_first(predicate)             # keys the cpu/disk tiers evict first
    store.contains_prefix(keys) -> int           # leading keys present in some tier
    store.first_present(keys) -> int | None      # the first key some tier holds, each alone
    store.contains_many(keys) -> [bool, ...]     # per key, present in some tier
    store.flush(); store.stats(); store.close()

config: a dict, a YAML/JSON path or a `kvpool_connector.config.StoreConfig`. A store with a
shared tier (disk, redis, s3) needs the pool key (`security.key_env` or `key_file`).
keys: bytes (1..1024; the connector uses 48-byte keys). Every tier stores an object under a
name derived from its key with the pool key (store/sealing.py), so names cannot be linked to
prompts without the key.
payloads: anything with the buffer protocol (bytes, bytearray, memoryview, numpy arrays) or
contiguous CPU torch tensors (viewed as bytes, no copy). The caller may reuse its buffers as
soon as put_many returns.

Trust: the cpu tier lives in the caller's process and is trusted. Everything written to a
shared tier is sealed (format.py): a keyed MAC (GMAC) over header and payload, or AES-256-GCM
when `security.encrypt` is on; a read that fails the check is a miss (counted as `corrupt`,
the object deleted) and never reaches the caller. Objects of v1 (unkeyed checksums) are
misses.

Layout fingerprint: `open_store(config, layout=...)` sets the store's default (bytes or str of
any length describing model, dtype, KV layout, chunk size, TP rank...); every call accepts
`layout=` to override it. It is hashed to 16 bytes and stored in each object's header; an
object written under another layout is a miss, counted as `foreign_layout`, and left in
place (another engine of a mixed fleet may be using it).

Semantics: the first tier is written synchronously, the others through bounded queues
(full, by count or bytes -> dropped and counted). Reads probe tiers in order and promote
lower-tier hits upwards. A failing or slow tier is skipped with backoff; no call raises on
backend errors or takes longer than `timeout_seconds` (disk, Redis and S3 calls run on a
pool with that deadline). stats() returns {"namespace", "layout", "tiers": {name: {hits,
misses, bytes_in, bytes_out, evictions, drops, errors, timeouts, corrupt, foreign_layout,
rejected, promotions, healthy, queue_depth, queue_bytes, type, [objects, used_bytes,
capacity_bytes]}}}.
"""

from __future__ import annotations

from typing import Any

from ..config import StoreConfig, load_store_config
from .format import layout_digest
from .sealing import PoolKeyError
from .tiered import TieredStore


def open_store(config: Any, layout: bytes | str | None = None,
               shared_writes: bool = True) -> TieredStore:
    """A store for a config (dict, YAML/JSON path or StoreConfig) and a default layout;
    `shared_writes=False`: a replica, which reads every tier but writes (and promotes into)
    its unshared ones only, another process writing the same objects to the shared ones."""
    cfg = config if isinstance(config, StoreConfig) else load_store_config(config)
    return TieredStore(cfg, layout=layout, shared_writes=shared_writes)


__all__ = ["PoolKeyError", "StoreConfig", "TieredStore", "layout_digest", "load_store_config",
           "open_store"]
