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
    reg, prom = _registry_prom()
    prom.observe({"kvpool_tier_hit_chunks": {"disk": 3}, "kvpool_loaded_chunks": {"": 3},
                  "unknown_metric": {"": 1}}, engine_idx=0)
    prom.observe({"kvpool_tier_hit_chunks": {"disk": 2}}, engine_idx=0)
    assert reg.get_sample_value("kvpool_tier_hit_chunks_total",
                                {"model_name": "m", "engine": "0", "tier": "disk"}) == 5
    assert reg.get_sample_value("kvpool_loaded_chunks_total", {"model_name": "m", "engine": "0"}) == 3


def test_object_counters_carry_kind_and_tier_labels():
    """Saved and hit objects are labelled by kind and tier (the payload's "kind/tier"); a
    tier's own name may hold "/"; a label of the wrong shape is left out, never raised."""
    from kvpool_connector.connector.stats import kind_tier

    reg, prom = _registry_prom()
    stats = KVPoolConnectorStats()
    stats.inc("kvpool_hit_objects", 2, kind_tier("decode_tail", "disk"))
    stats.inc("kvpool_hit_objects", 1, kind_tier("prompt", "nvme/a"))
    stats.inc("kvpool_hit_tokens", 256, kind_tier("decode_tail", "disk"))
    stats.inc("kvpool_saved_objects", 3, kind_tier("decode", "cpu"))
    stats.aggregate(KVPoolConnectorStats(data={"kvpool_hit_objects": {"decode_tail/disk": 1,
                                                                      "unlabelled": 5}}))
    assert stats.reduce()["kvpool_hit_objects[decode_tail/disk]"] == 3
    prom.observe(stats.data, engine_idx=0)
    engine = {"model_name": "m", "engine": "0"}

    def value(metric: str, kind: str, tier: str) -> float | None:
        return reg.get_sample_value(metric, {**engine, "kind": kind, "tier": tier})
    assert value("kvpool_hit_objects_total", "decode_tail", "disk") == 3
    assert value("kvpool_hit_objects_total", "prompt", "nvme/a") == 1
    assert value("kvpool_hit_tokens_total", "decode_tail", "disk") == 256
    assert value("kvpool_saved_objects_total", "decode", "cpu") == 3


# -- the store's series through vLLM's stats path ---------------------------------------------
# The stores run in vLLM's engine-core process; these payloads are what carries their series
# to the API server's /metrics (connector/stats.py).

import os  # noqa: E402

import pytest  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging  # noqa: E402
from vllm.v1.metrics.stats import SchedulerStats  # noqa: E402
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder  # noqa: E402

from kvpool_connector.connector.connector import KVPoolConnector  # noqa: E402
from kvpool_connector.store.metrics import (  # noqa: E402
    BUCKETS,
    STATE,
    StoreSampler,
)
from tests.connector.store.helpers import build_store  # noqa: E402


def _through_vllm(stats: KVPoolConnectorStats) -> dict:
    """The payload as the API server's loggers get it: SchedulerStats.kv_connector_stats
    (to_dict()), msgpack-encoded by the engine core and decoded by the API server."""
    bufs = MsgpackEncoder().encode(SchedulerStats(kv_connector_stats=stats.to_dict()))
    return MsgpackDecoder(SchedulerStats).decode(bufs).kv_connector_stats


def _work(store, n_keys: int, misses: int) -> None:
    keys = [os.urandom(32) for _ in range(n_keys)]
    store.put_many(keys, [b"x" * 1000] * n_keys)
    # the disk tier is written behind the cpu tier: wait for it, or a gauge sampled now
    # differs from the store's stats read at the end (used_bytes grew in between)
    assert store.flush(timeout=10)
    store.get_many(keys + [os.urandom(32) for _ in range(misses)])


def _registry_prom():
    reg = CollectorRegistry()
    types = {Counter: lambda **kw: Counter(registry=reg, **kw),
             Gauge: lambda **kw: Gauge(registry=reg, **kw),
             Histogram: lambda **kw: Histogram(registry=reg, **kw)}
    return reg, KVPoolPromMetrics(_Cfg(), types, ["model_name", "engine"], {0: ["m", "0"]})


@pytest.fixture
def two_workers(namespace, tmp_path):
    """Two stores as two tensor-parallel workers have them (cpu + disk each), counting
    without exporting (metrics off: the connector's stores export through vLLM)."""
    stores = [build_store(namespace, {"type": "cpu", "size": "8Mi"},
                          {"type": "disk", "path": str(tmp_path / f"d{i}"), "size": "8Mi",
                           "rescan_seconds": 0}, metrics=False) for i in range(2)]
    yield stores
    for s in stores:
        s.close()


def test_store_series_add_up_across_workers_and_steps(two_workers, namespace):
    """vLLM sums each step's worker stats (KVOutputAggregator: first worker's aggregate(
    the others)), adds the scheduler's, and the logger sums steps: the store counters and
    latency buckets that reach the API server are those of both stores, each call once."""
    a, b = two_workers
    sa, sb = StoreSampler(a), StoreSampler(b)
    steps = []
    for n_a, n_b in ((3, 2), (4, 0)):  # step 2: worker b has nothing new to report
        _work(a, n_a, misses=1)
        if n_b:
            _work(b, n_b, misses=2)
        wa, wb = KVPoolConnectorStats(), KVPoolConnectorStats()
        wa.merge(sa.sample())
        wb.merge(sb.sample())
        steps.append(_through_vllm(wa.aggregate(wb)))

    total = KVPoolConnectorStats()
    for data in steps:  # what the API server's logger accumulates over an interval
        total.aggregate(KVPoolConnector.build_kv_connector_stats(data))
    tiers = [s.stats()["tiers"] for s in (a, b)]
    events = total.data["kvpool_store_events"][namespace]
    assert events["cpu"]["hits"] == 3 + 2 + 4 and events["cpu"]["misses"] == 1 + 2 + 1
    assert events["cpu"]["hits"] == sum(t["cpu"]["hits"] for t in tiers)
    assert events["disk"]["misses"] == sum(t["disk"]["misses"] for t in tiers) == 4
    assert total.data["kvpool_store_bytes"][namespace]["cpu"]["in"] == sum(
        t["cpu"]["bytes_in"] for t in tiers)
    # latency: each get call of the cpu tiers (a: 2 steps, b: 1) in exactly one bucket
    gets = total.data["kvpool_store_op_seconds"][namespace]["cpu"]["get"]
    assert sum(c for c, _ in gets.values()) == 3
    assert all(0 <= int(i) <= len(BUCKETS) for i in gets)
    reduced = total.reduce()
    assert reduced[f"kvpool_store_events[{namespace}/cpu/hits]"] == 9
    assert reduced[f"kvpool_store_op_seconds[{namespace}/cpu/get]_count"] == 3
    # gauges: one sample per store (source), the newest kept, combined only at export
    assert len(total.data[STATE]) == 2
    used = a.stats()["tiers"]["cpu"]["used_bytes"] + b.stats()["tiers"]["cpu"]["used_bytes"]
    assert reduced[f"kvpool_store_tier_used_bytes[{namespace}/cpu]"] == used
    assert reduced[f"kvpool_store_tier_healthy[{namespace}/disk]"] == 1
    # a disk is shared (every worker and the scheduler index the same directory): its bytes
    # are the largest report, not the sum of what each process sees of the same files
    disk = [s.stats()["tiers"]["disk"]["used_bytes"] for s in (a, b)]
    assert reduced[f"kvpool_store_tier_used_bytes[{namespace}/disk]"] == max(disk) > 0


def test_unchanged_store_sends_nothing(two_workers):
    a, _ = two_workers
    s = StoreSampler(a)
    first = KVPoolConnectorStats()
    first.merge(s.sample())
    assert not first.is_empty() and STATE in first.data  # the gauges go out once
    again = KVPoolConnectorStats()
    again.merge(s.sample())
    assert again.is_empty()  # an idle engine's steps carry no store payload
    _work(a, 1, misses=0)
    third = KVPoolConnectorStats()
    third.merge(s.sample())
    assert not third.is_empty() and STATE in third.data  # used bytes changed


def test_newest_sample_of_a_source_wins_whatever_the_order():
    old = {STATE: {"w0": {"seq": 1, "store": "p", "tiers": {"cpu": {"healthy": False,
                                                                     "queue_depth": 5}}}}}
    new = {STATE: {"w0": {"seq": 2, "store": "p", "tiers": {"cpu": {"healthy": True,
                                                                     "queue_depth": 0}}}}}
    for first, second in ((old, new), (new, old)):
        s = KVPoolConnectorStats(data={})
        s.merge(first)
        s.merge(second)
        assert s.data[STATE]["w0"]["seq"] == 2
        assert s.reduce() == {"kvpool_store_tier_healthy[p/cpu]": 1,
                              "kvpool_store_queue_depth[p/cpu]": 0}


def test_prometheus_store_series_match_the_store_exports(two_workers, namespace):
    """What the API server exports for the two stores: the same names and labels as a
    standalone store's series (plus vLLM's engine labels), histogram buckets and sums
    exact, gauges combined over the stores (healthy: all; queue and bytes: summed)."""
    a, b = two_workers
    sa, sb = StoreSampler(a), StoreSampler(b)
    _work(a, 3, misses=1)
    _work(b, 2, misses=0)
    w = KVPoolConnectorStats()
    w.merge(sa.sample())
    w.merge(sb.sample())
    reg, prom = _registry_prom()
    prom.observe(_through_vllm(w), engine_idx=0)
    labels = {"model_name": "m", "engine": "0", "store": namespace}
    get = reg.get_sample_value
    assert get("kvpool_store_events_total", {**labels, "tier": "cpu", "event": "hits"}) == 5
    assert get("kvpool_store_events_total", {**labels, "tier": "cpu", "event": "misses"}) == 1
    assert get("kvpool_store_bytes_total", {**labels, "tier": "cpu", "direction": "in"}) == (
        a.stats()["tiers"]["cpu"]["bytes_in"] + b.stats()["tiers"]["cpu"]["bytes_in"])
    lat = [s.runners[0].stats.latency_snapshot()["get"] for s in (a, b)]
    op = {**labels, "tier": "cpu", "op": "get"}
    assert get("kvpool_store_op_seconds_count", op) == 2
    assert get("kvpool_store_op_seconds_sum", op) == pytest.approx(
        sum(s for buckets in lat for _, s in buckets))
    for i, le in enumerate(BUCKETS):  # cumulative buckets as Prometheus has them
        want = sum(c for buckets in lat for c, _ in buckets[:i + 1])
        assert get("kvpool_store_op_seconds_bucket", {**op, "le": str(float(le))}) == want, le
    used = a.stats()["tiers"]["cpu"]["used_bytes"] + b.stats()["tiers"]["cpu"]["used_bytes"]
    assert get("kvpool_store_tier_used_bytes", {**labels, "tier": "cpu"}) == used
    assert get("kvpool_store_tier_healthy", {**labels, "tier": "disk"}) == 1
    assert get("kvpool_store_queue_depth", {**labels, "tier": "disk"}) is not None
    # what did not happen is there at 0 (a panel of drops shows 0, not "no data")
    assert get("kvpool_store_events_total", {**labels, "tier": "disk", "event": "drops"}) == 0
    assert get("kvpool_store_op_seconds_count", {**labels, "tier": "disk", "op": "delete"}) == 0
    # one store's tier turns unhealthy: the exported gauge says so, the other's sample stays
    sick = {STATE: {sa.source: {"seq": 99, "store": namespace,
                                "tiers": {"disk": {"healthy": False, "queue_depth": 4,
                                                   "used_bytes": 0}}}}}
    prom.observe(sick, engine_idx=0)
    assert get("kvpool_store_tier_healthy", {**labels, "tier": "disk"}) == 0
    assert get("kvpool_store_queue_depth", {**labels, "tier": "disk"}) >= 4


def test_vllm_logging_path_accepts_the_payload(two_workers):
    """vLLM's own KVConnectorLogging (the periodic log line) rebuilds our stats class from
    the payload, accumulates and reduces it."""
    a, _ = two_workers
    _work(a, 2, misses=1)
    w = KVPoolConnectorStats()
    w.merge(StoreSampler(a).sample())
    w.inc("kvpool_saved_chunks", 2)
    logging = KVConnectorLogging(KVTransferConfig(
        kv_connector="KVPoolConnector", kv_connector_module_path="kvpool_connector.vllm",
        kv_role="kv_both"))
    lines = []
    logging.observe(_through_vllm(w))
    logging.observe(_through_vllm(w))
    logging.log(lambda fmt, s: lines.append(fmt % s))
    assert len(lines) == 1 and "kvpool_saved_chunks=4" in lines[0]
    assert f"kvpool_store_events[{a.namespace}/cpu/hits]=4" in lines[0]


def test_step_seconds_carry_the_phase_label():
    reg, prom = _registry_prom()
    prom.observe({"kvpool_step_seconds": {"load": 0.25, "save": 0.5}}, engine_idx=0)
    prom.observe({"kvpool_step_seconds": {"load": 0.25}}, engine_idx=0)
    labels = {"model_name": "m", "engine": "0"}
    assert reg.get_sample_value("kvpool_step_seconds_total", {**labels, "phase": "load"}) == 0.5
    assert reg.get_sample_value("kvpool_step_seconds_total", {**labels, "phase": "save"}) == 0.5
