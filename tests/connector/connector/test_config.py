"""KVPoolConnector config: file + inline merge, errors that name the field."""

from __future__ import annotations

import json

import pytest

from kvpool_connector.connector.config import (
    ConnectorConfigError,
    check_block_size,
    load_connector_config,
)

TIERS = [{"type": "cpu", "size": "64Mi"}, {"type": "disk", "path": "/tmp/x", "size": "1Gi"}]


def test_defaults_and_connector_keys():
    cfg = load_connector_config({"tiers": TIERS})
    assert (cfg.chunk_tokens, cfg.layerwise, cfg.save_decode_tokens, cfg.tail_objects) == (
        256, False, True, True)
    cfg = load_connector_config({"tiers": TIERS, "chunk_tokens": 512, "layerwise": True})
    assert cfg.chunk_tokens == 512 and cfg.layerwise


def test_inline_keys_override_the_file(tmp_path):
    f = tmp_path / "pool.yaml"
    f.write_text("namespace: from-file\nchunk_tokens: 512\ntiers:\n  - {type: cpu, size: 1Gi}\n")
    cfg = load_connector_config({"config_file": str(f), "chunk_tokens": 128})
    assert cfg.namespace == "from-file"  # only in the file
    assert cfg.chunk_tokens == 128       # inline wins
    assert cfg.tiers[0].size == 1 << 30
    j = tmp_path / "pool.json"
    j.write_text(json.dumps({"tiers": TIERS, "layerwise": True}))
    assert load_connector_config({"config_file": str(j), "layerwise": False}).layerwise is False


@pytest.mark.parametrize("extra, field", [
    ({"tiers": TIERS, "chunk_tokens": 0}, "kv_connector_extra_config.chunk_tokens"),
    ({"tiers": TIERS, "chunk_tokenz": 256}, "kv_connector_extra_config.chunk_tokenz"),
    ({"tiers": [{"type": "cpu", "size": "lots"}]}, "kv_connector_extra_config.tiers.0.cpu.size"),
    ({"tiers": []}, "kv_connector_extra_config.tiers"),
    ({"tiers": TIERS, "layerwise": "sometimes"}, "kv_connector_extra_config.layerwise"),
    ({"config_file": "/nonexistent/pool.yaml"}, "kv_connector_extra_config.config_file"),
    ({"tiers": TIERS, "lookup_wait_ms": -1}, "kv_connector_extra_config.lookup_wait_ms"),
    ({"tiers": TIERS, "lookup_wait_ms": "5ms"}, "kv_connector_extra_config.lookup_wait_ms"),
    ({"tiers": TIERS, "lookup_wait_ms": 5000}, "kv_connector_extra_config.lookup_wait_ms"),
])
def test_invalid_config_names_the_field(extra, field):
    with pytest.raises(ConnectorConfigError) as exc:
        load_connector_config(extra)
    assert field in str(exc.value)


def test_bad_yaml_file_is_named(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("tiers: [unclosed\n")
    with pytest.raises(ConnectorConfigError, match="config_file"):
        load_connector_config({"config_file": str(f)})


def test_chunk_tokens_must_be_whole_blocks():
    cfg = load_connector_config({"tiers": TIERS, "chunk_tokens": 256})
    assert check_block_size(cfg, 128) == 2
    assert check_block_size(cfg, 16) == 16
    with pytest.raises(ConnectorConfigError, match="chunk_tokens: 256 is not a multiple"):
        check_block_size(cfg, 96)


def test_a_chunk_of_more_blocks_than_a_tail_key_counts_is_refused_with_tails_on():
    """A tail key holds its block count in one byte: 8192 tokens of 16-token blocks (512
    blocks) used to trip an assert in the scheduler at the first tail; now one line naming
    chunk_tokens at engine start, and fine without tails."""
    big = load_connector_config({"tiers": TIERS, "chunk_tokens": 8192})
    with pytest.raises(ConnectorConfigError, match="chunk_tokens: 8192 is 512 blocks of 16") as e:
        check_block_size(big, 16)
    assert "\n" not in str(e.value)
    assert check_block_size(big, 32) == 256
    no_tails = load_connector_config({"tiers": TIERS, "chunk_tokens": 8192,
                                      "tail_objects": False})
    assert check_block_size(no_tails, 16) == 512


def test_store_config_without_cpu_tier_for_the_scheduler():
    cfg = load_connector_config({"tiers": TIERS, "namespace": "ns1", "chunk_tokens": 512})
    lower = cfg.as_store_config(drop_types=("cpu",))
    assert [t.type for t in lower.tiers] == ["disk"] and lower.namespace == "ns1"
    assert not hasattr(lower, "chunk_tokens")
    only_cpu = load_connector_config({"tiers": TIERS[:1]})
    assert only_cpu.as_store_config(drop_types=("cpu",)) is None


def test_config_files_hold_one_mapping(tmp_path):
    from kvpool_connector.config import load_store_config, read_documents

    two = tmp_path / "two.yaml"
    two.write_text("namespace: a\n---\nnamespace: b\n")
    assert read_documents(two) == [{"namespace": "a"}, {"namespace": "b"}]
    with pytest.raises(ConnectorConfigError, match="config_file: .* must hold one document"):
        load_connector_config({"config_file": str(two)})
    with pytest.raises(ValueError, match="expected a mapping"):
        load_store_config(str(two))
    empty = tmp_path / "empty.json"
    empty.write_text("null")
    with pytest.raises(ValueError, match="expected a mapping"):
        load_store_config(str(empty))


@pytest.mark.parametrize("tiers,refused", [
    ([{"type": "cpu", "size": "16Mi"}], False),
    ([{"type": "cpu", "size": "16Mi"}, {"type": "disk", "path": "DISK", "size": "16Mi"}], True),
])
def test_xxhash_prefix_hashes_are_refused_in_a_pool_with_a_shared_tier(tiers, refused, tiny_model,
                                                                       tmp_path, monkeypatch):
    """vLLM's xxhash is seeded with a 32-bit PYTHONHASHSEED, no secret even when set: a pool
    with a disk, redis or s3 tier refuses it at connector start, naming the setting; a
    cpu-only pool (nothing shared) may use it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvpool_connector.vllm import KVPoolConnector
    from tests.conftest import SECURITY
    from tests.connector.helpers import engine_configs

    monkeypatch.setenv("PYTHONHASHSEED", "3141592653")
    tiers = [{**t, "path": str(tmp_path)} if t["type"] == "disk" else t for t in tiers]
    for algo in ("xxhash", "xxhash_cbor", "sha256"):
        vllm_config, kv_cache_config = engine_configs(tiny_model, {
            "kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool_connector.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"tiers": tiers, "security": SECURITY}}, algo)
        if refused and algo.startswith("xxhash"):
            with pytest.raises(ConnectorConfigError,
                               match=r"--prefix-caching-hash-algo\) '" + algo + "'.*disk"):
                KVPoolConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
            continue
        KVPoolConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config).shutdown()


def test_the_workers_cpu_tier_gets_one_chunk_per_slot():
    """Unless the config sets slot_size, the worker's cpu tier is cut into slots of one
    chunk (rounded to 4 KiB): a chunk is one contiguous slot a load scatters from in place,
    whatever object happens to be stored first (a short tail made every chunk span two)."""
    from kvpool_connector.connector.connector import _chunk_slots
    from kvpool_connector.store import open_store

    cfg = load_connector_config({"tiers": TIERS})
    sized = _chunk_slots(cfg.as_store_config(), 2 * 1024 * 1024 + 1)
    assert sized.tiers[0].slot_size == 2 * 1024 * 1024 + 4096
    assert sized.tiers[1] == cfg.as_store_config().tiers[1]
    mine = load_connector_config({"tiers": [{"type": "cpu", "size": "64Mi", "slot_size": "1Mi"}]})
    assert _chunk_slots(mine.as_store_config(), 1 << 21).tiers[0].slot_size == 1 << 20
    assert _chunk_slots(None, 1 << 21) is None
    cpu_only = load_connector_config({"tiers": TIERS[:1]})
    store = open_store(_chunk_slots(cpu_only.as_store_config(), 1 << 21), layout=b"l")
    store.put_many([b"t" * 16], [b"\0" * 5000])  # a short object first
    assert store.put_many([b"c" * 16], [b"\1" * (1 << 21)]) == [True]
    assert store.runners[0].tier.slot_size == 1 << 21
    assert store.stats()["tiers"]["cpu"]["used_bytes"] == 2 << 21  # one slot each
    store.close()
