"""Per-tier counters for `stats()` and the matching Prometheus series.

Every store counts its events, bytes and call latencies itself (`TierStats`, read by
`stats()` and `telemetry()`), whether or not it exports them. A store opened with
`metrics: true` also mirrors them into this process's Prometheus registry: module-level
metric objects, created on the first such store (so importing this module registers
nothing, and a process that exports the same names another way, like vLLM's API server
through the connector's stats, never sees a duplicate), labelled by the store namespace
(label `store`, so it never clashes with Kubernetes' `namespace` label that scrapers attach)
and tier; stores of the same namespace add to the same series. Usage gauges (bytes held,
queue depth) come from one collector that asks every open store at scrape time.

The connector opens its stores without that mirror: vLLM runs them in its engine-core
process, which serves no /metrics, so the connector ships `telemetry()` through vLLM's KV
connector stats to the API server instead (connector/stats.py), under the same names.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import uuid
import weakref
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

EVENTS = ("hits", "misses", "evictions", "drops", "errors", "timeouts", "corrupt",
          "foreign_layout", "rejected", "promotions")
OPS = ("put", "get", "contains", "delete")
# Upper bounds (seconds) of kvpool_store_op_seconds; +Inf is implicit.
BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 5)

# name -> help text, one place for both ways of exporting them
DOCS = {
    "kvpool_store_events": "Store events per tier (hits, misses, evictions, drops, errors, "
                           "timeouts, corrupt, foreign_layout, rejected, promotions)",
    "kvpool_store_bytes": "Payload bytes written to (in) and read from (out) a tier",
    "kvpool_store_op_seconds": "Latency of one batched call to a tier",
    "kvpool_store_tier_healthy": "1 when the tier is serving, 0 while backing off",
    "kvpool_store_tier_used_bytes": "Bytes held by a capped tier (cpu, disk)",
    "kvpool_store_queue_depth": "Writes waiting for a lower tier",
}


class _Prom:
    """This process's store series, registered once, on the first exporting store."""

    def __init__(self) -> None:
        self.events = Counter("kvpool_store_events", DOCS["kvpool_store_events"],
                              ["store", "tier", "event"])
        self.bytes = Counter("kvpool_store_bytes", DOCS["kvpool_store_bytes"],
                             ["store", "tier", "direction"])
        self.latency = Histogram("kvpool_store_op_seconds", DOCS["kvpool_store_op_seconds"],
                                 ["store", "tier", "op"], buckets=BUCKETS)
        self.healthy = Gauge("kvpool_store_tier_healthy", DOCS["kvpool_store_tier_healthy"],
                             ["store", "tier"])
        REGISTRY.register(USAGE)


_PROM: _Prom | None = None
_PROM_LOCK = threading.Lock()


def registered() -> _Prom:
    """The store series in the default registry, registering them on first use."""
    global _PROM
    with _PROM_LOCK:
        if _PROM is None:
            _PROM = _Prom()
        return _PROM


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
                                 DOCS["kvpool_store_tier_used_bytes"], labels=["store", "tier"])
        queue = GaugeMetricFamily("kvpool_store_queue_depth", DOCS["kvpool_store_queue_depth"],
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


USAGE = _UsageCollector()  # registered with the other series, by registered()


class TierStats:
    """Counters and call latencies of one tier of one store, mirrored to Prometheus when
    enabled. Latencies are kept as `{op: [[count, sum] per bucket of BUCKETS, +Inf last]}`
    (each call in one bucket), totals since the store opened, so a reader takes differences."""

    def __init__(self, namespace: str, tier: str, prometheus: bool = True) -> None:
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(EVENTS + ("bytes_in", "bytes_out"), 0)
        self.latency: dict[str, list[list[float]]] = {}
        self.healthy = True
        self._prom = prometheus
        if prometheus:
            p = registered()
            self._ev = {e: p.events.labels(namespace, tier, e) for e in EVENTS}
            self._bytes = {d: p.bytes.labels(namespace, tier, d) for d in ("in", "out")}
            self._lat = {op: p.latency.labels(namespace, tier, op) for op in OPS}
            self._healthy = p.healthy.labels(namespace, tier)
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
        i = bisect.bisect_left(BUCKETS, seconds)  # the first bound >= seconds, as Prometheus
        with self._lock:
            buckets = self.latency.get(op)
            if buckets is None:
                buckets = self.latency[op] = [[0, 0.0] for _ in range(len(BUCKETS) + 1)]
            buckets[i][0] += 1
            buckets[i][1] += seconds
        if self._prom:
            self._lat[op].observe(seconds)

    def set_healthy(self, ok: bool) -> None:
        self.healthy = bool(ok)
        if self._prom:
            self._healthy.set(1 if ok else 0)

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self.counts)

    def latency_snapshot(self) -> dict[str, list[list[float]]]:
        with self._lock:
            return {op: [list(b) for b in buckets] for op, buckets in self.latency.items()}


# -- a store's series as plain data, sampled to travel between processes -------------------
# (vLLM's KV connector stats and the native tier's stats carry them: connector/stats.py,
# native/tier.py)

STATE = "kvpool_store_state"
# store counters: payload key -> the label of their innermost level
STORE_COUNTERS = {"kvpool_store_events": "event", "kvpool_store_bytes": "direction"}
LATENCY = "kvpool_store_op_seconds"
GAUGES = ("healthy", "queue_depth", "used_bytes", "shared")
GAUGE_METRICS = {"healthy": "kvpool_store_tier_healthy",
                 "queue_depth": "kvpool_store_queue_depth",
                 "used_bytes": "kvpool_store_tier_used_bytes"}


def combine_state(sources: dict[str, dict]) -> dict[tuple[str, str], dict[str, float]]:
    """The gauges of every (store, tier) over the latest samples of all sources: healthy
    only if healthy everywhere, queue depths summed (each process has its own queue), bytes
    held summed for a tier of each process's own memory (cpu) and the largest report for a
    shared one (a disk directory every worker and the scheduler see whole); bytes only where
    some source's tier is capped."""
    out: dict[tuple[str, str], dict[str, float]] = {}
    for sample in sources.values():
        for tier, g in (sample.get("tiers") or {}).items():
            cur = out.setdefault((sample.get("store", ""), tier),
                                 {"healthy": 1, "queue_depth": 0})
            cur["healthy"] = min(cur["healthy"], 1 if g.get("healthy") else 0)
            cur["queue_depth"] += g.get("queue_depth") or 0
            used = g.get("used_bytes")
            if used is not None:
                before = cur.get("used_bytes", 0)
                cur["used_bytes"] = max(before, used) if g.get("shared") else before + used
    return out


def store_delta(prev: dict | None, now: dict) -> dict:
    """The payload (store counters and latency buckets) of what a store's `telemetry()`
    counted between two samples; `prev` None: everything since it opened. Pure."""
    store = now.get("store", "")
    prev_tiers = (prev or {}).get("tiers", {})
    events: dict = {}
    nbytes: dict = {}
    latency: dict = {}
    for tier, t in now.get("tiers", {}).items():
        p = prev_tiers.get(tier, {})
        for key, into in (("events", events), ("bytes", nbytes)):
            before = p.get(key, {})
            d = {k: v - before.get(k, 0) for k, v in t.get(key, {}).items()
                 if v - before.get(k, 0) > 0}
            if d:
                into[tier] = d
        for op, buckets in t.get("latency", {}).items():
            before = p.get("latency", {}).get(op) or [[0, 0.0]] * len(buckets)
            d = {str(i): [c - bc, s - bs] for i, ((c, s), (bc, bs))
                 in enumerate(zip(buckets, before, strict=True)) if c - bc > 0}
            if d:
                latency.setdefault(tier, {})[op] = d
    out: dict = {}
    for key, val in (("kvpool_store_events", events), ("kvpool_store_bytes", nbytes),
                     (LATENCY, latency)):
        if val:
            out[key] = {store: val}
    return out


def store_state(now: dict) -> dict:
    """A store's gauges from its `telemetry()`: `{"store", "tiers": {tier: gauges}}`."""
    return {"store": now.get("store", ""),
            "tiers": {tier: {g: t.get(g) for g in GAUGES}
                      for tier, t in now.get("tiers", {}).items()}}


class StoreSampler:
    """Turns one store's `telemetry()` into stats payloads: what it counted since the last
    sample, and its gauges when they changed (first sample: always)."""

    def __init__(self, store) -> None:
        self.store = store
        self.source = uuid.uuid4().hex[:16]  # this store in this process, across hosts
        self._seq = itertools.count(1)
        self._prev: dict | None = None
        self._state: dict | None = None

    def sample(self) -> dict:
        try:
            now = self.store.telemetry()
        except Exception:  # a store that cannot report leaves the metrics where they are
            return {}
        out = store_delta(self._prev, now)
        self._prev = now
        state = store_state(now)
        if state != self._state:
            self._state = state
            out[STATE] = {self.source: {"seq": next(self._seq), **state}}
        return out
