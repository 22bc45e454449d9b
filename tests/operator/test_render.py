"""render(): golden files, Kubernetes schema validity, and the connector contract."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import yaml

from kvpool_connector.config import parse_size
from kvpool_dev.golden import examples, golden_text
from kvpool_operator import models
from kvpool_operator.render import InvalidPool, load_pool, render, render_pool
from kvpool_operator.render.common import CHECKSUM_ANNOTATION
from kvpool_operator.settings import Settings
from tests.operator.conftest import GOLDEN_DIR, REQUIRED_EXAMPLES, example_ids, load_example
from tests.operator.schema_check import validate_child
from tests.operator.secret_leaks import assert_no_secret_values

TIERED_KV_TRANSFER_CONFIG = (
    '{"kv_connector":"KVPoolConnector","kv_connector_module_path":"kvpool_connector.vllm",'
    '"kv_role":"kv_both","kv_load_failure_policy":"recompute",'
    '"kv_connector_extra_config":{"config_file":"/etc/kvpool/connector.yaml"}}'
)


def by_kind(manifests: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [m for m in manifests if m["kind"] == kind and (name is None or m["metadata"]["name"] == name)]
    assert len(found) == 1, f"{kind}/{name}: {[m['metadata']['name'] for m in found]}"
    return found[0]


def engines(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    """The engines' Deployment (a pool with a router has a second one)."""
    found = [m for m in manifests if m["kind"] == "Deployment"
             and m["metadata"]["labels"]["app.kubernetes.io/component"] == "engine"]
    assert len(found) == 1, [m["metadata"]["name"] for m in found]
    return found[0]


def engine(manifests):
    return engines(manifests)["spec"]["template"]["spec"]["containers"][0]


def kv_config(manifests) -> dict[str, Any]:
    args = engine(manifests)["args"]
    return json.loads(args[args.index("--kv-transfer-config") + 1])


def mounted_store_config(manifests) -> dict[str, Any]:
    cm = by_kind(manifests, "ConfigMap")
    return yaml.safe_load(cm["data"]["connector.yaml"])


def rendered(name: str, settings: Settings, namespace: str = "kvpool") -> list[dict[str, Any]]:
    return render(load_example(name), settings, namespace)


def test_required_examples_exist():
    assert set(REQUIRED_EXAMPLES) <= set(example_ids())


@pytest.mark.parametrize("example", examples(), ids=lambda p: p.stem)
def test_golden(example):
    golden = GOLDEN_DIR / example.name
    assert golden.exists(), f"missing {golden}: run `make golden` and review it"
    assert golden_text(example) == golden.read_text(), f"{golden} is stale: run `make golden` and review the diff"


@pytest.mark.parametrize("name", example_ids())
def test_every_manifest_validates_against_kubernetes_schema(name, settings):
    manifests = rendered(name, settings)
    assert manifests
    for manifest in manifests:
        validate_child(manifest)


def test_tiered_full_connector_contract(settings):
    m = rendered("tiered-full", settings)
    args = engine(m)["args"]
    assert args[args.index("--kv-transfer-config") + 1] == TIERED_KV_TRANSFER_CONFIG
    assert mounted_store_config(m) == {
        "namespace": "kvpool.tiered-full",
        "chunk_tokens": 256,
        "tiers": [
            {"type": "cpu", "size": 64 << 30, "eviction": "lru"},  # sizes in bytes: the model parsed them
            {"type": "disk", "path": "/var/lib/kvpool/disk", "size": 500 << 30},
            {"type": "redis", "url": "redis://tiered-full-redis.kvpool.svc:6379/0", "key_prefix": "kvpool:",
             "username": "kvpool-engine", "password_env": "KVPOOL_REDIS_PASSWORD"},
            {
                "type": "s3", "endpoint": "http://tiered-full-minio.kvpool.svc:9000", "bucket": "kvpool", "prefix": "",
                "region": "us-east-1", "access_key_env": "KVPOOL_S3_ACCESS_KEY",
                "secret_key_env": "KVPOOL_S3_SECRET_KEY", "path_style": True, "create_bucket": False,
            },
        ],
        "queue_bytes": 1 << 30,
        "security": {"key_env": "KVPOOL_POOL_KEY", "previous_key_env": "KVPOOL_POOL_KEY_PREVIOUS", "encrypt": False},
        "staging_bytes": 1 << 30,
        "require_cache_salt": False,
        "save_decode_tokens": True,
    }
    mounts = {v["mountPath"]: v["name"] for v in engine(m)["volumeMounts"]}
    assert mounts["/etc/kvpool"] == "kvpool-config" and mounts["/var/lib/kvpool/disk"] == "kv-disk"
    volumes = {v["name"]: v for v in engines(m)["spec"]["template"]["spec"]["volumes"]}
    assert volumes["kv-disk"]["hostPath"] == {"path": "/mnt/nvme0", "type": "Directory"}
    assert volumes["kvpool-config"]["configMap"]["name"] == "tiered-full-kvpool"
    kinds = sorted((x["kind"], x["metadata"]["name"]) for x in m)
    assert kinds == sorted(
        [
            ("Secret", "tiered-full-kvpool-keys"),
            ("Secret", "tiered-full-redis"),
            ("Secret", "tiered-full-minio"),
            ("ConfigMap", "tiered-full-kvpool"),
            ("StatefulSet", "tiered-full-redis"),
            ("Service", "tiered-full-redis"),
            ("StatefulSet", "tiered-full-minio"),
            ("Service", "tiered-full-minio"),
            ("NetworkPolicy", "tiered-full-backends"),
            ("Deployment", "tiered-full"),
            ("Service", "tiered-full"),
            ("PodDisruptionBudget", "tiered-full"),
        ]
    )


@pytest.mark.parametrize("name", example_ids())
def test_secrets_reach_the_engine_only_through_secret_key_refs(name, settings):
    m = rendered(name, settings)
    env = engine(m)["env"]
    for var in env:
        if var["name"].startswith("KVPOOL_"):
            assert set(var) == {"name", "valueFrom"} and "secretKeyRef" in var["valueFrom"]
    for manifest in m:
        if manifest["kind"] == "Secret":
            assert "data" not in manifest and "stringData" not in manifest  # values are generated at apply
    blob = json.dumps([engine(m)["args"], by_kind(m, "ConfigMap")["data"]])
    assert "password" not in blob.replace("password_env", "")


def test_external_backends_use_the_users_secrets(settings):
    m = rendered("tiered-external", settings)
    refs = {v["name"]: v["valueFrom"]["secretKeyRef"] for v in engine(m)["env"] if "valueFrom" in v}
    assert refs == {
        "PYTHONHASHSEED": {"name": "tiered-external-kvpool-keys", "key": "hashSeed"},
        "KVPOOL_POOL_KEY": {"name": "tiered-external-kvpool-keys", "key": "poolKey"},
        "KVPOOL_POOL_KEY_PREVIOUS": {"name": "tiered-external-kvpool-keys", "key": "previousPoolKey", "optional": True},
        "KVPOOL_REDIS_PASSWORD": {"name": "redis", "key": "password"},
        "KVPOOL_S3_ACCESS_KEY": {"name": "s3-creds", "key": "accessKey"},
        "KVPOOL_S3_SECRET_KEY": {"name": "s3-creds", "key": "secretKey"},
    }
    tiers = {t["type"]: t for t in mounted_store_config(m)["tiers"]}
    assert tiers["redis"]["url"] == "redis://redis.infra.svc:6379/0"
    assert tiers["s3"]["bucket"] == "kv-cache-prod" and tiers["s3"]["create_bucket"] is False
    # TP=4: the per-pod CPU tier is split across ranks so the pod never pins more than asked for
    assert tiers["cpu"]["size"] == 128 * 2**30 // 4
    assert not [x for x in m if x["kind"] == "StatefulSet"]
    assert [x["metadata"]["name"] for x in m if x["kind"] == "Secret"] == ["tiered-external-kvpool-keys"]
    assert "initContainers" not in engines(m)["spec"]["template"]["spec"]
    assert engine(m)["resources"]["limits"]["nvidia.com/gpu"] == 4


def test_emptydir_disk_reserves_ephemeral_storage(settings):
    m = rendered("tiered-emptydir", settings)
    assert engine(m)["resources"]["requests"]["ephemeral-storage"] == "100Gi"
    volumes = {v["name"]: v for v in engines(m)["spec"]["template"]["spec"]["volumes"]}
    assert volumes["kv-disk"]["emptyDir"] == {"sizeLimit": "100Gi"}
    assert not [x for x in m if x["kind"] == "PodDisruptionBudget"]  # one replica: no PDB


def test_native_cpu_uses_vllm_offloading_connector_with_kvpools_spec(settings):
    cfg = kv_config(rendered("native-cpu", settings))
    assert cfg == {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 32 * 2**30, "eviction_policy": "lru", "block_size": 256,
                                      "spec_name": "KVPoolOffloadingSpec",
                                      "spec_module_path": "kvpool_connector.native", "offload_worker": "auto"},
    }


@pytest.mark.parametrize("worker", ["auto", "kvpool", "vllm"])
@pytest.mark.parametrize("name", ["native-cpu", "native-nvme", "native-shared"])
def test_native_offload_worker_setting(settings, name, worker):
    """auto/kvpool: kvpool's spec (vLLM's tiering spec, CPU-platform worker); vllm: vLLM's stock
    spec, exactly what vLLM documents (no kvpool code for cpu and fs tiers)."""
    pool = load_example(name)
    pool["spec"].setdefault("native", {})["offloadWorker"] = worker
    extra = kv_config(render(pool, settings, "kvpool"))["kv_connector_extra_config"]
    secondary = extra.get("secondary_tiers")
    if worker == "vllm":
        assert "spec_module_path" not in extra and "offload_worker" not in extra
        assert extra.get("spec_name") == ("TieringOffloadingSpec" if secondary else None)
    else:
        assert (extra["spec_name"], extra["spec_module_path"], extra["offload_worker"]) == (
            "KVPoolOffloadingSpec", "kvpool_connector.native", worker)
    assert (secondary is None) == (name == "native-cpu")


def test_kvpool_offloading_spec_is_what_vllm_loads():
    """vLLM's factory imports spec_module_path and takes spec_name from it: that must be kvpool's
    subclass of TieringOffloadingSpec, and every offloadWorker value one it accepts."""
    import importlib
    from pathlib import Path

    import vllm
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    from kvpool_connector.native import spec as native_spec
    from kvpool_operator.render.connector import KVPOOL_NATIVE_MODULE, KVPOOL_OFFLOADING_SPEC

    factory = (Path(vllm.__file__).parent / "v1/kv_offload/factory.py").read_text()
    assert '"spec_module_path"' in factory
    cls = getattr(importlib.import_module(KVPOOL_NATIVE_MODULE), KVPOOL_OFFLOADING_SPEC)
    assert issubclass(cls, TieringOffloadingSpec)
    values = models.NativeOptions.model_fields["offload_worker"].annotation.__args__
    assert set(values) == set(native_spec.WORKER_CHOICES) and native_spec.WORKER_KEY == "offload_worker"


KVPOOL_TIER = {
    "type": "kvpool",
    "module_path": "kvpool_connector.vllm_tiers",
    "config_file": "/etc/kvpool/connector.yaml",
}


def test_native_disk_is_kvpools_sealed_tier_keyed_by_the_pool_key(settings):
    """A native pool's disk tier is kvpool's store (every object authenticated with the pool key,
    read without following links), never vLLM's fs tier, which loads whatever file it finds."""
    m = rendered("native-nvme", settings)
    extra = kv_config(m)["kv_connector_extra_config"]
    assert extra["spec_name"] == "KVPoolOffloadingSpec"  # vLLM's TieringOffloadingSpec, CPU-capable worker
    assert extra["eviction_policy"] == "arc"
    assert extra["secondary_tiers"] == [KVPOOL_TIER]
    store = mounted_store_config(m)
    assert store["tiers"] == [{"type": "disk", "path": "/var/lib/kvpool/disk", "size": 500 << 30}]
    assert store["security"]["key_env"] == "KVPOOL_POOL_KEY"
    assert {"name": "KVPOOL_POOL_KEY", "valueFrom": {"secretKeyRef": {"name": "native-nvme-kvpool-keys",
                                                                       "key": "poolKey"}}} in engine(m)["env"]


def test_native_fs_tier_only_without_kvpool_tier_and_only_on_a_per_pod_volume(settings):
    """Opting out of kvpool's secondary tier leaves the disk tier to vLLM's unauthenticated fs
    tier: allowed on an emptyDir or ephemeral volume only (nobody else writes there), plaintext."""
    pool = load_example("native-nvme")
    pool["spec"]["native"] = {"kvpoolSecondaryTier": False}
    for volume in ({"hostPath": {"path": "/mnt/nvme0/kvpool"}}, {"persistentVolumeClaim": {"claimName": "kv"}}):
        pool["spec"]["tiers"]["disk"]["volume"] = volume
        with pytest.raises(InvalidPool, match="only a per-pod volume"):
            render(pool, settings, "kvpool")
    pool["spec"]["tiers"]["disk"]["volume"] = {"emptyDir": {}}
    m = render(pool, settings, "kvpool")
    assert kv_config(m)["kv_connector_extra_config"]["secondary_tiers"] == [
        {"type": "fs", "root_dir": "/var/lib/kvpool/disk"}]
    assert "connector.yaml" not in by_kind(m, "ConfigMap")["data"]
    pool["spec"]["security"] = {"encryption": True}
    with pytest.raises(InvalidPool, match="writes the disk tier in plaintext"):
        render(pool, settings, "kvpool")


def test_native_shared_reaches_disk_and_redis_through_kvpool_secondary_tier(settings):
    m = rendered("native-shared", settings)
    assert kv_config(m)["kv_connector_extra_config"]["secondary_tiers"] == [KVPOOL_TIER]
    assert [t["type"] for t in mounted_store_config(m)["tiers"]] == ["disk", "redis"]


def test_native_extra_config_keys_are_the_ones_vllm_reads():
    """The keys we render are read by vLLM 0.32's offloading spec and connector config."""
    from pathlib import Path

    import vllm

    root = Path(vllm.__file__).parent
    spec = (root / "v1/kv_offload/tiering/spec.py").read_text()
    cpu = (root / "v1/kv_offload/cpu/spec.py").read_text()
    factory = (root / "v1/kv_offload/factory.py").read_text()
    connector_cfg = (root / "distributed/kv_transfer/kv_connector/v1/offloading/config.py").read_text()
    fs = (root / "v1/kv_offload/tiering/fs/manager.py").read_text()
    assert '"cpu_bytes_to_use"' in cpu and '"eviction_policy"' in cpu
    assert '"spec_name"' in factory and '"secondary_tiers"' in spec
    assert 'extra_config.get("block_size")' in connector_cfg
    assert "root_dir: str" in fs
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    assert "TieringOffloadingSpec" in OffloadingSpecFactory._registry


def test_common_engine_properties(settings):
    for name in example_ids():
        m = rendered(name, settings)
        spec = load_example(name)["spec"]
        dep = engines(m)
        c = engine(m)
        # one random seed per pool, shared by its replicas (vLLM's prefix hashes), from its keys Secret
        assert {"name": "PYTHONHASHSEED",
                "valueFrom": {"secretKeyRef": {"name": f"{name}-kvpool-keys", "key": "hashSeed"}}} in c["env"]
        assert not [e for e in c["env"] if e["name"] == "PYTHONHASHSEED" and "value" in e]
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            assert c[probe]["httpGet"]["path"] == "/health"
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        labels = dep["spec"]["template"]["metadata"]["labels"]
        for key in ("name", "instance", "component", "managed-by", "part-of"):
            assert f"app.kubernetes.io/{key}" in labels
        assert len(dep["spec"]["template"]["metadata"]["annotations"][CHECKSUM_ANNOTATION]) == 64
        assert dep["spec"]["template"]["spec"]["enableServiceLinks"] is False
        pod = dep["spec"]["template"]["spec"]
        uid = pod["securityContext"]["runAsUser"]
        assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "fsGroup": 1000,
                                          "fsGroupChangePolicy": "OnRootMismatch",
                                          "seccompProfile": {"type": "RuntimeDefault"}}
        volumes = {v["name"]: v for v in pod["volumes"]}
        shm = 2 << 30 if spec.get("connector") != "native" else (2 << 30) + parse_size(spec["tiers"]["cpu"]["size"])
        assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": models.format_size(shm)}
        assert {"name": "HOME", "value": "/home/kvpool"} in c["env"]
        assert {"name": "home", "mountPath": "/home/kvpool"} in c["volumeMounts"]
        assert c["resources"]["requests"]["memory"] and c["resources"]["limits"]["memory"]


def test_engines_run_as_the_configured_non_root_user(settings):
    custom = settings.model_copy(
        update={"engine_uid_first": 4242, "engine_uid_count": 1, "engine_fs_group": 4444}
    )
    pod = engines(rendered("tiered-emptydir", custom))["spec"]["template"]["spec"]
    sc = pod["securityContext"]
    assert (sc["runAsNonRoot"], sc["runAsUser"], sc["runAsGroup"], sc["fsGroup"]) == (True, 4242, 4242, 4444)
    for container in pod["containers"] + pod.get("initContainers", []):
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_memory_covers_the_cpu_tier_shm_and_the_overhead(settings):
    # cpu 16Gi + disk write queue 1Gi + staging 1Gi + default shm 2Gi + overhead 8Gi
    m = rendered("tiered-emptydir", settings)
    assert engine(m)["resources"]["requests"]["memory"] == engine(m)["resources"]["limits"]["memory"] == "28Gi"
    assert mounted_store_config(m)["queue_bytes"] == mounted_store_config(m)["staging_bytes"] == 1 << 30
    pool = load_example("tiered-emptydir")
    pool["spec"]["model"] |= {"shmSize": "512Mi", "memoryOverhead": "1536Mi"}
    pool["spec"]["tiers"] = {"disk": pool["spec"]["tiers"]["disk"]}  # no CPU tier, no queue: staging + shm + overhead
    resources = engine(render(pool, settings, "kvpool"))["resources"]
    assert resources["requests"]["memory"] == resources["limits"]["memory"] == "3Gi"
    volumes = {v["name"]: v for v in engines(render(pool, settings, "kvpool"))["spec"]["template"]["spec"]["volumes"]}
    assert volumes["dshm"]["emptyDir"]["sizeLimit"] == "512Mi"
    # the user's resources still win (tiered-full raises the limit to 96Gi)
    full = engine(rendered("tiered-full", settings))["resources"]
    assert full["requests"]["memory"] == "78Gi" and full["limits"]["memory"] == "96Gi"  # 64 + 3 queues + 1 + 2 + 8
    # tensor parallelism: each rank's store gets its share of the same per-pod budget
    external = mounted_store_config(rendered("tiered-external", settings))  # TP=4
    assert external["queue_bytes"] == external["staging_bytes"] == 2**30 // 4
    native = engine(rendered("native-cpu", settings))["resources"]  # no kvpool store: cpu 32 + 2 + 8
    assert native["requests"]["memory"] == "42Gi"


@pytest.mark.parametrize(("name", "shared"), [("tiered-full", True), ("native-nvme", True), ("tiered-cpu-only", True),
                                              ("tiered-emptydir", False), ("native-shared", False)])
def test_shared_disk_volumes_show_each_pool_only_its_directory(name, shared, settings):
    mounts = {v["name"]: v for v in engine(rendered(name, settings))["volumeMounts"]}
    if shared:  # hostPath, PVC: other pools use the same directory tree
        assert mounts["kv-disk"]["subPath"] == f"kvpool.{name}"
    else:  # per-pod volumes
        assert "subPath" not in mounts["kv-disk"]


def test_config_change_changes_checksum_and_nothing_random(settings):
    pool = load_example("tiered-full")
    first = render(pool, settings)
    assert render(pool, settings) == first  # pure and deterministic
    pool["spec"]["tiers"]["cpu"]["size"] = "32Gi"
    second = render(pool, settings)

    def checksum(m):
        return engines(m)["spec"]["template"]["metadata"]["annotations"][CHECKSUM_ANNOTATION]

    assert checksum(first) != checksum(second)


def test_managed_redis_settings(settings):
    m = rendered("tiered-full", settings)
    redis = by_kind(m, "StatefulSet", "tiered-full-redis")["spec"]["template"]["spec"]["containers"][0]
    args = redis["args"]
    assert args[args.index("--maxmemory") + 1] == str(int(16 * 2**30 * 0.85))
    assert args[args.index("--maxmemory-policy") + 1] == "allkeys-lru"
    # no password in argv: no --requirepass, and no $(VAR) the kubelet would expand to a secret's value
    assert "--requirepass" not in args
    assert not [a for a in redis["command"] + args for e in redis["env"] if f"$({e['name']})" in a]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in redis["env"]}
    assert (
        env["REDIS_PASSWORD"]
        == env["REDISCLI_AUTH"]
        == {"secretKeyRef": {"name": "tiered-full-redis", "key": "password"}}
    )
    assert env["REDIS_ENGINE_PASSWORD"] == {"secretKeyRef": {"name": "tiered-full-redis", "key": "enginePassword"}}
    assert env["ENGINE_USER"] == "kvpool-engine"
    assert env["ENGINE_ACL"] == (
        "resetkeys ~kvpool:kvpool.tiered-full:* resetchannels -@all +set +getrange +exists +unlink "
        "+auth +hello +client|setinfo +ping +select"
    )
    assert redis["readinessProbe"]["exec"]["command"] == ["sh", "-c", "redis-cli -p 6379 ping | grep -q PONG"]
    volumes = {
        v["name"]: v for v in by_kind(m, "StatefulSet", "tiered-full-redis")["spec"]["template"]["spec"]["volumes"]
    }
    assert volumes["acl"]["emptyDir"]["medium"] == "Memory"  # password hashes never touch the node's disk
    engine_env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in engine(m)["env"] if "valueFrom" in e}
    assert engine_env["KVPOOL_REDIS_PASSWORD"] == {"name": "tiered-full-redis", "key": "enginePassword"}
    minio = by_kind(m, "StatefulSet", "tiered-full-minio")
    assert minio["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "1Ti"


def test_invalid_pool_names_the_field(settings):
    pool = load_example("tiered-full")
    pool["spec"]["tiers"]["disk"]["volume"]["emptyDir"] = {}
    with pytest.raises(InvalidPool, match=r"spec\.tiers\.disk\.volume: .*exactly one of hostPath"):
        render(pool, settings)
    pool = load_example("native-cpu")
    del pool["spec"]["tiers"]["cpu"]
    pool["spec"]["tiers"]["disk"] = {"size": "1Ti", "volume": {"emptyDir": {}}}
    with pytest.raises(InvalidPool, match="native mode needs tiers.cpu"):
        render(pool, settings)
    pool = load_example("native-cpu")
    pool["spec"]["tiers"]["cpu"]["sise"] = "1Gi"
    with pytest.raises(InvalidPool, match=r"spec\.tiers\.cpu\.sise: Extra inputs are not permitted"):
        render(pool, settings)


@pytest.mark.parametrize("size", ["1.5", "0.3Ki", "1.0000001k"])
def test_a_size_of_a_fraction_of_a_byte_is_an_invalid_pool_naming_the_field(settings, size):
    pool = load_example("tiered-full")
    pool["spec"]["tiers"]["cpu"]["size"] = size
    with pytest.raises(InvalidPool, match=r"^spec\.tiers\.cpu\.size: "):
        render(pool, settings)


def test_a_renderer_that_fails_raises_invalid_pool_naming_it(settings):
    """A spec the models let through but a renderer cannot build (here a size the connector's
    config refuses, set past validation) is an InvalidPool, never a bare exception."""
    pool = load_pool(load_example("tiered-full"), settings)
    tiers = pool.spec.tiers.model_copy(update={"cpu": pool.spec.tiers.cpu.model_copy(update={"size": "0.3Ki"})})
    broken = dataclasses.replace(pool, spec=pool.spec.model_copy(update={"tiers": tiers}))
    with pytest.raises(
        InvalidPool, match=r"^configmap: cannot render: size: .*0.3Ki.* is not a whole number of bytes$"
    ):
        render_pool(broken)


@pytest.mark.parametrize("name", example_ids())
def test_every_shared_store_is_keyed_by_the_pool_key(name, settings):
    """Wherever a kvpool store runs (tiered mode, native's kvpool tier) it gets the pool key by env."""
    m = rendered(name, settings)
    data = by_kind(m, "ConfigMap")["data"]
    env = {e["name"]: e for e in engine(m)["env"]}
    if "connector.yaml" not in data:
        assert "KVPOOL_POOL_KEY" not in env
        return
    assert mounted_store_config(m)["security"] == {
        "key_env": "KVPOOL_POOL_KEY",
        "previous_key_env": "KVPOOL_POOL_KEY_PREVIOUS",
        "encrypt": False,
    }
    assert env["KVPOOL_POOL_KEY"]["valueFrom"] == {"secretKeyRef": {"name": f"{name}-kvpool-keys", "key": "poolKey"}}
    assert env["KVPOOL_POOL_KEY_PREVIOUS"]["valueFrom"] == {
        "secretKeyRef": {"name": f"{name}-kvpool-keys", "key": "previousPoolKey", "optional": True}}
    keys = by_kind(m, "Secret", f"{name}-kvpool-keys")
    assert keys["metadata"]["annotations"]["kvpool.dev/generate-keys"] == "poolKey,hashSeed"


def test_security_options_and_a_users_keys_secret(settings):
    pool = load_example("tiered-full")
    pool["spec"]["security"] = {"keysSecretRef": {"name": "team-keys"}, "encryption": True, "requireCacheSalt": True}
    m = render(pool, settings, "kvpool")
    cfg = mounted_store_config(m)
    assert cfg["security"]["encrypt"] is True and cfg["require_cache_salt"] is True
    assert not [x for x in m if x["kind"] == "Secret" and x["metadata"]["name"].endswith("-kvpool-keys")]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in engine(m)["env"] if "valueFrom" in e}
    assert refs["PYTHONHASHSEED"] == {"name": "team-keys", "key": "hashSeed"}
    assert refs["KVPOOL_POOL_KEY"] == {"name": "team-keys", "key": "poolKey"}
    native = load_example("native-shared")
    native["spec"]["security"] = {"encryption": True}
    cfg = mounted_store_config(render(native, settings, "kvpool"))
    assert cfg["security"]["encrypt"] is True and "require_cache_salt" not in cfg  # a KVPoolConnector key


def test_backends_network_policy_is_on_by_default(settings):
    pool = load_example("native-shared")  # managed Redis, no networkPolicy in its spec
    assert "networkPolicy" not in pool["spec"]
    policy = by_kind(rendered("native-shared", settings), "NetworkPolicy", "native-shared-backends")
    assert policy["spec"]["podSelector"]["matchExpressions"][0]["values"] == ["redis"]
    assert policy["spec"]["ingress"][0]["from"] == [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/instance": "native-shared", "app.kubernetes.io/component": "engine",
        "kvpool.dev/pool": "native-shared"}}}]
    pool["spec"]["networkPolicy"] = {"enabled": False}
    assert not [m for m in render(pool, settings, "kvpool") if m["kind"] == "NetworkPolicy"]


def test_engine_ingress_policy_admits_only_the_listed_peers_to_the_api_port(settings):
    pool = load_example("tiered-emptydir")
    assert not [m for m in render(pool, settings, "kvpool") if m["kind"] == "NetworkPolicy"]  # opt-in
    gateway = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}
    pool["spec"]["networkPolicy"] = {"apiIngress": {"enabled": True, "from": [gateway]}}
    policy = by_kind(render(pool, settings, "kvpool"), "NetworkPolicy", "tiered-emptydir-engines")
    assert policy["spec"] == {
        "podSelector": {"matchLabels": {"app.kubernetes.io/instance": "tiered-emptydir",
                                        "app.kubernetes.io/component": "engine", "kvpool.dev/pool": "tiered-emptydir"}},
        "policyTypes": ["Ingress"],
        "ingress": [{"from": [gateway], "ports": [{"protocol": "TCP", "port": 8000}]}],
    }
    pool["spec"]["networkPolicy"] = {"apiIngress": {"enabled": True}}
    policy = by_kind(render(pool, settings, "kvpool"), "NetworkPolicy", "tiered-emptydir-engines")
    assert policy["spec"]["ingress"][0]["from"] == [{"podSelector": {}}]  # the pool's own namespace


def test_api_key_reaches_vllm_only_by_secret_key_ref(settings):
    from kvpool_operator.render import load_pool
    from kvpool_operator.render.secretrefs import referenced_secrets

    pool = load_example("tiered-emptydir")
    pool["spec"]["service"] = {"apiKeySecretRef": {"name": "llm-api", "key": "token"}}
    env = engine(render(pool, settings, "kvpool"))["env"]
    assert {"name": "VLLM_API_KEY", "valueFrom": {"secretKeyRef": {"name": "llm-api", "key": "token"}}} in env
    refs = [(r.field, r.name, r.key) for r in referenced_secrets(load_pool(pool, settings))]
    assert ("spec.service.apiKeySecretRef", "llm-api", "token") in refs  # checked before anything is applied


def test_managed_redis_tls(settings):
    pool = load_example("tiered-full")
    pool["spec"]["tiers"]["redis"]["managed"]["tls"] = {"secretName": "redis-tls"}
    m = render(pool, settings, "kvpool")
    sts = by_kind(m, "StatefulSet", "tiered-full-redis")["spec"]["template"]["spec"]
    args = sts["containers"][0]["args"]
    assert args[args.index("--port") + 1] == "0" and args[args.index("--tls-port") + 1] == "6379"
    assert args[args.index("--tls-ca-cert-file") + 1] == "/tls/ca.crt"
    assert "--tls --cacert /tls/ca.crt" in sts["containers"][0]["readinessProbe"]["exec"]["command"][2]
    assert {v["name"]: v for v in sts["volumes"]}["tls"]["secret"] == {"secretName": "redis-tls", "defaultMode": 0o440}
    tier = next(t for t in mounted_store_config(m)["tiers"] if t["type"] == "redis")
    assert tier["url"].startswith("rediss://tiered-full-redis.kvpool.svc:6379")
    assert tier["tls_ca_file"] == "/etc/kvpool-tls/redis/ca.crt"
    volumes = {v["name"]: v for v in engines(m)["spec"]["template"]["spec"]["volumes"]}
    assert volumes["redis-ca"]["secret"] == {"secretName": "redis-tls", "items": [{"key": "ca.crt", "path": "ca.crt"}]}
    for manifest in m:
        validate_child(manifest)


def test_external_redis_with_a_private_ca_and_acl_user(settings):
    pool = load_example("tiered-external")
    pool["spec"]["tiers"]["redis"]["external"] |= {"url": "rediss://redis.infra.svc:6380/0", "username": "kv",
                                                   "caSecretRef": {"name": "infra-ca", "key": "root.pem"}}
    m = render(pool, settings, "kvpool")
    tier = next(t for t in mounted_store_config(m)["tiers"] if t["type"] == "redis")
    assert tier["username"] == "kv" and tier["tls_ca_file"] == "/etc/kvpool-tls/redis/ca.crt"
    volumes = {v["name"]: v for v in engines(m)["spec"]["template"]["spec"]["volumes"]}
    assert volumes["redis-ca"]["secret"]["items"] == [{"key": "root.pem", "path": "ca.crt"}]


@pytest.mark.parametrize("name", example_ids())
def test_no_example_renders_a_secret_value(name, settings):
    """Not a value from a Secret (generated ones exist only at apply time) in any child or status."""
    pool = load_example(name)
    assert_no_secret_values(pool, render(pool, settings, "kvpool"), settings)


def test_a_truncated_store_namespace_keeps_a_64_bit_digest(settings):
    """Long namespace + name: a prefix and 16 hex digits of sha256 over the whole, so pools that
    share the prefix still get their own directory, Redis prefix and bucket prefix."""
    import hashlib

    from kvpool_operator.render.common import load_pool
    from kvpool_operator.render.connector import STORE_NAMESPACE_MAX, store_namespace

    namespace = "n" * 40
    names = [
        store_namespace(
            load_pool(
                {**load_example("tiered-emptydir"), "metadata": {"name": "pool-" + "x" * 30 + tail}},
                settings,
                namespace,
            )
        )
        for tail in ("a", "b")
    ]
    for name, tail in zip(names, ("a", "b"), strict=True):
        assert len(name) == STORE_NAMESPACE_MAX
        full = f"{namespace}.pool-{'x' * 30}{tail}"
        assert name == f"{full[:STORE_NAMESPACE_MAX - 17]}-{hashlib.sha256(full.encode()).hexdigest()[:16]}"
    assert names[0] != names[1] and names[0][:-16] == names[1][:-16]


def test_warm_start_renders_the_connector_keys_and_a_longer_startup_probe(settings):
    """spec.warmStart: the connector's warm_start keys (the byte budget per tensor-parallel rank,
    like the tiers), and a startup probe that allows the pre-warm's time on top of the model load:
    vLLM's /health answers only after it."""
    cold = load_example("tiered-keda")
    del cold["spec"]["warmStart"]
    cold_probe = engine(render(cold, settings, "kvpool"))["startupProbe"]
    assert "warm_start" not in mounted_store_config(render(cold, settings, "kvpool"))
    pool = load_example("tiered-keda")
    pool["spec"]["model"]["tensorParallelSize"] = 2
    pool["spec"]["model"]["gpus"] = 2
    pool["spec"]["warmStart"] = {"maxBytes": "8Gi", "maxSeconds": 95, "topK": 100, "refreshSeconds": 30}
    m = render(pool, settings, "kvpool")
    assert mounted_store_config(m)["warm_start"] == {
        "enabled": True, "refresh_seconds": 30.0, "top_k": 100, "max_bytes": 4 << 30, "max_seconds": 95.0}
    probe = engine(m)["startupProbe"]
    assert probe["periodSeconds"] * (probe["failureThreshold"] - cold_probe["failureThreshold"]) >= 95
