"""vLLM KV cache events for what the connector keeps in its engine's local tiers.

With `--kv-events-config '{"enable_kv_cache_events": true, ...}'` vLLM publishes the paged
cache's `BlockStored`/`BlockRemoved` (medium "GPU") on its ZMQ stream; this adds the same
events for kvpool's cpu tier (medium "CPU") and local disk tier ("STORAGE"), so a precise
router (llm-d's kv-cache scorer, vllm-router's kv_aware) also scores prefixes that were
offloaded out of the paged cache. The shared Redis/S3 tiers are not announced: every engine
of a pool reads them alike, so they do not tell a router where to send a request.

A chunk (`chunk_tokens` tokens, `blocks_per_chunk` vLLM blocks) is announced the way vLLM's
own events describe blocks: the chunk's block hashes, the hash of the block before it,
its token ids, vLLM's block size, LoRA and per-block extra keys. Tiers report object
names in the worker process; the worker translates them back to chunk keys (its store
remembers the names it wrote) and sends them in the per-step worker metadata. The
scheduler side snapshots what an event needs while the request is alive (saves planned,
loads planned: a load from a lower tier is promoted into the cpu tier) and publishes:
  - first tier: stored when the workers report a chunk copied out (the moment the
    lookup index counts it; loads are served from the save buffer until the tier has it),
    removed when the tier evicts or deletes it, or the save is dropped;
  - other local tiers (disk below cpu): stored when the write reached the tier, removed
    when it is evicted.
Each chunk is announced once per medium until it is removed. The snapshots are bounded;
a chunk pushed out of them while announced is withdrawn (BlockRemoved), so a router never
keeps believing in something this engine can no longer describe.

Tail objects (tails.py: the blocks past a prompt's last full chunk) are announced the same
way, as the blocks they cover. Objects may then cover the same blocks: a tail and the full
chunk that later completes over it, two tails of different lengths after the same chunks.
So blocks are counted per medium: a block is announced stored when the first object holding
it lands in a medium, removed when the last one leaves it, and a BlockStored carries only
the blocks that are new there (a contiguous run, with its own parent hash: a tail always
starts at a chunk boundary, so the blocks one object shares with others are a prefix of it).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)

from ..store.tiers import tier_class
from .keys import block_hash_bytes

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.request import Request

MEDIUM = {"host": MEDIUM_CPU, "disk": MEDIUM_STORAGE}  # local tiers, by their hit source
MAX_CHUNKS = 1 << 15  # snapshots kept at most (token ids as 4-byte ints: ~1 KiB per 256)


def tier_medium(tier_type: str) -> str | None:
    """The medium a local tier's events name; None for a shared tier (not announced)."""
    tier = tier_class(tier_type)
    return MEDIUM.get(tier.hit_source) if tier.local else None


@dataclass(slots=True)
class _Chunk:
    hashes: list
    parent: Any
    tokens: array
    extra_keys: list | None
    lora_id: int | None
    lora_name: str | None
    session_id: str | None
    media: set[str] = field(default_factory=set)  # where it is announced now


class KVEvents:
    """Scheduler side: snapshots, dedup per medium, the events of the last steps."""

    def __init__(self, tier_types: list[str], block_size: int, blocks_per_chunk: int,
                 capacity_chunks: int = MAX_CHUNKS):
        self.media = {t: tier_medium(t) for t in tier_types}  # tier type -> medium
        self.first = self.media[tier_types[0]]
        self.block_size = block_size
        self.blocks_per_chunk = blocks_per_chunk
        self.capacity = max(1, min(capacity_chunks, MAX_CHUNKS))
        self.chunks: OrderedDict[bytes, _Chunk] = OrderedDict()
        self.pending: list[KVCacheEvent] = []
        # (medium, block hash) -> how many announced objects hold that block there
        self.held: dict[tuple[str, Any], int] = {}

    # -- snapshots (while the request is alive) -----------------------------------------------
    def remember(self, request: Request, chunk: int, key: bytes) -> None:
        """Snapshot full chunk `chunk` of the request, stored under `key`."""
        lo = chunk * self.blocks_per_chunk
        self.remember_blocks(request, lo, lo + self.blocks_per_chunk, key)

    def remember_blocks(self, request: Request, lo: int, hi: int, key: bytes) -> None:
        """Snapshot blocks [lo, hi) of the request, the object stored under `key` (a chunk,
        or a tail object: the blocks past the last full chunk)."""
        if key in self.chunks:
            self.chunks.move_to_end(key)
            return
        raw = request.block_hashes
        if not 0 <= lo < hi <= len(raw):
            return
        tok = self.block_size
        extra = [generate_block_hash_extra_keys(request, b * tok, (b + 1) * tok, 0)[0]
                 for b in range(lo, hi)]
        lora = request.lora_request
        self.chunks[key] = _Chunk(
            hashes=[maybe_convert_block_hash(block_hash_bytes(h)) for h in raw[lo:hi]],
            parent=maybe_convert_block_hash(block_hash_bytes(raw[lo - 1])) if lo else None,
            tokens=array("l", request.all_token_ids[lo * tok:hi * tok]),
            extra_keys=to_event_extra_keys(extra),
            lora_id=lora.adapter_id if lora else None, lora_name=lora.name if lora else None,
            session_id=getattr(request, "session_id", None))
        while len(self.chunks) > self.capacity:
            _, old = self.chunks.popitem(last=False)
            for medium in sorted(old.media):  # withdrawn: we could not describe it again
                self._release(old, medium)

    # -- what the workers reported ------------------------------------------------------------
    def stored(self, key: bytes, medium: str | None) -> None:
        c = self.chunks.get(key)
        if c is None or medium is None or medium in c.media:
            return
        c.media.add(medium)
        new = []  # indices of the blocks no other object holds in this medium
        for i, h in enumerate(c.hashes):
            n = self.held.get((medium, h), 0)
            self.held[(medium, h)] = n + 1
            if not n:
                new.append(i)
        for lo, hi in _runs(new):
            tok = self.block_size
            self.pending.append(BlockStored(
                block_hashes=c.hashes[lo:hi],
                parent_block_hash=c.hashes[lo - 1] if lo else c.parent,
                token_ids=c.tokens[lo * tok:hi * tok].tolist(), block_size=tok,
                lora_id=c.lora_id, medium=medium, lora_name=c.lora_name,
                extra_keys=c.extra_keys[lo:hi] if c.extra_keys is not None else None,
                group_idx=0, session_id=c.session_id))

    def removed(self, key: bytes, medium: str | None) -> None:
        c = self.chunks.get(key)
        if c is None or medium is None or medium not in c.media:
            return
        c.media.discard(medium)
        self._release(c, medium)

    def _release(self, c: _Chunk, medium: str) -> None:
        """`c` left `medium`: BlockRemoved for its blocks no other object holds there."""
        gone = []
        for h in c.hashes:
            n = self.held.pop((medium, h), 0) - 1
            if n > 0:
                self.held[(medium, h)] = n
            else:
                gone.append(h)
        if gone:
            self.pending.append(BlockRemoved(block_hashes=gone, medium=medium, group_idx=0))

    def on_worker_meta(self, stored_keys: list[bytes], dropped_keys: list[bytes],
                       tier_events: list[tuple[str, bool, bytes]]) -> None:
        for k in stored_keys:
            self.stored(k, self.first)
        for k in dropped_keys:
            self.removed(k, self.first)
        for tier_type, is_stored, k in tier_events:
            (self.stored if is_stored else self.removed)(k, self.media.get(tier_type))

    def take(self) -> list[KVCacheEvent]:
        out, self.pending = self.pending, []
        return out


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """Sorted indices as [lo, hi) runs of consecutive ones."""
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def kv_events_enabled(vllm_config) -> bool:
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and cfg.enable_kv_cache_events)
