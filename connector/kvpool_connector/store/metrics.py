"""Per-tier counters for `stats()` and the matching Prometheus series.

The Prometheus metric objects are module globals created once at import, labelled by
namespace and tier, so opening several stores in one process never registers a metric twice
(stores of the same namespace add to the same series). `stats()` reads the per-store
counters kept here, which start at zero for every store.
"""

from __future__ import annotations

import threading

from prometheus_client import Counter, Gauge, Histogram

EVENTS = ("hits", "misses", "evictions", "drops", "errors", "timeouts", "corrupt",
          "foreign_layout", "rejected", "promotions")

_EVENTS = Counter("kvpool_store_events", "Store events per tier (hits, misses, evictions, "
                  "drops, errors, timeouts, corrupt, foreign_layout, rejected, promotions)",
                  ["namespace", "tier", "event"])
_BYTES = Counter("kvpool_store_bytes", "Payload bytes written to (in) and read from (out) a tier",
                 ["namespace", "tier", "direction"])
_LATENCY = Histogram("kvpool_store_op_seconds", "Latency of one batched call to a tier",
                     ["namespace", "tier", "op"],
                     buckets=(1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 5))
_HEALTHY = Gauge("kvpool_store_tier_healthy", "1 when the tier is serving, 0 while backing off",
                 ["namespace", "tier"])
_USED = Gauge("kvpool_store_tier_used_bytes", "Bytes held by a capped tier (cpu, disk)",
              ["namespace", "tier"])
_QUEUE = Gauge("kvpool_store_queue_depth", "Writes waiting for a lower tier",
               ["namespace", "tier"])


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
            self._used = _USED.labels(namespace, tier)
            self._queue = _QUEUE.labels(namespace, tier)
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

    def set_usage(self, used: int | None, queue_depth: int) -> None:
        if self._prom:
            if used is not None:
                self._used.set(used)
            self._queue.set(queue_depth)

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self.counts)
