"""Objects by kind and tier in native mode: `kvpool_saved_objects_total{kind, tier}`,
`kvpool_hit_objects_total{kind, tier}`, `kvpool_hit_tokens_total{kind, tier}`, the connector
mode's counters (connector/stats.py), counted around vLLM's tiering manager.

What vLLM tells the manager, and so what can be told apart: every call carries the request's
`ReqContext`, whose key positions (`set_offload_key_position`: the token a chunk ends at)
the scheduler fills for the request's full blocks. When a request is first scheduled
(`on_schedule_end`'s `new_req_ids`) it has generated nothing yet, so the positions known
then are the prompt's chunks: their largest is the prompt's last full chunk boundary. A
chunk ending past it holds generated tokens: kind `decode`, otherwise `prompt` (native mode
has no tail objects). A hit is `decode` only for a chunk this engine saved as one (a bounded
index, as in connector mode); another engine's decode chunk found in a shared tier counts as
`prompt`. vLLM 0.32 offloads generated tokens' chunks only with `offload_prompt_only: false`
(its default is true): by default every count is `prompt`.

Tiers: a save is counted when vLLM's host tier holds the chunk (its first tier; the secondary
tiers are written behind it), `tier="host"`. A hit is counted when a chunk's load into the
paged cache completes: `tier="host"` if the host tier held it, else the tier that promoted it:
the kvpool tier's store tier that served it (`disk`, `redis`, `s3`), or vLLM's own secondary
tier's type (`fs`). Tokens: the chunk's tokens (blocks of it already in the paged cache are
not copied again, so a first chunk can count a few blocks more than were copied). One manager
per engine: with tensor parallelism each chunk counts once, not once per rank.

The counts travel in the manager's `get_stats`, the path vLLM's OffloadingConnector already
exports (`OffloadPromMetrics`, from the spec's `build_metric_definitions`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ..connector.stats import METRICS

SAVED, HITS, TOKENS = "kvpool_saved_objects", "kvpool_hit_objects", "kvpool_hit_tokens"
HOST = "host"
DECODE_INDEX = 1 << 16  # decode chunks remembered for their later hits (keys, ~40 B each)


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """The three counters, with connector mode's help texts and labels."""
    return {name: OffloadingCounterMetadata(documentation=METRICS[name][0],
                                            labelnames=METRICS[name][1])
            for name in (SAVED, HITS, TOKENS)}


def prompt_horizon(req_context: ReqContext) -> int:
    """The largest key position the scheduler recorded for the request (0: none), read when
    it is first scheduled: then the prompt's last full chunk boundary."""
    positions = getattr(req_context, "_offload_key_positions", None) or {}
    return max(positions.values(), default=0)


class _Bounded(OrderedDict):
    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity

    def put(self, key: Any, value: Any) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.capacity:
            self.popitem(last=False)


class KindCountingManager(OffloadingManager):
    """vLLM's offloading manager (the tiering manager), every call passed through; counts
    saves and hits by kind and tier on the way (module docstring)."""

    def __init__(self, inner: OffloadingManager, tokens_per_chunk: int) -> None:
        self.inner = inner
        self.tokens_per_chunk = tokens_per_chunk
        self._contexts: dict[str, ReqContext] = {}
        self._horizon: dict[str, int] = {}
        self._store_kind: dict[OffloadKey, str] = {}          # prepared, not yet stored
        self._load_tier: dict[tuple[str, OffloadKey], str] = {}  # prepared, not yet loaded
        self._decode: _Bounded = _Bounded(DECODE_INDEX)
        self._counts: dict[tuple[str, str, str], int] = {}

    # -- the counting ----------------------------------------------------------------------

    def _count(self, metric: str, kind: str, tier: str, n: int = 1) -> None:
        key = (metric, kind, tier)
        self._counts[key] = self._counts.get(key, 0) + n

    def kind_of(self, key: OffloadKey, req_context: ReqContext) -> str:
        horizon = self._horizon.get(req_context.req_id)
        end = req_context.get_offload_key_position(key)
        if horizon is None or end is None:  # never seen scheduled: not told apart
            return "prompt"
        return "decode" if end > horizon else "prompt"

    def _promoted_by(self, key: OffloadKey, source: CacheHitSource) -> str:
        others = []
        for tier in getattr(self.inner, "secondary_tiers", ()):
            take = getattr(tier, "take_served", None)
            if take is None:
                others.append(tier.tier_type)
                continue
            served = take(key)
            if served is not None:
                return served
        return others[0] if len(others) == 1 else source.value

    def hit_tier(self, key: OffloadKey, req_context: ReqContext) -> str:
        source = self.inner.get_load_source(key, req_context)
        return HOST if source is CacheHitSource.HOST else self._promoted_by(key, source)

    # -- OffloadingManager: passed through, counted ----------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return self.inner.lookup(key, req_context)

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return self.inner.get_load_source(key, req_context)

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext
                     ) -> LoadStoreSpec:
        for key in keys:  # the source first: the manager forgets promotions once loaded
            self._load_tier[(req_context.req_id, key)] = self.hit_tier(key, req_context)
        return self.inner.prepare_load(keys, req_context)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext):
        return self.inner.touch(keys, req_context)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext):
        for key in keys:
            tier = self._load_tier.pop((req_context.req_id, key), None)
            if tier is None:
                continue
            kind = "decode" if key in self._decode else "prompt"
            self._count(HITS, kind, tier)
            self._count(TOKENS, kind, tier, self.tokens_per_chunk)
        return self.inner.complete_load(keys, req_context)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext
                      ) -> PrepareStoreOutput | None:
        out = self.inner.prepare_store(keys, req_context)
        if out is not None:
            for key in out.keys_to_store:
                self._store_kind[key] = self.kind_of(key, req_context)
        return out

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext,
                       success: bool = True):
        for key in keys:
            kind = self._store_kind.pop(key, None)
            if kind is None or not success:
                continue
            self._count(SAVED, kind, HOST)
            if kind == "decode":
                self._decode.put(key, None)
        return self.inner.complete_store(keys, req_context, success)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._contexts[req_context.req_id] = req_context
        return self.inner.on_new_request(req_context)

    def on_request_finished(self, req_context: ReqContext) -> None:
        # no submit-side call for it follows (prepare_store: kinds already taken)
        self._contexts.pop(req_context.req_id, None)
        self._horizon.pop(req_context.req_id, None)
        return self.inner.on_request_finished(req_context)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        for req_id in context.new_req_ids:
            ctx = self._contexts.get(req_id)
            if ctx is not None and req_id not in self._horizon:
                self._horizon[req_id] = prompt_horizon(ctx)
        return self.inner.on_schedule_end(context)

    def take_events(self) -> Iterable[OffloadingEvent]:
        return self.inner.take_events()

    def has_pending_work(self) -> bool:
        return self.inner.has_pending_work()

    def reset_cache(self) -> None:
        self._store_kind.clear()  # vLLM discards the jobs in flight
        self._load_tier.clear()
        return self.inner.reset_cache()

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats = self.inner.get_stats()
        if self._counts:
            counts, self._counts = self._counts, {}
            if stats is None:
                stats = OffloadingConnectorStats()
            for (metric, kind, tier), n in counts.items():
                stats.increase_counter(metric, n, (kind, tier))
        return stats

    def shutdown(self) -> None:
        return self.inner.shutdown()

    def __getattr__(self, name: str) -> Any:  # vLLM internals reading the manager's fields
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)
