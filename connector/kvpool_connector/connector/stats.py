"""Connector statistics: collected in workers and the scheduler, summed by vLLM, exported on
the API server's /metrics through `build_prom_metrics`.

vLLM runs the connector's stores in its engine-core process (the workers' stores, and the
scheduler's for the shared tiers), which serves no /metrics; only what travels through
vLLM's KV connector stats (worker -> EngineCore -> API server) reaches Prometheus. So the
store's own series (`kvpool_store_*`, the ones the Grafana dashboard shows) travel that way
too, under the names and labels a standalone store exports (store/metrics.py), plus vLLM's
`model_name` and `engine` labels.

The payload crosses process boundaries, so it is plain data (str keys, numbers, lists):

- `{metric: {label: value}}`: the connector's counters (label "" when unlabelled, the tier
  name for per-tier counters, "kind/tier" for the object counters: `kind_tier()`); increases
  since the last report.
- `kvpool_store_events` / `kvpool_store_bytes`: `{store: {tier: {event|direction: n}}}`,
  increases since the last report.
- `kvpool_store_op_seconds`: `{store: {tier: {op: {bucket: [count, sum]}}}}`, increases of
  each latency bucket (bucket: index into store.metrics.BUCKETS, len(BUCKETS) for +Inf).
- `kvpool_store_state`: `{source: {"seq", "store", "tiers": {tier: {"healthy",
  "queue_depth", "used_bytes", "shared"}}}}`: the gauges of one store (source: one store in
  one process), its latest sample.

Increases add up across workers and steps; a source's gauges are its newest sample (`seq`),
and sources combine only at export (combine_state): a tier is healthy if every process sees
it healthy, queue depths add up, bytes held add up for cpu tiers and are the largest report
for shared ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from ..store.metrics import (
    BUCKETS,
    DOCS,
    EVENTS,
    GAUGE_METRICS,
    LATENCY,
    OPS,
    STATE,
    STORE_COUNTERS,
    TIER_METRICS,
    combine_state,
)

KIND_TIER = ("kind", "tier")

# metric name -> (help text, its label names); a payload's label is their values joined
# with "/" (`kind_tier("decode", "cpu")`); the last value may hold "/" (a tier's name)
METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    **{name: (doc, ("tier",)) for name, doc in TIER_METRICS.items()},
    "kvpool_loaded_chunks": ("Chunks loaded into the paged KV cache", ()),
    "kvpool_loaded_bytes": ("Bytes loaded into the paged KV cache", ()),
    "kvpool_inline_loads": ("Loads served from the worker's own memory within the step "
                            "that submitted them, before its forward (no loader thread)",
                            ()),
    "kvpool_load_error_chunks": ("Chunks that failed to load (recomputed)", ()),
    "kvpool_step_seconds": ("Worker time inside the engine's steps, the connector's share of "
                            "every request's TTFT and inter-token latency: load (reading and "
                            "scattering chunks before the forward, waiting for sync and "
                            "layerwise loads) and save (gathering chunks after it; a store of "
                            "this process's memory only also stores them there; tensor-parallel "
                            "rank 0, whose copies the other ranks make side by side)",
                            ("phase",)),
    "kvpool_saved_chunks": ("Chunks copied out of the paged KV cache into the store", ()),
    "kvpool_saved_bytes": ("Bytes copied out of the paged KV cache into the store", ()),
    "kvpool_save_dropped_chunks": ("Chunks not saved (save queue full or store failure)", ()),
    "kvpool_lookup_hit_tokens": ("Prompt tokens the scheduler found in the pool", ()),
    "kvpool_prompt_tokens_computed": ("Tokens the engine prefills at a request's admission "
                                      "(again after a preemption): neither vLLM's prefix "
                                      "cache nor any kvpool tier served them", ()),
    "kvpool_saved_objects": ("Objects saved into the first tier (the lower tiers are written "
                             "behind it), by kind: prompt and decode chunks (decode: completed "
                             "by generated tokens), prompt_tail and decode_tail (the blocks "
                             "past the last full chunk; decode_tail: holding generated tokens)",
                             KIND_TIER),
    "kvpool_hit_objects": ("Objects loaded into the paged KV cache, by kind and the tier that "
                           "served them (decode, decode_tail: saved by this engine from "
                           "generated tokens)", KIND_TIER),
    "kvpool_hit_tokens": ("Prompt tokens loaded from the pool, by the kind of object and the "
                          "tier that served them (counted by tensor-parallel rank 0)",
                          KIND_TIER),
    "kvpool_lookups": ("Scheduler lookups of prompt prefixes", ()),
    "kvpool_lookup_seconds": ("Scheduler time spent in lookups", ()),
    "kvpool_lookups_deferred": ("Lookups whose Redis/S3 job was not done within the "
                                "scheduler's inline wait (5 ms): each cost its request at "
                                "least one engine step", ()),
    "kvpool_handovers": ("Prefill requests that returned a handover for a decode engine "
                         "(prefill/decode through the pool)", ()),
    "kvpool_handover_write_failures": ("Objects of a handover not written through to the "
                                       "shared tiers (the handover promises less)", ()),
    "kvpool_handover_hits": ("Decode requests that found their handover's objects and load "
                             "them", ()),
    "kvpool_handover_timeouts": ("Decode requests whose handover's objects were not all "
                                 "visible within handover_wait_seconds (they recompute)", ()),
    "kvpool_handover_refused": ("Requests asking for a handover (do_remote_decode, "
                                "kvpool.handover) on an engine not configured to give one "
                                "(handover_requests): run as ordinary requests", ()),
    "kvpool_lora_adapters_changed": ("LoRA adapters whose files changed while the engine ran: "
                                     "their requests stay out of the pool until it restarts", ()),
    "kvpool_lora_digest_late": ("Requests that waited ADAPTER_WAIT_S for their LoRA adapter's "
                                "files to be digested and ran without the pool", ()),
    "kvpool_handover_capped": ("Handovers cut short by handover_max_bytes or "
                               "handover_step_bytes (the rest saved behind; the decode engine "
                               "computes it)", ()),
    "kvpool_handover_rejected": ("Handovers ignored: malformed, or naming objects this "
                                 "request does not derive (another prompt, model or key)", ()),
    "kvpool_prewarm_objects": ("Warm start: objects of the pool's hot set loaded into the cpu "
                               "tier at engine start (connector/warm.py)", ()),
    "kvpool_prewarm_bytes": ("Warm start: bytes loaded into the cpu tier at engine start", ()),
    "kvpool_prewarm_misses": ("Warm start: hot set objects the shared tier did not serve "
                              "(gone, or failing their MAC)", ()),
    "kvpool_prewarm_seconds": ("Warm start: time the pre-warm ran (engine start waits for at "
                               "most warm_start.max_seconds of it)", ()),
    "kvpool_prewarm_hit_objects": ("Warm start: objects loaded into the paged KV cache that "
                                   "the pre-warm had put in the cpu tier", ()),
    "kvpool_hotset_writes": ("Warm start: merges of this engine's hits into the pool's hot "
                             "set manifest", ()),
}


def kind_tier(kind: str, tier: str) -> str:
    """The payload label of an object counter (kvpool_saved_objects and the like)."""
    return f"{kind}/{tier}"


STORE_STATS_EVERY_S = 0.5  # how often a process samples its store for the stats

def _add(into: dict, other: dict) -> None:
    """Add `other`'s numbers into `into`, level by level ([count, sum] lists elementwise)."""
    for k, v in other.items():
        if isinstance(v, dict):
            sub = into.get(k)
            if not isinstance(sub, dict):
                sub = into[k] = {}
            _add(sub, v)
        elif isinstance(v, (list, tuple)):
            cur = into.get(k)
            into[k] = ([a + b for a, b in zip(cur, v, strict=True)] if isinstance(cur, list)
                       and len(cur) == len(v) else list(v))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            into[k] = into.get(k, 0) + v


def _any_nonzero(d: Any) -> bool:
    if isinstance(d, dict):
        return any(_any_nonzero(v) for v in d.values())
    if isinstance(d, (list, tuple)):
        return any(_any_nonzero(v) for v in d)
    return bool(d)



@dataclass
class KVPoolConnectorStats(KVConnectorStats):
    if TYPE_CHECKING:  # KVConnectorStats' field (vLLM is not type-checked): metric -> label -> n,
        data: dict[str, dict[str, Any]]  # the store's series nest store -> tier -> label

    def __post_init__(self) -> None:
        if not isinstance(self.data, dict):
            self.data = {}

    def inc(self, metric: str, value: float = 1, label: str = "") -> None:
        if value:
            d = self.data.setdefault(metric, {})
            d[label] = d.get(label, 0) + value

    def reset(self) -> None:
        self.data = {}

    def merge(self, data: dict) -> None:
        """Add a payload: increases add up, a source's gauges keep their newest sample."""
        for metric, value in (data or {}).items():
            if not isinstance(value, dict):
                continue
            if metric == STATE:
                mine = self.data.setdefault(STATE, {})
                for source, sample in value.items():
                    if source not in mine or sample.get("seq", 0) >= mine[source].get("seq", 0):
                        mine[source] = dict(sample)
            else:
                _add(self.data.setdefault(metric, {}), value)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.merge(other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        """Flat totals for vLLM's log line: `metric[label/...]`, latencies as _count/_sum,
        gauges combined over sources."""
        out: dict[str, int | float] = {}
        for metric, labels in self.data.items():
            if metric == STATE:
                for (store, tier), g in combine_state(labels).items():
                    for name, v in g.items():
                        out[f"{GAUGE_METRICS[name]}[{store}/{tier}]"] = v
            elif metric in STORE_COUNTERS:
                for store, tiers in labels.items():
                    for tier, values in tiers.items():
                        for label, v in values.items():
                            out[f"{metric}[{store}/{tier}/{label}]"] = v
            elif metric == LATENCY:
                for store, tiers in labels.items():
                    for tier, ops in tiers.items():
                        for op, buckets in ops.items():
                            key = f"{metric}[{store}/{tier}/{op}]"
                            out[key + "_count"] = sum(c for c, _ in buckets.values())
                            out[key + "_sum"] = sum(s for _, s in buckets.values())
            else:
                for label, v in labels.items():
                    out[f"{metric}{'[' + label + ']' if label else ''}"] = v
        return out

    def is_empty(self) -> bool:
        return not (self.data.get(STATE) or _any_nonzero(
            {k: v for k, v in self.data.items() if k != STATE}))


class KVPoolPromMetrics(KVConnectorPromMetrics):
    """The connector's counters `kvpool_*_total` (per tier where labelled) and the store's
    series `kvpool_store_*`, with vLLM's engine labels first."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics = {}
        for name, (doc, label_names) in METRICS.items():
            names = list(labelnames) + list(label_names)
            self._metrics[name] = self._counter_cls(name=name, documentation=doc,
                                                    labelnames=names)
        base = list(labelnames) + ["store", "tier"]
        for name, label in STORE_COUNTERS.items():
            self._metrics[name] = self._counter_cls(name=name, documentation=DOCS[name],
                                                    labelnames=base + [label])
        self._metrics[LATENCY] = self._histogram_cls(
            name=LATENCY, documentation=DOCS[LATENCY], labelnames=base + ["op"],
            buckets=list(BUCKETS))
        for name in GAUGE_METRICS.values():
            self._metrics[name] = self._gauge_cls(name=name, documentation=DOCS[name],
                                                  labelnames=base,
                                                  multiprocess_mode="mostrecent")
        self._bound: dict[tuple, Any] = {}
        self._sources: dict[int, dict[str, dict]] = {}  # engine -> source -> newest sample
        self._tiers: set[tuple[int, str, str]] = set()  # (engine, store, tier) seen

    def _child(self, engine_idx: int, metric: str, *labels: str):
        key = (engine_idx, metric, *labels)
        m = self._bound.get(key)
        if m is None:
            values = list(self.per_engine_labelvalues[engine_idx]) + list(labels)
            m = self._bound[key] = self._metrics[metric].labels(*values)
        return m

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for metric, labels in (transfer_stats_data or {}).items():
            if not isinstance(labels, dict):
                continue
            if metric == STATE:
                self._observe_state(labels, engine_idx)
            elif metric in STORE_COUNTERS:
                for store, tiers in labels.items():
                    for tier, values in tiers.items():
                        for label, v in values.items():
                            if v > 0:
                                self._child(engine_idx, metric, store, tier, label).inc(v)
            elif metric == LATENCY:
                for store, tiers in labels.items():
                    for tier, ops in tiers.items():
                        for op, buckets in ops.items():
                            h = self._child(engine_idx, metric, store, tier, op)
                            for count, total in buckets.values():
                                # each call's bucket and the sum come out exact: the mean
                                # of the calls in one bucket lies in that bucket
                                for _ in range(int(count)):
                                    h.observe(total / count)
            elif metric in METRICS:
                n = len(METRICS[metric][1])
                for label, v in labels.items():
                    values = label.split("/", n - 1) if n else []
                    if v and len(values) == n:
                        self._child(engine_idx, metric, *values).inc(v)

    def _observe_state(self, samples: dict[str, dict], engine_idx: int) -> None:
        known = self._sources.setdefault(engine_idx, {})
        for source, sample in samples.items():
            if source not in known or sample.get("seq", 0) >= known[source].get("seq", 0):
                known[source] = sample
        for (store, tier), gauges in combine_state(known).items():
            if (engine_idx, store, tier) not in self._tiers:
                self._tiers.add((engine_idx, store, tier))
                self._zero_series(engine_idx, store, tier)
            for name, v in gauges.items():
                self._child(engine_idx, GAUGE_METRICS[name], store, tier).set(v)

    def _zero_series(self, engine_idx: int, store: str, tier: str) -> None:
        """Every event, direction and op of a tier from its first report on, at 0 until it
        happens (as a standalone store exports them): a dashboard shows "0 drops", and a
        rate over them is 0, never "no data"."""
        for event in EVENTS:
            self._child(engine_idx, "kvpool_store_events", store, tier, event)
        for direction in ("in", "out"):
            self._child(engine_idx, "kvpool_store_bytes", store, tier, direction)
        for op in OPS:
            self._child(engine_idx, LATENCY, store, tier, op)
