"""The store config the operator renders is accepted by the connector's own config model.

Loaded the way the engine loads it: `kv_connector_extra_config` from the rendered
`--kv-transfer-config`, with `config_file` pointing at the rendered ConfigMap content.
"""

from __future__ import annotations

import json

import pytest

from kvpool_connector.connector.config import load_connector_config
from kvpool_operator.render import render
from tests.operator.conftest import example_ids, load_example


def _engine_args(manifests):
    dep = next(m for m in manifests if m["kind"] == "Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    return json.loads(args[args.index("--kv-transfer-config") + 1])


@pytest.mark.parametrize("name", example_ids())
def test_rendered_store_config_validates_with_the_connector(name, settings, tmp_path):
    manifests = render(load_example(name), settings, "kvpool")
    data = next(m for m in manifests if m["kind"] == "ConfigMap")["data"]
    transfer_config = _engine_args(manifests)
    if "connector.yaml" not in data:
        assert transfer_config["kv_connector"] == "OffloadingConnector"
        assert "config_file" not in json.dumps(transfer_config)
        return
    path = tmp_path / "connector.yaml"
    path.write_text(data["connector.yaml"])
    if transfer_config["kv_connector"] == "KVPoolConnector":
        extra = {**transfer_config["kv_connector_extra_config"], "config_file": str(path)}
    else:  # native: kvpool's secondary tier entry carries the same config_file
        tier = next(t for t in transfer_config["kv_connector_extra_config"]["secondary_tiers"] if t["type"] == "kvpool")
        extra = {"config_file": str(path)}
        assert tier["module_path"] == "kvpool_connector.vllm_tiers"
    cfg = load_connector_config(extra)
    assert cfg.chunk_tokens == load_example(name)["spec"].get("chunkTokens", 256)
    rendered_types = [t.type for t in cfg.tiers]
    spec_tiers = load_example(name)["spec"]["tiers"]
    assert set(rendered_types) <= {"cpu", "disk", "redis", "s3"}
    assert ("redis" in rendered_types) == ("redis" in spec_tiers)
    assert ("s3" in rendered_types) == ("s3" in spec_tiers)


def test_native_kvpool_tier_class_is_importable_by_vllm():
    """vLLM resolves `{type: kvpool, module_path: ...}` with getattr(module, type)."""
    import importlib

    module = importlib.import_module("kvpool_connector.vllm_tiers")
    assert hasattr(module, "kvpool")


def _connector_yaml(example, settings, tmp_path):
    """The rendered connector.yaml's text and the connector's config loaded from it."""
    manifests = render(example, settings, "kvpool")
    text = next(m for m in manifests if m["kind"] == "ConfigMap")["data"]["connector.yaml"]
    path = tmp_path / "connector.yaml"
    path.write_text(text)
    return text, load_connector_config({"config_file": str(path)})


def test_save_decode_switch_reaches_the_connector(settings, tmp_path):
    """spec.saveDecode (default on) becomes the connector's save_decode_tokens."""
    for flag in (None, False):
        example = load_example("tiered-cpu-only")
        if flag is not None:
            example["spec"]["saveDecode"] = flag
        _, cfg = _connector_yaml(example, settings, tmp_path)
        assert cfg.save_decode_tokens is (flag is None)


def test_lookup_wait_reaches_the_connector_and_bad_values_name_the_field(settings, tmp_path):
    """spec.lookupWaitMs becomes the connector's lookup_wait_ms; unset, the connector's own
    default (5 ms); out of range, one error naming the field."""
    from kvpool_operator.models import format_error, parse_spec

    for value, expected in ((None, 5.0), (25, 25.0), (0, 0.0)):
        example = load_example("tiered-full")
        if value is not None:
            example["spec"]["lookupWaitMs"] = value
        text, cfg = _connector_yaml(example, settings, tmp_path)
        assert cfg.lookup_wait_ms == expected
        assert ("lookup_wait_ms" in text) is (value is not None)
    example = load_example("tiered-full")
    example["spec"]["lookupWaitMs"] = -1
    with pytest.raises(ValueError) as e:
        parse_spec(example["spec"])
    assert format_error(e.value).startswith("spec.lookupWaitMs: ")
