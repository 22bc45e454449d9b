"""Replay a trace through a model of a pool (pure; no KV bytes, only which objects each cache
holds): engines behind a router, each with vLLM's own prefix cache and a kvpool cpu tier of
its own, and optionally one tier every engine shares (Redis, S3, a shared disk).

Every cache is a `SlotIndex` (store/slots.py), the cpu tier's own bookkeeping and eviction
(LRU or ARC, as configured); vLLM's prefix cache is modelled as an LRU of the same objects.
A request is served, as vLLM and the connector serve it, by its longest stored prefix: the
engine's cache first, then the tiers in order (cpu, then shared), each object from the first
tier that holds it; the rest is computed. Afterwards the engine holds the whole prompt, what
a lower tier served is promoted into the tiers above it, and what was computed is written to
every tier (kvpool writes through).

Objects are kvpool chunks (`chunk_tokens`) of the trace's hash blocks, keyed as the connector
keys them (its `chunk_keys`, of the chained block ids); only whole chunks are stored (a
prompt's partial last chunk is always computed: kvpool's tail objects are not modelled).

**Hit ratio** = prompt tokens served from any cache / prompt tokens, every request counted,
first occurrences included (a request's first sight of a prefix is a miss). The **bound** is
the same ratio for one infinite cache all engines share (every whole chunk seen before is a
hit). Per-block figures (`block_hit_ratio`: stored chunks hit / chunks) are reported beside
them, since published traces quote both.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from xxhash import xxh3_128_digest

from ..connector.block_groups import window_blocks
from ..connector.keys import PREFIX_LEN, chunk_keys as connector_chunk_keys
from ..store.slots import SlotIndex
from .trace import Request, Trace

PLAN_KEY_SPACE = b"kvpool-plan-keys"  # one key space: one model, layout, dtype for the replay
assert len(PLAN_KEY_SPACE) == PREFIX_LEN
ROUTINGS = ("round_robin", "cache_aware", "consistent_hash", "power_of_two")


@dataclass(frozen=True)
class TierModel:
    name: str            # "cpu", "shared" (or the tier type: "redis", "disk", "s3")
    size: int            # bytes, per engine for a local tier, in all for a shared one
    shared: bool
    eviction: str = "lru"


@dataclass(frozen=True)
class PoolModel:
    engines: int
    bytes_per_token: int
    engine_cache_bytes: int = 0      # each engine's own vLLM prefix cache (0: none)
    tiers: tuple[TierModel, ...] = ()
    routing: str = "round_robin"
    chunk_tokens: int = 256
    # a hybrid model's sliding-window layers: a chunk object keeps only the window's last
    # blocks of them (the connector's own window_blocks)
    window_bytes_per_token: int = 0
    window_tokens: int = 0
    block_tokens: int = 16
    tails: bool = True   # the connector's tail_objects (on by default)

    def object_bytes(self) -> int:
        kept = self.chunk_tokens
        if self.window_tokens:
            blocks = window_blocks(self.window_tokens, self.block_tokens)
            kept = min(kept, blocks * self.block_tokens)
        return self.chunk_tokens * self.bytes_per_token + kept * self.window_bytes_per_token


@dataclass
class Result:
    requests: int = 0
    prompt_tokens: int = 0
    served: dict[str, int] = field(default_factory=dict)   # source -> prompt tokens
    computed_tokens: int = 0
    chunks: int = 0               # whole chunks of every prompt
    chunk_hits: int = 0
    bound_tokens: int = 0         # what one infinite shared cache would serve
    bound_chunks: int = 0
    reads: dict[str, int] = field(default_factory=dict)    # tier -> objects read (hits)
    writes: dict[str, int] = field(default_factory=dict)   # tier -> objects written
    duration_s: float = 0.0

    @property
    def hit_ratio(self) -> float:
        return sum(self.served.values()) / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def bound(self) -> float:
        return self.bound_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def block_hit_ratio(self) -> float:
        return self.chunk_hits / self.chunks if self.chunks else 0.0

    @property
    def block_bound(self) -> float:
        return self.bound_chunks / self.chunks if self.chunks else 0.0


def _link(parent: bytes, part: int) -> bytes:
    return xxh3_128_digest(parent + part.to_bytes(8, "little", signed=True))


def chunk_keys(req: Request, block_tokens: int, chunk_tokens: int) -> tuple[list[bytes], int]:
    """(keys of the prompt's whole chunks, tokens left over in a partial last chunk) (pure).
    As vLLM chains its block hashes, the trace's block ids are chained (each link a digest of
    its parent and the id; where a chunk is part of a block, of the block's link and the
    part's index), and the connector's own `chunk_keys` makes a chunk's key of its last link:
    equal keys mean equal prefixes."""
    ids = req.hash_ids
    whole = req.input_tokens // chunk_tokens
    links: list[bytes] = []
    h = b""
    if chunk_tokens >= block_tokens:
        per = chunk_tokens // block_tokens
        for i in ids[:whole * per]:
            h = _link(h, i)
            links.append(h)
    else:
        per, parts = 1, block_tokens // chunk_tokens
        for c in range(min(whole, len(ids) * parts)):
            if c % parts == 0:
                h = _link(h, ids[c // parts])
            links.append(_link(h, c % parts))
    keys = connector_chunk_keys(PLAN_KEY_SPACE, links, per)
    return keys, req.input_tokens - len(keys) * chunk_tokens


def tail_object(req: Request, block_tokens: int, chunk_tokens: int, n_keys: int,
                vllm_block: int) -> tuple[bytes, int] | None:
    """(key, tokens) of the tail object kvpool stores past a prompt's last whole chunk: its
    whole vLLM blocks (tails.py), keyed by the prefix and the trace ids that cover them; None
    when there is no whole block past the chunks or the trace does not hash those tokens
    (pure). At the trace's granularity a tail matches only the same ids: a repeated prompt."""
    start = n_keys * chunk_tokens
    tokens = (req.input_tokens - start) // vllm_block * vllm_block
    first, last = start // block_tokens, -(-(start + tokens) // block_tokens)
    if tokens <= 0 or last > len(req.hash_ids):
        return None
    h = b""
    for i in req.hash_ids[:last]:
        h = _link(h, i)
    return PLAN_KEY_SPACE + xxh3_128_digest(h + b"|tail|" + first.to_bytes(4, "little")
                                            + tokens.to_bytes(4, "little")), tokens


def check_granularity(block_tokens: int, chunk_tokens: int) -> None:
    small, big = sorted((block_tokens, chunk_tokens))
    if small <= 0 or big % small:
        raise ValueError(f"chunk_tokens {chunk_tokens} and the trace's {block_tokens}-token "
                         "blocks must divide one another")


class Fleet:
    """The replay's state: per engine its prefix cache and local tiers, the shared tiers."""

    def __init__(self, pool: PoolModel) -> None:
        if pool.engines < 1:
            raise ValueError(f"engines must be >= 1, not {pool.engines}")
        if pool.routing not in ROUTINGS:
            raise ValueError(f"routing {pool.routing!r}: not one of {', '.join(ROUTINGS)}")
        obj = pool.object_bytes()
        self.pool = pool
        shared = {t.name: SlotIndex(t.size, t.eviction, obj) for t in pool.tiers if t.shared}
        self.engine_cache = [SlotIndex(pool.engine_cache_bytes, "lru", obj)
                             for _ in range(pool.engines)]
        # per engine: its tiers in lookup order, each (name, index); shared ones are one object
        self.tiers: list[list[tuple[str, SlotIndex]]] = [
            [(t.name, shared[t.name] if t.shared else SlotIndex(t.size, t.eviction, obj))
             for t in pool.tiers] for _ in range(pool.engines)]
        # what an engine holds itself (its cache and unshared tiers): cache_aware's score
        self.local = [[self.engine_cache[e].entries] + [
            idx.entries for t, (_, idx) in zip(pool.tiers, self.tiers[e], strict=True)
            if not t.shared] for e in range(pool.engines)]
        self.assigned = [0] * pool.engines
        self._next = 0
        self._rng = random.Random(0)   # power_of_two's draws: the same replay every run

    def route(self, keys: list[bytes], session: int | None = None) -> int:
        n = self.pool.engines
        routing = self.pool.routing
        if routing == "consistent_hash":
            # vllm-router's sticky routing by session: a conversation stays on one engine
            if session is None:
                raise ValueError("routing consistent_hash needs sessions (a Bailian trace's "
                                 "chat ids); this trace has none")
            return zlib.crc32(session.to_bytes(8, "little", signed=True)) % n
        if routing == "power_of_two":
            # the less loaded of two engines drawn at random (load: requests sent so far, as
            # the replay has no time)
            a, b = self._rng.randrange(n), self._rng.randrange(n)
            return a if self.assigned[a] <= self.assigned[b] else b
        if routing == "cache_aware" and keys:
            # the router's prefix-aware choice: the engine whose own cache and local tiers
            # hold the longest prefix; ties to the least loaded
            best = max(range(n), key=lambda e: (self._local_prefix(e, keys), -self.assigned[e]))
            if self._local_prefix(best, keys):
                return best
            return min(range(n), key=lambda e: self.assigned[e])
        e = self._next
        self._next = (e + 1) % n
        return e

    def _local_prefix(self, e: int, keys: list[bytes]) -> int:
        k = 0
        for key in keys:
            if not any(key in held for held in self.local[e]):
                break
            k += 1
        return k


def _put(idx: SlotIndex, key: bytes, n: int, evict_first: bool = False) -> bool:
    taken = idx.take(key, n)
    if taken is None:
        return False
    idx.commit(key, taken.slots, n, b"", evict_first=evict_first)
    return True


def _tail_lookup(r: Result, tail: tuple[bytes, int] | None, cache: SlotIndex,
                 tiers: list[tuple[str, SlotIndex]]) -> str | None:
    """After every whole chunk hit: the source of the prompt's tail object (vLLM's cache,
    then the tiers in order), its tokens counted served; None when nothing holds it."""
    if tail is None:
        return None
    if cache.touch(tail[0]) is not None:
        r.served["engine"] += tail[1]
        return "engine"
    for name, idx in tiers:
        if idx.touch(tail[0]) is not None:
            r.served[name] += tail[1]
            r.reads[name] += 1
            return name
    return None


def replay(trace: Trace, pool: PoolModel,
           progress: Callable[[int], None] | None = None) -> Result:
    """The pool's figures on the trace (pure but for `progress`, called every 1000 requests)."""
    check_granularity(trace.block_tokens, pool.chunk_tokens)
    fleet = Fleet(pool)
    obj, ct = pool.object_bytes(), pool.chunk_tokens
    r = Result(duration_s=trace.duration_s)
    r.served = {"engine": 0, **{t.name: 0 for t in pool.tiers}}
    r.reads = {t.name: 0 for t in pool.tiers}
    r.writes = {t.name: 0 for t in pool.tiers}
    seen: set[bytes] = set()
    for n, req in enumerate(trace.requests, 1):
        keys, _ = chunk_keys(req, trace.block_tokens, ct)
        tail = (tail_object(req, trace.block_tokens, ct, len(keys), pool.block_tokens)
                if pool.tails else None)
        r.requests += 1
        r.prompt_tokens += req.input_tokens
        r.chunks += len(keys)
        # the bound: one infinite cache every engine shares
        b = 0
        while b < len(keys) and keys[b] in seen:
            b += 1
        r.bound_chunks += b
        r.bound_tokens += b * ct
        seen.update(keys)
        if tail is not None:
            if b == len(keys) and tail[0] in seen:
                r.bound_tokens += tail[1]
            seen.add(tail[0])

        e = fleet.route(keys, req.session)
        fleet.assigned[e] += 1
        cache, tiers = fleet.engine_cache[e], fleet.tiers[e]
        i = 0
        while i < len(keys) and cache.touch(keys[i]) is not None:
            i += 1
        r.served["engine"] += i * ct
        from_tier: list[int] = []   # per loaded key: the index of the tier that served it
        while i < len(keys):
            for t, (name, idx) in enumerate(tiers):
                if idx.touch(keys[i]) is not None:
                    r.served[name] += ct
                    r.reads[name] += 1
                    from_tier.append(t)
                    break
            else:
                break
            i += 1
        hits = i
        r.chunk_hits += hits
        tail_from = _tail_lookup(r, tail, cache, tiers) if hits == len(keys) else None
        r.computed_tokens += req.input_tokens - hits * ct - (tail[1] if tail and tail_from else 0)
        # after the request: the engine holds the prompt; loads are promoted into the tiers
        # above the one that served them; computed chunks are written to every tier
        first_loaded = hits - len(from_tier)
        for k, key in enumerate(keys):
            if cache.touch(key) is None and cache.nslots:
                _put(cache, key, obj)
            if k < first_loaded:
                continue
            upto = from_tier[k - first_loaded] if k < hits else len(tiers)
            for name, idx in tiers[:upto]:
                if idx.nslots and _put(idx, key, obj):
                    r.writes[name] += 1
        if tail is not None:  # evict-first objects, as the connector writes its tails
            if cache.touch(tail[0]) is None and cache.nslots:
                _put(cache, tail[0], obj)
            # computed: into every tier; loaded: promoted above the tier that served it;
            # from vLLM's own cache: the tiers keep what they hold
            names = [name for name, _ in tiers]
            upto = (len(tiers) if tail_from is None else 0 if tail_from == "engine"
                    else names.index(tail_from))
            tail_bytes = tail[1] * obj // ct
            for name, idx in tiers[:upto]:
                if idx.nslots and _put(idx, tail[0], tail_bytes, evict_first=True):
                    r.writes[name] += 1
        if progress is not None and n % 1000 == 0:
            progress(1000)
    if progress is not None:
        progress(r.requests % 1000)
    return r
