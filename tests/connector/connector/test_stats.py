"""Connector stats: summed across workers and steps, per-tier deltas from store.stats(),
exported as Prometheus counters with vLLM's engine labels."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvpool_connector.connector.stats import KVPoolConnectorStats, KVPoolPromMetrics
from kvpool_connector.store.metrics import tier_deltas


def test_aggregate_sums_labelled_counters_and_reduce_flattens():
    a = KVPoolConnectorStats()
    a.inc("kvpool_tier_hit_chunks", 3, "cpu")
    a.inc("kvpool_loaded_chunks", 3)
    b = KVPoolConnectorStats(data={"kvpool_tier_hit_chunks": {"cpu": 1, "redis": 2}})
    a.aggregate(b)
    assert a.reduce() == {"kvpool_tier_hit_chunks[cpu]": 4, "kvpool_tier_hit_chunks[redis]": 2,
                          "kvpool_loaded_chunks": 3}
    assert not a.is_empty() and KVPoolConnectorStats().is_empty()


def test_tier_deltas_count_only_increases_of_known_fields():
    before = {"tiers": {"cpu": {"hits": 5, "misses": 1, "healthy": True},
                        "disk": {"hits": 0, "corrupt": 0}}}
    after = {"tiers": {"cpu": {"hits": 9, "misses": 1, "healthy": False, "used_bytes": 10},
                       "disk": {"hits": 2, "corrupt": 1, "foreign_layout": 1}}}
    assert tier_deltas(before, after) == {
        "kvpool_tier_hit_chunks": {"cpu": 4, "disk": 2},
        "kvpool_tier_corrupt": {"disk": 2},
    }
    assert tier_deltas({}, {}) == {}


class _Cfg:  # only kv_transfer_config is read by vLLM's KVConnectorPromMetrics base
    kv_transfer_config = None


def test_prometheus_counters_carry_engine_and_tier_labels():
    reg = CollectorRegistry()
    types = {Counter: lambda **kw: Counter(registry=reg, **kw), Gauge: Gauge, Histogram: Histogram}
    prom = KVPoolPromMetrics(_Cfg(), types, ["model_name", "engine"], {0: ["m", "0"]})
    prom.observe({"kvpool_tier_hit_chunks": {"disk": 3}, "kvpool_loaded_chunks": {"": 3},
                  "unknown_metric": {"": 1}}, engine_idx=0)
    prom.observe({"kvpool_tier_hit_chunks": {"disk": 2}}, engine_idx=0)
    assert reg.get_sample_value("kvpool_tier_hit_chunks_total",
                                {"model_name": "m", "engine": "0", "tier": "disk"}) == 5
    assert reg.get_sample_value("kvpool_loaded_chunks_total", {"model_name": "m", "engine": "0"}) == 3
