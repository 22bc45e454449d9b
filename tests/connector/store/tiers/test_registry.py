"""The tier contract: one abstract base, capability attributes, one registry that also
builds the config schema, so a tier defined outside the package (`dict_tier.py`, one
module and one `register_tier` call) is configured, validated and used like a built-in."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Literal

import pytest
import yaml

from kvpool_connector.config import (
    PositiveSize,
    StoreConfig,
    TierConfigBase,
    load_store_config,
    tier_config_models,
)
from kvpool_connector.connector.config import (
    ConnectorConfig,
    ConnectorConfigError,
    load_connector_config,
)
from kvpool_connector.store.format import Status, open_blob
from kvpool_connector.store.sealing import PoolKey
from kvpool_connector.store.tiers import (
    Tier,
    local_size,
    register_tier,
    registered_types,
    tier_class,
)
from tests.conftest import SECURITY
from tests.connector.store.helpers import build_store
from tests.connector.store.tiers.dict_tier import DictTier, DictTierConfig

BUILTIN = ("cpu", "disk", "redis", "s3")
DICT_MODULE = DictTier.__module__  # what an entry point names


def test_builtin_tiers_declare_their_capabilities():
    caps = {t: (tier_class(t).local, tier_class(t).remote, tier_class(t).shared,
                tier_class(t).hit_source, tier_class(t).process_memory) for t in BUILTIN}
    assert caps == {
        "cpu": (True, False, False, "host", True),
        "disk": (True, False, True, "disk", False),
        "redis": (False, True, True, "external_unspecified", False),
        "s3": (False, True, True, "external_unspecified", False),
    }
    assert all(issubclass(tier_class(t), Tier) and tier_class(t).type == t
               for t in registered_types())
    assert set(registered_types()) == set(tier_config_models())


def test_a_tier_must_implement_the_contract():
    class Half(Tier):
        def put_many(self, records):
            pass

    with pytest.raises(TypeError):
        Half(None, "ns", None)


def test_registry_refuses_unknown_and_duplicate_types():
    with pytest.raises(ValueError, match="unknown tier type 'tape'"):
        tier_class("tape")
    with pytest.raises(ValueError, match="already registered"):
        register_tier("dict", DictTier, DictTierConfig)


def test_a_registration_pairs_a_tier_with_a_config_model_of_its_type():
    class TapeConfig(TierConfigBase):
        type: Literal["tape"] = "tape"

    class MislabelledConfig(TierConfigBase):
        type: Literal["reel"] = "reel"

    with pytest.raises(ValueError, match=r'MislabelledConfig.type must be `Literal\["tape"\] = '
                                         r'"tape"`'):
        register_tier("tape", "tape_module:TapeTier", MislabelledConfig)
    with pytest.raises(TypeError, match="must subclass TierConfigBase"):
        register_tier("tape", "tape_module:TapeTier", dict)
    with pytest.raises(ValueError, match="not a Tier subclass whose `type` is 'tape'"):
        register_tier("tape", DictTier, TapeConfig)
    assert "tape" not in registered_types() and "tape" not in tier_config_models()
    with pytest.raises(ConnectorConfigError, match="does not match any of the expected tags"):
        load_connector_config({"tiers": [{"type": "tape"}]})


# -- an out-of-tree tier, end to end -----------------------------------------------------------


def test_an_out_of_tree_tier_is_configured_and_used_like_a_builtin(namespace):
    """From the normal config path (a dict, as a file or `kv_connector_extra_config` holds
    it) to a store that writes through a cpu tier into the dict tier, and another store
    (another engine of the pool) that reads it back from there."""
    cfg = load_store_config({"namespace": namespace, "security": SECURITY, "tiers": [
        {"type": "cpu", "size": "1Mi"}, {"type": "dict", "size": "1Mi"}]})
    assert isinstance(cfg.tiers[1], DictTierConfig) and cfg.tiers[1].size == 1 << 20
    keys = [os.urandom(32) for _ in range(4)]
    data = [os.urandom(10_000) for _ in keys]
    writer = build_store(namespace, {"type": "cpu", "size": "1Mi"},
                         {"type": "dict", "size": "1Mi"})
    try:
        assert writer.put_many(keys, data) == [True] * 4
        assert writer.flush(10)
        assert writer.stats()["tiers"]["dict"]["objects"] == 4
    finally:
        writer.close()
    reader = build_store(namespace, {"type": "dict", "size": "1Mi"})
    try:
        assert reader.contains_prefix(keys) == 4
        assert [bytes(v) for v in reader.get_many(keys)] == data
        outs = [bytearray(10_000) for _ in keys]
        assert reader.get_many_into(keys, outs) == [10_000] * 4
        assert [bytes(o) for o in outs] == data
        assert reader.stats()["tiers"]["dict"]["hits"] == 8
    finally:
        reader.close()


def test_an_out_of_tree_tier_gets_the_stores_checks(namespace):
    """Objects are sealed with the pool key before they reach the tier, and a tampered one
    is a miss (counted corrupt, removed), by the base class's checks alone."""
    key, payload = os.urandom(32), os.urandom(5000)
    store = build_store(namespace, {"type": "dict", "size": "1Mi"})
    try:
        assert store.put_many([key], [payload]) == [True]
        [name] = store.object_names([key])
        objects = DictTier.backends[namespace]
        sealed = objects[name]
        assert open_blob(sealed, name, store.layout, store.keyring.current)[0] is Status.OK
        assert open_blob(sealed, name, store.layout, PoolKey(os.urandom(32)))[0] is \
            Status.CORRUPT
        tampered = bytearray(sealed)
        tampered[-20] ^= 1
        objects[name] = bytes(tampered)
        assert store.get_many([key]) == [None]
        assert store.stats()["tiers"]["dict"]["corrupt"] == 1
        assert name not in objects
    finally:
        store.close()


def test_an_out_of_tree_tiers_config_errors_name_the_field():
    for tier, message in (
            ({"type": "dict", "size": "lots"},
             "kv_connector_extra_config.tiers.0.dict.size: Value error, invalid size 'lots'"),
            ({"type": "dict", "size": "1Mi", "bogus": 1},
             "kv_connector_extra_config.tiers.0.dict.bogus: Extra inputs are not permitted"),
            ({"type": "dict"}, "kv_connector_extra_config.tiers.0.dict.size: Field required")):
        with pytest.raises(ConnectorConfigError) as caught:
            load_connector_config({"tiers": [tier]})
        assert message in str(caught.value), caught.value
    with pytest.raises(ConnectorConfigError, match="expected tags: .*'dict'"):
        load_connector_config({"tiers": [{"type": "tape"}]})


def test_the_config_schema_lists_every_registered_tier():
    for model in (StoreConfig, ConnectorConfig):
        schema = model.model_json_schema()
        items = schema["properties"]["tiers"]["items"]
        assert items["discriminator"]["propertyName"] == "type"
        assert set(items["discriminator"]["mapping"]) == set(tier_config_models()) \
            >= {*BUILTIN, "dict"}
        assert schema["$defs"]["DictTierConfig"]["required"] == ["size"]
        assert schema["$defs"]["RedisTierConfig"]["properties"]["url"]["pattern"]


def test_a_config_dumps_each_tier_with_its_own_keys():
    cfg = load_connector_config({"tiers": [{"type": "dict", "size": "1Ki", "name": "d"},
                                           {"type": "cpu", "size": "1Mi"}]})
    dumped = cfg.model_dump(mode="json", exclude_unset=True)
    assert dumped["tiers"] == [{"type": "dict", "size": 1024, "name": "d"},
                               {"type": "cpu", "size": 1 << 20}]
    assert ConnectorConfig.model_validate(dumped) == cfg
    assert cfg.as_store_config().tiers == cfg.tiers


def test_kvpool_validate_checks_a_config_naming_an_out_of_tree_tier(tmp_path, capsys):
    from kvpool_cli.validate import main

    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(yaml.safe_dump({"namespace": "n", "security": SECURITY,
                                    "tiers": [{"type": "dict", "size": "64Mi"}]}))
    bad.write_text(yaml.safe_dump({"namespace": "n", "tiers": [{"type": "dict", "size": 0}]}))
    assert main([str(good)]) == 0
    assert capsys.readouterr().out == f"{good}: connector config (dict): ok\n"
    assert main([str(bad)]) == 1
    assert "tiers.0.dict.size: Input should be greater than 0" in capsys.readouterr().out


def test_a_tier_package_is_found_through_its_entry_point(tmp_path, repo_root):
    """A fresh process (an engine, `kvpool validate`) imports a tier's module when a config
    names a type it does not know yet, if an installed distribution names that module in
    the `kvpool_connector.tiers` entry point group (here a real .dist-info on the path)."""
    site = tmp_path / "site"
    dist = site / "kvpool_dict_tier-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvpool-dict-tier\n"
                                   "Version: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[kvpool_connector.tiers]\ndict = {DICT_MODULE}\n")
    config = tmp_path / "connector.yaml"
    config.write_text(yaml.safe_dump({"namespace": "n", "security": SECURITY,
                                      "tiers": [{"type": "dict", "size": "1Mi"}]}))

    def validate(*path: str) -> subprocess.CompletedProcess:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [*path, str(repo_root), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]))
        return subprocess.run(
            [sys.executable, "-c", "import sys; from kvpool_cli.validate import main; "
             "sys.exit(main(sys.argv[1:]))", str(config)],
            env=env, capture_output=True, text=True, timeout=120)

    unknown = validate()
    assert unknown.returncode == 1, unknown.stderr
    assert "Input tag 'dict' found using 'type' does not match" in unknown.stdout
    found = validate(str(site))
    assert found.returncode == 0, found.stdout + found.stderr
    assert found.stdout == f"{config}: connector config (dict): ok\n"

    (dist / "entry_points.txt").write_text("[kvpool_connector.tiers]\ndict = no_such_module\n")
    broken = validate(str(site))  # a config error naming the tier and the plugin
    assert broken.returncode == 1 and not broken.stderr, broken.stderr
    assert ("kv_connector_extra_config.tiers.0: Value error, tier plugin 'dict' "
            "(no_such_module) cannot be loaded: ModuleNotFoundError") in broken.stdout


# -- a local tier of another package: capabilities, not type names --------------------------


class RamTierConfig(TierConfigBase):
    type: Literal["ram"] = "ram"
    size: PositiveSize


class RamTier(DictTier):
    """The engine's own memory, as another package might offer it (a dict stands in)."""

    type = "ram"
    local, remote, shared, process_memory = True, False, False, True


register_tier("ram", RamTier, RamTierConfig)


def test_a_local_tier_of_another_package_is_sized_and_warm_started_like_cpu():
    """Its config's size is what the connector reads of any local tier, and as the first
    tier in the engine's own memory it is a warm start target: the connector asks the tiers
    what they can do, never their type names."""
    cfg = load_connector_config({"tiers": [{"type": "ram", "size": "1Mi"},
                                           {"type": "redis", "url": "redis://h:6379"}],
                                 "warm_start": {"enabled": True}})
    assert cfg.warm_start.enabled
    assert [local_size(t) for t in cfg.tiers] == [1 << 20, 0]
    assert local_size(load_connector_config({"tiers": [
        {"type": "disk", "path": "/d", "size": "2Mi"}]}).tiers[0]) == 2 << 20
    # a shared first tier (disk) is not the engine's own memory
    with pytest.raises(ConnectorConfigError, match=r"warm_start: .*first tier in the engine's "
                                                   r"own memory \(cpu\); the tiers are "
                                                   r"\['disk', 'redis'\]"):
        load_connector_config({"tiers": [{"type": "disk", "path": "/d", "size": "1Mi"},
                                         {"type": "redis", "url": "redis://h:6379"}],
                               "warm_start": {"enabled": True}})


def test_a_local_tiers_config_must_declare_its_size():
    class SizelessConfig(TierConfigBase):
        type: Literal["sizeless"] = "sizeless"

    class SizelessTier(RamTier):
        type = "sizeless"

    with pytest.raises(ValueError, match="a local tier's config model needs a `size` field"):
        register_tier("sizeless", SizelessTier, SizelessConfig)
    assert "sizeless" not in registered_types() and "sizeless" not in tier_config_models()
