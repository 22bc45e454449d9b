"""kvpool as a secondary tier of vLLM's native offloading, driven through vLLM's real
`TieringOffloadingSpec` / `TieringOffloadingManager` (scheduler side) with real Redis and S3,
either built from an `OffloadingConfig` directly or, as in an engine, by vLLM's real
`OffloadingConnector` from a real `VllmConfig` of a local model (no engine started).

Only vLLM's GPU <-> host copy (`CPUOffloadingWorker`) needs CUDA; the test plays that part by
writing and reading the primary tier's shared host region directly, exactly the bytes the
worker would move. Everything else runs as in an engine.
"""

from __future__ import annotations

import functools

import pytest
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvpool_connector.native import tier as native_tier
from tests.conftest import SECURITY
from tests.connector.native.harness import (
    BLOCKS_PER_CHUNK,
    NATIVE,
    TIER_MODULE,
    RowEngine,
    chunk_keys,
    kvpool_tiering,
    offloading_config,
    payloads,
)


# `namespace`, `redis_tier` and `s3_tier` come from tests/connector/conftest.py.
@pytest.fixture
def redis_options(redis_tier, namespace) -> dict:
    return {"namespace": namespace, "security": SECURITY, "tiers": [redis_tier]}


@pytest.fixture
def s3_options(s3_tier, namespace) -> dict:
    # These tests check the tier's plumbing, not latency: a generous bound keeps a busy
    # machine (moto answers slowly under load) from turning writes into drops.
    return {"namespace": namespace, "security": SECURITY, "timeout_seconds": 5.0,
            "tiers": [s3_tier]}


@pytest.mark.parametrize("backend", ["redis", "s3"])
def test_second_engine_loads_what_the_first_offloaded(backend, request):
    options = request.getfixturevalue(f"{backend}_options")
    keys, data = chunk_keys(backend, 6), payloads(6)
    with RowEngine(options) as first:
        first.offload(keys, data)
    with RowEngine(options) as second:   # another engine: empty primary tier, same pool
        assert second.load(keys) == data
        assert second.load(chunk_keys("never-stored", 2)) == []


def test_config_file_with_connector_keys_and_type_alias(redis_options, tmp_path):
    """The operator mounts one file (with `chunk_tokens`) for both modes and says `kvpool`."""
    import json

    path = tmp_path / "connector.json"
    path.write_text(json.dumps({**redis_options, "chunk_tokens": 256}))
    keys, data = chunk_keys("file", 3), payloads(3)
    with RowEngine({"config_file": str(path)}, tier_type="KVPoolTier") as a:
        a.offload(keys, data)
    with RowEngine({"config_file": str(path)}) as b:
        assert b.load(keys) == data


def test_other_model_or_layout_never_hits(redis_options):
    keys, data = chunk_keys("layout", 3), payloads(3)
    with RowEngine(redis_options) as a:
        a.offload(keys, data)
    for kwargs in ({"model": "another-model"}, {"dtype": "float16"}):
        with RowEngine(redis_options, **kwargs) as other:
            assert other.load(keys) == []
            assert other.tier.identity != a.tier.identity


def test_corrupt_object_is_recomputed_not_loaded(redis_options, redis_server):
    """A tampered chunk is a miss for the request: the chunks before it load byte-exact, it
    and the ones after it are recomputed, asking again gives the same answer (no livelock),
    and the tampered object is removed from Redis."""
    import redis

    keys, data = chunk_keys("corrupt", 4), payloads(4)
    with RowEngine(redis_options) as a:
        a.offload(keys, data)
        store = a.tier.store
        names = store.object_names([a.tier.store_key(k) for k in keys])
        redis_keys = [store.runners[0].tier.object_key(n) for n in names]
    client = redis.Redis.from_url(redis_server.url, password=redis_server.password)
    assert client.exists(*redis_keys) == 4
    victim = redis_keys[2]
    blob = bytearray(client.get(victim))
    blob[-1] ^= 0xFF  # the tag's last byte: the object no longer authenticates
    client.set(victim, bytes(blob))
    with RowEngine(redis_options) as b:
        assert b.load(keys) == data[:2]
        assert b.load(keys) == data[:2]
        assert b.tier.store.stats()["tiers"]["redis"]["corrupt"] == 1
    assert client.exists(victim) == 0 and client.exists(*redis_keys[:2], redis_keys[3]) == 3
    client.close()


def test_backend_down_degrades_to_misses(redis_options, redis_server):
    keys, data = chunk_keys("down", 3), payloads(3)
    redis_server.stop()
    try:
        with RowEngine(redis_options) as eng:   # offload/load fail the test if they hang
            eng.offload(keys, data)           # stores fail quietly
            assert eng.load(keys) == data     # still served by vLLM's own primary tier
            assert eng.load(chunk_keys("other", 2)) == []
    finally:
        redis_server.start()


def test_bad_config_names_the_field(redis_options):
    with pytest.raises(ValueError, match="tiers.0"):
        RowEngine({"namespace": "x", "tiers": [{"type": "redis", "url": "http://nope"}]})
    with pytest.raises(ValueError, match=r"tiers\.0\.type: 'cpu' is not allowed"):
        RowEngine({"namespace": "x", "tiers": [{"type": "cpu", "size": "1Mi"}]})


def test_only_config_errors_are_reported_as_the_tiers_config_errors(monkeypatch):
    """A config error is named for the tier ("secondary_tiers (kvpool tier): ..."); a bug
    behind it (here a ValueError out of the config's own code) propagates unchanged, with
    its traceback, instead of passing for a config error."""
    from kvpool_connector.connector.config import ConnectorConfig

    bug = ValueError("a bug, not a config error")

    def broken(self, drop_types=()):
        raise bug

    monkeypatch.setattr(ConnectorConfig, "as_store_config", broken)
    with pytest.raises(ValueError) as caught:
        native_tier.secondary_tier_store_config(
            {"namespace": "x", "tiers": [{"type": "disk", "path": "/tmp/x", "size": "1Mi"}]})
    assert caught.value is bug


def test_layout_identity_is_vllms_file_mapper_identity():
    spec = TieringOffloadingSpec(offloading_config({"cpu_bytes_to_use": 1 << 20}))
    ident = native_tier.layout_identity(spec, 32768, native_tier.engine_identity(None))
    assert ident["model_name"] == "test-model" and ident["dtype"] == "bfloat16"
    assert ident["blocks_per_file"] == BLOCKS_PER_CHUNK and ident["chunk_bytes"] == 32768
    fp = native_tier.layout_fingerprint(ident)
    assert native_tier.key_prefix(fp) != native_tier.key_prefix(
        native_tier.layout_fingerprint({**ident, "chunk_bytes": 65536}))


def test_store_counters_reach_vllms_offloading_stats(redis_options):
    keys, data = chunk_keys("stats", 2), payloads(2)
    with RowEngine(redis_options) as a:
        a.offload(keys, data)
    with RowEngine(redis_options) as b:
        assert b.load(keys) == data
        reduced = b.manager.get_stats().reduce()
    definitions = TieringOffloadingSpec.build_metric_definitions(
        {"secondary_tiers": [{"type": "kvpool", "module_path": TIER_MODULE}]})
    assert "kvpool_tier_hit_chunks" in definitions
    assert definitions["kvpool_tier_hit_chunks"].labelnames == ("tier",)
    hits = {k: v for k, v in reduced.items() if k.startswith("kvpool_tier_hit_chunks")}
    assert sum(hits.values()) == 2, reduced


def test_store_series_reach_vllms_offloading_prometheus_metrics(redis_options, namespace):
    """Native mode's tier runs in vLLM's engine-core process too: the store's series
    (kvpool_store_*, the dashboard's) go in the tier's stats, and vLLM's own
    OffloadPromMetrics exports them with the store's names and labels."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
        OffloadPromMetrics,
    )

    keys, data = chunk_keys("series", 2), payloads(2)
    with RowEngine(redis_options) as a:
        a.offload(keys, data)
    with RowEngine(redis_options) as b:  # a fresh engine: its loads come from the tier
        assert b.load(keys) == data
        stats = b.manager.get_stats()
    reg = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=reg) for cls in (Counter, Gauge, Histogram)}

    class _Cfg:
        kv_transfer_config = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            kv_connector_extra_config={**NATIVE, **kvpool_tiering(redis_options, 1 << 20)})

    prom = OffloadPromMetrics(_Cfg(), types, ["model_name", "engine"], {0: ["m", "0"]})
    prom.observe(OffloadingConnectorStats(data=stats.data).data, engine_idx=0)
    labels = {"model_name": "m", "engine": "0", "store": namespace, "tier": "redis"}
    get = reg.get_sample_value
    assert get("kvpool_store_events_total", {**labels, "event": "hits"}) == 2
    assert get("kvpool_store_events_total", {**labels, "event": "drops"}) == 0
    assert get("kvpool_store_bytes_total", {**labels, "direction": "out"}) >= len(data[0]) * 2
    assert get("kvpool_store_op_seconds_count", {**labels, "op": "get"}) >= 1
    assert get("kvpool_store_tier_healthy", labels) == 1
    assert get("kvpool_store_queue_depth", labels) is not None


def test_the_engine_identity_tells_revisions_and_overrides_apart(redis_options, tiny_model):
    """Built by vLLM's OffloadingConnector, the tier keys with the model config hash (the
    tiered connector's model_config_hash: revision, quantization, hf_overrides, ...), the
    prefix-hash algorithm and the vLLM version: an engine on another revision or with other
    hf_overrides of the same model path never loads what this one stored."""
    import vllm
    from vllm.config import ModelConfig

    from kvpool_connector.identity import model_config_hash

    keys, data = chunk_keys("revision", 3), payloads(3)
    with RowEngine(redis_options, engine_model=tiny_model) as a:
        a.offload(keys, data)
        ident = a.tier.identity
    with RowEngine(redis_options, engine_model=tiny_model) as same:
        assert same.load(keys) == data and same.tier.identity == ident
    for kwargs in ({"revision": "v2"}, {"hf_overrides": {"rope_theta": 5000.0}}):
        with RowEngine(redis_options, engine_model=tiny_model, model_kwargs=kwargs) as other:
            assert other.load(keys) == [], kwargs
    assert ident["model_config_hash"] == model_config_hash(
        ModelConfig(model=str(tiny_model), dtype="bfloat16"))
    assert ident["vllm_version"] == vllm.__version__ and ident["hash_algo"] == "sha256"


def test_xxhash_prefix_hashes_are_refused_at_engine_start(redis_options, tiny_model,
                                                          monkeypatch):
    """vLLM's xxhash is seeded with a 32-bit PYTHONHASHSEED, no secret: a tier other engines
    share refuses it (even with a seed set), naming the setting; sha256 starts."""
    monkeypatch.setenv("PYTHONHASHSEED", "3141592653")
    for algo in ("xxhash", "xxhash_cbor"):
        with pytest.raises(ValueError, match=r"--prefix-caching-hash-algo\) '" + algo):
            RowEngine(redis_options, engine_model=tiny_model, hash_algo=algo)
    with RowEngine(redis_options, engine_model=tiny_model, hash_algo="sha256_cbor") as ok:
        assert ok.tier.identity["hash_algo"] == "sha256_cbor"


def test_lora_and_context_parallelism_are_refused_at_engine_start_naming_the_option(
        redis_options, tiny_model):
    """vLLM's block hashes name a LoRA adapter by name and path and this tier never sees the
    adapter: with a shared tier, version 2 written over version 1's path would load version 1's
    KV (before, native mode took --enable-lora). An engine built with LoRA on refuses to start,
    in one line naming the option; so does context parallelism."""
    from types import SimpleNamespace

    with pytest.raises(ValueError, match=r"does not support --enable-lora") as exc:
        RowEngine(redis_options, engine_model=tiny_model, model_kwargs={}, lora=True)
    assert "\n" not in str(exc.value)
    for attr, option in (("decode_context_parallel_size", "--decode-context-parallel-size"),
                         ("prefill_context_parallel_size", "--prefill-context-parallel-size")):
        parallel = SimpleNamespace(**{attr: 2})
        with pytest.raises(ValueError, match=f"does not support {option} > 1"):
            native_tier.check_engine_layout(SimpleNamespace(lora_config=None, parallel_config=parallel))
    native_tier.check_engine_layout(SimpleNamespace(lora_config=None, parallel_config=SimpleNamespace()))
