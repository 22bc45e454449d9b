"""Connector statistics: collected in workers and the scheduler, summed by vLLM, exported on
the API server's /metrics through `build_prom_metrics`.

The payload crosses process boundaries (worker -> EngineCore -> API server), so it is a
plain dict of counters: `{metric: {label: value}}` with string labels ("" when unlabelled;
the tier name for per-tier counters).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from ..store.metrics import TIER_METRICS

# metric name -> (help text, label name or None)
METRICS: dict[str, tuple[str, str | None]] = {
    **{name: (doc, "tier") for name, doc in TIER_METRICS.items()},
    "kvpool_loaded_chunks": ("Chunks loaded into the paged KV cache", None),
    "kvpool_loaded_bytes": ("Bytes loaded into the paged KV cache", None),
    "kvpool_load_error_chunks": ("Chunks that failed to load (recomputed)", None),
    "kvpool_saved_chunks": ("Chunks copied out of the paged KV cache into the store", None),
    "kvpool_saved_bytes": ("Bytes copied out of the paged KV cache into the store", None),
    "kvpool_save_dropped_chunks": ("Chunks not saved (save queue full or store failure)", None),
    "kvpool_lookup_hit_tokens": ("Prompt tokens the scheduler found in the pool", None),
    "kvpool_lookups": ("Scheduler lookups of prompt prefixes", None),
    "kvpool_lookup_seconds": ("Scheduler time spent in lookups", None),
}

@dataclass
class KVPoolConnectorStats(KVConnectorStats):
    if TYPE_CHECKING:  # KVConnectorStats' field (vLLM is not type-checked): metric -> label -> n
        data: dict[str, dict[str, float]]

    def __post_init__(self) -> None:
        if not isinstance(self.data, dict):
            self.data = {}

    def inc(self, metric: str, value: float = 1, label: str = "") -> None:
        if value:
            d = self.data.setdefault(metric, {})
            d[label] = d.get(label, 0) + value

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for metric, labels in (other.data or {}).items():
            for label, v in labels.items():
                self.inc(metric, v, label)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for metric, labels in self.data.items():
            for label, v in labels.items():
                out[f"{metric}{'[' + label + ']' if label else ''}"] = v
        return out

    def is_empty(self) -> bool:
        return not any(any(v for v in labels.values()) for labels in self.data.values())


class KVPoolPromMetrics(KVConnectorPromMetrics):
    """Counters `kvpool_*_total` (per tier where labelled) with vLLM's engine labels."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics = {}
        for name, (doc, label) in METRICS.items():
            names = list(labelnames) + ([label] if label else [])
            self._metrics[name] = self._counter_cls(name=name, documentation=doc,
                                                    labelnames=names)
        self._bound: dict[tuple[int, str, str], Any] = {}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for metric, labels in (transfer_stats_data or {}).items():
            if metric not in self._metrics or not isinstance(labels, dict):
                continue
            for label, v in labels.items():
                if not v:
                    continue
                key = (engine_idx, metric, label)
                m = self._bound.get(key)
                if m is None:
                    values = list(self.per_engine_labelvalues[engine_idx])
                    if METRICS[metric][1]:
                        values.append(label)
                    m = self._bound[key] = self._metrics[metric].labels(*values)
                m.inc(v)
