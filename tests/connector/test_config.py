"""Store config: sizes, files, clear errors naming the field, extensibility, light imports."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from pydantic import ValidationError

from kvpool_connector.config import (
    CpuTierConfig,
    DiskTierConfig,
    RedisTierConfig,
    S3TierConfig,
    StoreConfig,
    load_store_config,
    parse_size,
)

FULL = {
    "namespace": "my-pool",
    "tiers": [
        {"type": "cpu", "size": "4Gi", "eviction": "lru"},
        {"type": "disk", "path": "/mnt/nvme/kvpool", "size": "100Gi"},
        {"type": "redis", "url": "redis://host:6379/0", "password_env": "REDIS_PASSWORD",
         "ttl_seconds": 86400},
        {"type": "s3", "endpoint": "http://minio:9000", "bucket": "kvpool", "prefix": "",
         "region": "us-east-1", "access_key_env": "AWS_ACCESS_KEY_ID",
         "secret_key_env": "AWS_SECRET_ACCESS_KEY"},
    ],
}


@pytest.mark.parametrize("text,expected", [
    (4096, 4096), ("4096", 4096), ("4Gi", 4 << 30), ("500Mi", 500 << 20), ("64Ki", 65536),
    ("1G", 10**9), ("1.5Ki", 1536), (" 2 Mi ", 2 << 20), ("10b", 10),
    ("1Pi", 1 << 50), ("2P", 2 * 10**15), ("1Ei", 1 << 60), ("3E", 3 * 10**18),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "4Gb", "lots", "-1", "1.3b", -5, True, None, [1],
                                 "1.5", "0.3Ki", "1.0000001k"])  # the last three: fractions of a byte
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


def test_a_full_config_keeps_its_tiers_in_order_with_their_own_models():
    cfg = load_store_config(FULL)
    assert [type(t) for t in cfg.tiers] == [CpuTierConfig, DiskTierConfig, RedisTierConfig,
                                            S3TierConfig]
    assert cfg.tiers[0].size == 4 << 30 and cfg.tiers[1].size == 100 << 30
    assert cfg.tiers[2].ttl_seconds == 86400
    assert cfg.timeout_seconds < 1


def test_yaml_and_json_files(tmp_path):
    import yaml

    y = tmp_path / "store.yaml"
    y.write_text(yaml.safe_dump(FULL))
    j = tmp_path / "store.json"
    j.write_text(json.dumps(FULL))
    assert load_store_config(str(y)) == load_store_config(j) == load_store_config(FULL)
    cfg = load_store_config(FULL)
    assert load_store_config(cfg) is cfg


@pytest.mark.parametrize("mutate,field", [
    (lambda d: d.update(colour="red"), "colour"),
    (lambda d: d["tiers"][0].update(sise="1Gi"), "sise"),
    (lambda d: d["tiers"][0].update(eviction="fifo"), "eviction"),
    (lambda d: d["tiers"][1].update(size="100 parsecs"), "size"),
    (lambda d: d["tiers"][1].pop("path"), "path"),
    (lambda d: d["tiers"][2].update(url="redis://:hunter2@host:6379"), "credentials"),
    (lambda d: d["tiers"][2].update(url="redis://admin@host:6379"), "credentials"),
    (lambda d: d["tiers"][2].update(url="rediss://host:6379/0?password=x"), "query key 'password'"),
    (lambda d: d["tiers"][2].update(url="redis://host:6379?Username=u"), "query key 'Username'"),
    (lambda d: d["tiers"][3].update(endpoint="http://key:secret@minio:9000"), "endpoint"),
    (lambda d: d["tiers"][2].update(url="http://host"), "url"),
    (lambda d: d["tiers"][3].update(type="gcs"), "gcs"),
    (lambda d: d.update(namespace="has space"), "namespace"),
    (lambda d: d.update(tiers=[]), "tiers"),
    (lambda d: d["tiers"][1].update(fsync="sometimes"), "fsync"),
])
def test_bad_input_names_the_field(mutate, field):
    data = json.loads(json.dumps(FULL))
    mutate(data)
    with pytest.raises(ValidationError) as e:
        load_store_config(data)
    assert field in str(e.value)


def test_duplicate_tier_names_rejected():
    data = {"tiers": [{"type": "disk", "path": "/a", "size": 1}, {"type": "disk", "path": "/b",
                                                                  "size": 1, "name": "disk"}]}
    with pytest.raises(ValidationError, match="unique"):
        load_store_config(data)


def test_subclass_adds_keys_and_reuses_loader():
    class ConnectorConfig(StoreConfig):
        chunk_tokens: int = 256

    cfg = load_store_config(dict(FULL, chunk_tokens=512), model=ConnectorConfig)
    assert isinstance(cfg, ConnectorConfig) and cfg.chunk_tokens == 512
    assert load_store_config(load_store_config(FULL), model=ConnectorConfig).chunk_tokens == 256
    with pytest.raises(ValidationError, match="chunk_tokenz"):
        load_store_config(dict(FULL, chunk_tokenz=1), model=ConnectorConfig)


def test_config_module_imports_without_heavy_dependencies():
    """The operator image has pydantic and pyyaml only."""
    code = ("import sys, kvpool_connector.config as c; c.load_store_config({'tiers': "
            "[{'type': 'cpu'}]}); bad = {'torch', 'redis', 'boto3', 'prometheus_client', "
            "'xxhash', 'numpy'} & set(sys.modules); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
