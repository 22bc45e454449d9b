"""The generated CRD: current on disk, valid apiextensions/v1, structural, documented, and its
validation (OpenAPI + CEL) agrees with the pydantic models on valid and invalid pools."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from hypothesis import example, given, settings as hsettings, strategies as st

from kvpool_connector.config import parse_size
from kvpool_dev.golden import GOLDEN_SETTINGS
from kvpool_operator import crd, models
from tests.operator.conftest import K8S_VERSION, example_ids, load_example
from tests.operator.schema_check import api_server_errors, crd_accepts, field_schema, pool_schema

REPO = Path(__file__).resolve().parents[2]


def test_committed_crd_is_current():
    path = REPO / "crds" / crd.CRD_FILENAME
    assert path.read_text() == crd.crd_yaml(), "crds/ is stale: run `make crds` and commit the result"


def test_crd_validates_as_apiextensions_v1():
    kubernetes_validate.validate(crd.build_crd(), K8S_VERSION, strict=True)


def _walk(schema: dict[str, Any], path: str = ""):
    yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if "items" in schema:
        yield from _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _walk(schema["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural_and_documented():
    for path, node in _walk(pool_schema()):
        assert not {"$ref", "anyOf", "oneOf", "allOf", "title", "$defs"} & set(node), path
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), f"{path}: no type"
        if path.startswith((".spec", ".status")) and not path.endswith(("[]", "{}")):
            assert node.get("description"), f"{path}: no description (kubectl explain would be empty)"
        if node.get("additionalProperties") is not None:
            assert isinstance(node["additionalProperties"], dict), path
        if node.get("type") == "string" and "x-kubernetes-validations" in node:
            assert "maxLength" in node, f"{path}: CEL on an unbounded string exceeds the cost budget"


def test_crd_names_columns_and_subresources():
    spec = crd.build_crd()["spec"]
    assert spec["names"]["shortNames"] == ["kvp"] and spec["scope"] == "Namespaced"
    version = spec["versions"][0]
    columns = version["additionalPrinterColumns"]
    assert [c["name"] for c in columns if not c.get("priority")] == ["Mode", "Desired", "Ready", "Phase", "Age"]
    # desired from status: spec.replicas, or what the autoscaler chose when spec.autoscaling is set
    assert columns[1]["jsonPath"] == ".status.desiredReplicas"
    # -o wide adds the prefill role's, on paths the schema has: desired from status too (its
    # replicas, or its autoscaler's choice)
    assert [(c["name"], c["jsonPath"]) for c in columns if c.get("priority") == 1] == [
        ("Prefill", ".status.roles.prefill.desiredReplicas"),
        ("Prefill-Ready", ".status.roles.prefill.readyReplicas")]
    schema = version["schema"]["openAPIV3Schema"]["properties"]
    role = schema["status"]["properties"]["roles"]["properties"]["prefill"]["properties"]
    assert role["desiredReplicas"]["type"] == role["readyReplicas"]["type"] == "integer"
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    props = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert props["connector"]["enum"] == ["tiered", "native"] and props["connector"]["default"] == "tiered"
    assert props["tiers"]["properties"]["cpu"]["properties"]["evictionPolicy"]["enum"] == ["lru", "arc"]
    assert props["service"]["default"] == {}  # so service.port's default 8000 applies when omitted


@pytest.mark.parametrize("name", example_ids())
def test_examples_pass_the_api_server_checks(name):
    assert api_server_errors(load_example(name)) == []


def _mutate(pool: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(pool)
    *parents, last = path.split(".")
    node = out
    for p in parents:
        node = node.setdefault(p, {})
    if value is _DELETE:
        node.pop(last, None)
    else:
        node[last] = value
    return out


class _Delete:
    """Sentinel for "remove the field"; a stable repr keeps test ids the same in every
    process (pytest-xdist workers must collect identical ids)."""

    def __repr__(self) -> str:
        return "DELETE"


_DELETE = _Delete()

INVALID = [
    # (example, path, value, what both the API server and pydantic say: one message, or
    # (the API server's, pydantic's) where the API server's own schema check words it)
    ("tiered-full", "spec.tiers.disk.volume.emptyDir", {}, "exactly one of hostPath"),
    ("tiered-full", "spec.tiers.disk.volume.hostPath", _DELETE, "exactly one of hostPath"),
    ("tiered-full", "spec.tiers.redis.external", {"url": "redis://r:6379"}, "exactly one of managed, external"),
    ("tiered-full", "spec.tiers.s3.managed", _DELETE, "exactly one of managed, external"),
    ("tiered-full", "spec.tiers.cpu.size", "0Gi", "must be a positive size"),
    ("tiered-full", "spec.tiers.cpu.size", "lots", (f"does not match {models.SIZE_PATTERN!r}", models.SIZE_MESSAGE)),
    # fractions of a byte: parse_size refuses them, so the CRD and the models do too
    ("tiered-full", "spec.tiers.cpu.size", "1.5", "must be a whole number of bytes"),
    ("tiered-full", "spec.model.shmSize", "0.3Ki", "must be a whole number of bytes"),
    (
        "tiered-full",
        "spec.tiers.disk.size",
        "1.0000001k",
        (f"does not match {models.SIZE_PATTERN!r}", models.SIZE_MESSAGE),
    ),
    ("tiered-full", "spec.tiers", {}, "at least one tier"),
    ("tiered-full", "spec.chunkTokens", 100, "multiple of 16"),
    (
        "tiered-full",
        "spec.connector",
        "lmcache",
        ("is not one of ['tiered', 'native']", "Input should be 'tiered' or 'native'"),
    ),
    ("tiered-full", "spec.model.tensorParallelSize", 2, "tensorParallelSize must not exceed gpus"),
    ("native-cpu", "spec.tiers.cpu", _DELETE, "at least one tier"),
    ("native-shared", "spec.tiers.cpu", _DELETE, "native mode needs tiers.cpu"),
    ("native-shared", "spec.native", {"kvpoolSecondaryTier": False}, "only through the kvpool secondary tier"),
    # vLLM's fs tier (no key, follows links, loads any file) only on a volume no one else writes
    ("native-nvme", "spec.native", {"kvpoolSecondaryTier": False}, "only a per-pod volume (emptyDir, ephemeral)"),
    ("tiered-full", "metadata.name", "x" * 60, "at most 57 characters"),
    ("native-shared", "spec.security", {"requireCacheSalt": True}, "requireCacheSalt needs connector: tiered"),
    ("tiered-full", "spec.tiers.disk.volume.hostPath.path", "/mnt/nvme0/../../etc", "must be a normal absolute path"),
    ("tiered-full", "spec.tiers.disk.volume.hostPath.path", "/mnt//nvme0", "must be a normal absolute path"),
    (
        "tiered-full",
        "spec.model.image",
        "vllm@latest",
        (
            f"does not match {models.OPTIONAL_IMAGE_PATTERN!r}",
            f"String should match pattern '{models.OPTIONAL_IMAGE_PATTERN}'",
        ),
    ),
    ("tiered-full", "spec.model.extraArgs", ["--api-key=sk-123"], "must not pass --api-key, --hf-token or --config"),
    ("tiered-full", "spec.model.extraArgs", ["--hf-token", "hf_x"], "must not pass --api-key, --hf-token or --config"),
    # vLLM reads `_` as `-` and a flag's unambiguous prefix as the flag (test_secret_args.py)
    ("tiered-full", "spec.model.extraArgs", ["--api_key=sk-1"], "must not pass --api-key, --hf-token or --config"),
    ("tiered-full", "spec.model.extraArgs", ["--api-ke", "sk-1"], "must not pass --api-key, --hf-token or --config"),
    ("tiered-full", "spec.model.extraArgs", ["--hf_tok=hf_x"], "must not pass --api-key, --hf-token or --config"),
    ("tiered-full", "spec.model.extraArgs", ["--config", "/m/a"], "must not pass --api-key, --hf-token or --config"),
    ("tiered-external", "spec.tiers.redis.external.url", "redis://:pw@r:6379/0", "must not contain credentials"),
    ("tiered-external", "spec.tiers.redis.external.url", "rediss://kv@r:6380/0", "must not contain credentials"),
    ("tiered-external", "spec.tiers.redis.external.url", "redis://r/0?PASSWORD=pw", "no query but db=<n>"),
    ("tiered-external", "spec.tiers.redis.external.url", "redis://r/0?%70assword=pw", "no query but db=<n>"),
    # redis-py passes every query key to the connection: this one would turn TLS verification off
    ("tiered-external", "spec.tiers.redis.external.url", "rediss://r/0?ssl_cert_reqs=none", "no query but db=<n>"),
    ("tiered-external", "spec.tiers.redis.external.url", "redis://r/0#pw", "no fragment"),
    ("tiered-external", "spec.tiers.s3.external.endpoint", "https://ak:sk@s3.example", "must not contain credentials"),
    ("tiered-external", "spec.tiers.s3.external.endpoint", "https://s3.example?username=u", "no query"),
    # spec.prefill: the handover needs a tier both roles reach, in either mode, and the router
    ("tiered-emptydir", "spec.prefill", {"replicas": 1}, "needs a tier both roles reach"),
    ("native-cpu", "spec.prefill", {}, "in native mode needs a shared tier through kvpool's secondary tier"),
    ("native-shared", "spec.prefill", {}, "needs router"),
    ("tiered-pd", "spec.prefill.extraArgs", ["--api_k=sk-123"], "must not pass --api-key, --hf-token or --config"),
    ("tiered-pd", "spec.prefill.replicas", 0, ("is less than the minimum of 1",
                                                "Input should be greater than or equal to 1")),
    # autoscaling: a range, at least one trigger, zero engines only where a shared tier keeps the cache
    ("tiered-autoscaling", "spec.autoscaling.minReplicas", 9, "minReplicas must not exceed maxReplicas"),
    ("tiered-autoscaling", "spec.autoscaling.triggers", {}, "at least one trigger is required"),
    ("tiered-keda", "spec.tiers.s3", _DELETE, "scale to zero) needs a shared tier"),
    ("tiered-keda", "spec.autoscaling.triggers.kvCacheUsage", 0,
     ("less than the minimum of 0.001", "greater than or equal to 0.001")),
    ("tiered-keda", "spec.autoscaling.triggers.kvCacheUsage", 1.5,
     ("greater than the maximum of 1", "less than or equal to 1")),
    ("tiered-keda", "spec.autoscaling.rateWindow", "2 minutes", ("does not match", "should match pattern")),
    # each P/D role's own autoscaler: the same rules at spec.prefill.autoscaling; the router trigger needs one
    ("tiered-pd-keda", "spec.prefill.autoscaling.minReplicas", 5, "minReplicas must not exceed maxReplicas"),
    ("tiered-pd-keda", "spec.prefill.autoscaling.triggers", {}, "at least one trigger is required"),
    ("tiered-keda", "spec.autoscaling.triggers.routerRequests", 2, "triggers.routerRequests needs spec.router"),
    # warm start: loads the hot set from a shared tier into the tiered connector's cpu tier
    ("tiered-emptydir", "spec.warmStart", {}, "warmStart needs connector: tiered, tiers.cpu and a shared tier"),
    ("native-shared", "spec.warmStart", {}, "warmStart needs connector: tiered, tiers.cpu and a shared tier"),
    ("tiered-keda", "spec.warmStart.maxSeconds", 601,
     ("greater than the maximum of 600", "less than or equal to 600")),
    ("tiered-keda", "spec.warmStart.maxBytes", "lots", ("does not match", "must be a size")),
    # native mode's kvpool tier keys LoRA adapters by name and path: refused (the engine too)
    ("native-shared", "spec.model.extraArgs", ["--enable-lora"], "refuses --enable-lora"),
    ("native-nvme", "spec.model.extraArgs", ["--enable_lora=true"], "refuses --enable-lora"),
]


@pytest.mark.parametrize("example,path,value,message", INVALID, ids=lambda v: str(v)[:30])
def test_invalid_pools_are_rejected_by_api_server_and_models_alike(example, path, value, message):
    from kvpool_operator.render import InvalidPool, load_pool

    api_message, model_message = (message, message) if isinstance(message, str) else message
    pool = _mutate(load_example(example), path, value)
    errors = api_server_errors(pool)
    assert errors, f"the CRD accepts {path}={value!r}"
    assert any(api_message in e for e in errors), errors
    with pytest.raises(InvalidPool) as exc:
        load_pool(pool, GOLDEN_SETTINGS)
    assert model_message in str(exc.value)
    location = str(exc.value).split(":")[0]
    assert path.startswith(location), exc.value  # names the field, or the object whose rule it breaks


def test_valid_variations_pass_both():
    from kvpool_operator.render import load_pool

    variations = [
        ("native-nvme", "spec.tiers.disk.volume", {"emptyDir": {"medium": "Memory"}}),
        ("tiered-full", "spec.tiers.redis", {"external": {"url": "rediss://r.example:6380/1"}}),
        ("tiered-full", "spec.tiers.redis", {"external": {"url": "rediss://r:6380?db=1", "username": "kvpool-engine"}}),
        ("tiered-full", "spec.tiers.redis", {"external": {"url": "redis://[fd00::1]:6379/0"}}),
        ("tiered-external", "spec.tiers.s3.external.endpoint", "https://s3.example/path@v2"),
        ("tiered-full", "spec.model.gpus", 0),
        ("tiered-full", "spec.tiers.cpu.size", "1.5Gi"),
        ("tiered-full", "spec.replicas", 0),
        ("tiered-router", "spec.prefill", {"replicas": 2}),  # a Redis Cluster both roles reach
        ("tiered-autoscaling", "spec.autoscaling.minReplicas", 8),
        ("tiered-autoscaling", "spec.autoscaling.triggers", {"promptTokensComputed": 0.5}),
        ("tiered-keda", "spec.autoscaling.triggers.kvCacheUsage", 1),
        ("tiered-full", "spec.warmStart", {"maxBytes": "1Gi", "topK": 100}),
        ("tiered-full", "spec.model.extraArgs", ["--api-server-count", "2", "--hf-config-path=/m", "--config-format",
                                                 "hf", "--compilation-config", "{}"]),
        ("tiered-full", "spec.model.extraArgs", ["--enable-lora"]),  # KVPoolConnector keys adapters by their files
        ("native-cpu", "spec.model.extraArgs", ["--enable-lora"]),  # vLLM's host tier alone: per engine
    ]
    for name, path, value in variations:
        pool = _mutate(load_example(name), path, value)
        assert api_server_errors(pool) == [], (path, value)
        load_pool(pool, GOLDEN_SETTINGS)


def test_prefill_accepts_a_disk_on_a_shared_claim_and_native_with_a_shared_secondary_tier():
    """The tiers both roles reach, besides Redis (tiered-pd, tiered-router): a disk on a claim every
    pod mounts; in native mode through kvpool's secondary tier (native-shared has Redis)."""
    from kvpool_operator.render import load_pool

    for name in ("tiered-cpu-only", "native-shared"):
        pool = _mutate(_mutate(load_example(name), "spec.router", {}), "spec.prefill", {"replicas": 1})
        assert api_server_errors(pool) == [], name
        load_pool(pool, GOLDEN_SETTINGS)


SIZE_SCHEMA = field_schema("tiers", "cpu", "size")


def parse_size_reads(size: str) -> bool:
    """A size in the CRD's spelling that the connector's parser reads as a positive whole number of bytes."""
    if not re.fullmatch(models.SIZE_PATTERN, size):
        return False
    try:
        return parse_size(size) > 0
    except ValueError:
        return False


SIZES = st.one_of(
    st.from_regex(models.SIZE_PATTERN, fullmatch=True),
    st.from_regex(r"^[0-9]{1,3}([.][0-9]{1,12})?(Ki|Mi|Gi|k|M|b|m|gi| Gi)?$", fullmatch=True),  # beyond the grammar
    st.text(max_size=8),
)


@hsettings(max_examples=600, deadline=None)
@given(SIZES)
@example("1.5")
@example("0.3Ki")
@example("1.0000001k")
@example("0" * 32 + "1")  # longer than the CRD allows: refused by both
@example("1.5Gi")
@example("0.125Ki")
@example("0.001k")
@example("1.000")
@example("0.000Ki")
@example("4gi")
@example(" 2 Mi ")
@example("1\n")  # Python's `$` matches before a final newline, RE2's (the CRD's) does not
def test_the_crd_accepts_exactly_the_sizes_parse_size_reads_as_whole_bytes(size):
    """One size parser: the CRD (pattern + CEL), the models and the connector's parse_size agree
    on every size in the CRD's spelling, and refuse the rest alike."""
    expected = parse_size_reads(size)
    assert crd_accepts(SIZE_SCHEMA, size) == expected, size
    try:
        models.CpuTier(size=size)
        model = True
    except ValueError:
        model = False
    assert model == expected, size


# What may follow a backslash in a CEL string literal (cel-spec langdef, "String and Bytes Values");
# anything else, such as the `\.` of a regex, fails to compile and the API server refuses the CRD.
CEL_ESCAPES = set("?\"'`abfnrtvuUxX01234567")  # and a backslash: `\\` pairs are dropped before the check


def test_every_cel_rule_uses_only_valid_cel_escapes():
    for path, node in _walk(pool_schema()):
        for rule in node.get("x-kubernetes-validations", []):
            escapes = re.findall(r"\\(.)", rule["rule"].replace("\\\\", ""))
            assert set(escapes) <= CEL_ESCAPES, f"{path}: {rule['rule']}"


def test_status_schema_accepts_computed_status():
    from kvpool_operator.status import Observation, compute_status

    status = compute_status(Observation(generation=3, desired_replicas=2, selector="a=b"), "2026-01-01T00:00:00Z")
    pool = {**load_example("tiered-full"), "status": status}
    assert api_server_errors(pool) == []
    models.KVCachePoolStatus.model_validate(status)
    assert yaml.safe_dump(status)
