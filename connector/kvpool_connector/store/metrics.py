"""Per-tier counters for `stats()` and the matching Prometheus series.

The Prometheus metric objects are module globals created once at import, labelled by
the store namespace (label `store`, so it never clashes with Kubernetes' `namespace` label
that scrapers attach) and tier, so opening several stores in one process never registers a metric twice
(stores of the same namespace add to the same series). Usage gauges (bytes held, queue
depth) come from one collector that asks every open store at scrape time. `stats()` reads
the per-store counters kept here, which start at zero for every store.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

EVENTS = ("hits", "misses", "evictions", "drops", "errors", "timeouts", "corrupt",
          "foreign_layout", "rejected", "promotions")

_EVENTS = Counter("kvpool_store_events", "Store events per tier (hits, misses, evictions, "
                  "drops, errors, timeouts, corrupt, foreign_layout, rejected, promotions)",
                  ["store", "tier", "event"])
_BYTES = Counter("kvpool_store_bytes", "Payload bytes written to (in) and read from (out) a tier",
                 ["store", "tier", "direction"])
_LATENCY = Histogram("kvpool_store_op_seconds", "Latency of one batched call to a tier",
                     ["store", "tier", "op"],
                     buckets=(1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 5))
_HEALTHY = Gauge("kvpool_store_tier_healthy", "1 when the tier is serving, 0 while backing off",
                 ["store", "tier"])


# Per-tier counters as the connector and the vLLM secondary tier export them (one dashboard
# for both modes): metric name -> help text, and the stats() field each one counts.
TIER_METRICS = {
    "kvpool_tier_hit_chunks": "Chunks served by each store tier to the connector",
    "kvpool_tier_miss_chunks": "Chunk reads each store tier could not serve",
    "kvpool_tier_errors": "Errors of each store tier (backend down, timeouts)",
    "kvpool_tier_corrupt": "Objects rejected by checksum or layout check, per tier",
    "kvpool_tier_drops": "Writes dropped by backpressure or failures, per tier",
}
TIER_FIELDS = {"hits": "kvpool_tier_hit_chunks", "misses": "kvpool_tier_miss_chunks",
               "errors": "kvpool_tier_errors", "corrupt": "kvpool_tier_corrupt",
               "foreign_layout": "kvpool_tier_corrupt", "drops": "kvpool_tier_drops"}


def tier_deltas(before: dict[str, Any], after: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per-tier counter increases (TIER_FIELDS, by metric then tier) between two
    `store.stats()` snapshots."""
    out: dict[str, dict[str, float]] = {}
    tiers = after.get("tiers", after) if isinstance(after, dict) else {}
    tiers_before = before.get("tiers", before) if isinstance(before, dict) else {}
    for tier, fields in tiers.items():
        if not isinstance(fields, dict):
            continue
        prev = tiers_before.get(tier, {}) if isinstance(tiers_before.get(tier), dict) else {}
        for field, metric in TIER_FIELDS.items():
            v = fields.get(field)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                d = v - (prev.get(field, 0) or 0)
                if d > 0:
                    out.setdefault(metric, {})
                    out[metric][tier] = out[metric].get(tier, 0) + d
    return out


class _UsageCollector:
    """Gauges read at scrape time from every open store (one collector for all of them)."""

    def __init__(self) -> None:
        self.stores: weakref.WeakSet = weakref.WeakSet()

    def describe(self):
        return []

    def collect(self):
        used = GaugeMetricFamily("kvpool_store_tier_used_bytes",
                                 "Bytes held by a capped tier (cpu, disk)",
                                 labels=["store", "tier"])
        queue = GaugeMetricFamily("kvpool_store_queue_depth", "Writes waiting for a lower tier",
                                  labels=["store", "tier"])
        totals: dict[tuple[str, str], list[float]] = {}
        for store in list(self.stores):
            for ns, tier, nbytes, depth in store.usage_samples():
                t = totals.setdefault((ns, tier), [0.0, 0.0, False])
                t[1] += depth
                if nbytes is not None:
                    t[0] += nbytes
                    t[2] = True
        for (ns, tier), (nbytes, depth, capped) in totals.items():
            if capped:
                used.add_metric([ns, tier], nbytes)
            queue.add_metric([ns, tier], depth)
        yield used
        yield queue


USAGE = _UsageCollector()
REGISTRY.register(USAGE)


class TierStats:
    """Counters of one tier of one store, mirrored to Prometheus when enabled."""

    def __init__(self, namespace: str, tier: str, prometheus: bool = True) -> None:
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(EVENTS + ("bytes_in", "bytes_out"), 0)
        self._prom = prometheus
        if prometheus:
            self._ev = {e: _EVENTS.labels(namespace, tier, e) for e in EVENTS}
            self._bytes = {d: _BYTES.labels(namespace, tier, d) for d in ("in", "out")}
            self._lat = {op: _LATENCY.labels(namespace, tier, op)
                         for op in ("put", "get", "contains", "delete")}
            self._healthy = _HEALTHY.labels(namespace, tier)
            self._healthy.set(1)

    def inc(self, event: str, n: int = 1) -> None:
        if n <= 0:
            return
        with self._lock:
            self.counts[event] += n
        if self._prom:
            if event == "bytes_in":
                self._bytes["in"].inc(n)
            elif event == "bytes_out":
                self._bytes["out"].inc(n)
            else:
                self._ev[event].inc(n)

    def observe(self, op: str, seconds: float) -> None:
        if self._prom:
            self._lat[op].observe(seconds)

    def set_healthy(self, ok: bool) -> None:
        if self._prom:
            self._healthy.set(1 if ok else 0)

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self.counts)
