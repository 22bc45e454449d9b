"""Deployment `<name>`: the vLLM engines with the KV connector.

The pod template carries a checksum of the rendered connector config, so any config change rolls
the pods; PYTHONHASHSEED comes from the pool's keys Secret, the same random seed on every replica
of the pool (so their prefix hashes agree) and a different one in every other pool; service links
are off (Kubernetes would otherwise inject variables such as VLLM_PORT that vLLM reads as its own
settings).
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

from kvpool_operator import models
from kvpool_operator.render.autoscaling import replicas_field
from kvpool_operator.render.common import (
    CHECKSUM_ANNOTATION,
    CONFIG_DIR,
    DISK_PATH,
    HASH_SEED,
    HTTP_PORT,
    MINIO_PORT,
    REDIS_PORT,
    TLS_CA_DIR,
    Pool,
    checksum,
    merge,
    secret_env,
)
from kvpool_operator.render.configmap import config_data
from kvpool_operator.render.connector import (
    backend_ca,
    kv_transfer_config,
    secret_envs,
    store_namespace,
)
from kvpool_operator.render.memory import account
from kvpool_operator.render.roles import DECODE, role_labels

# Waits (bounded) for managed backends so engines do not start against a Redis/MinIO that is not up
# yet; after the deadline it starts anyway: the connector degrades to recompute, it never blocks.
WAIT_SCRIPT = """\
import socket, sys, time
deadline = time.monotonic() + int(sys.argv[1])
for target in sys.argv[2:]:
    host, port = target.rsplit(":", 1)
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
            print("reachable:", target, flush=True)
            break
        except OSError:
            time.sleep(2)
    else:
        print("not reachable, starting anyway:", target, flush=True)
"""

CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
# The vLLM image's HOME (/root) is not the engine user's: caches (Hugging Face, vLLM, Triton) go here.
HOME = "/home/kvpool"


def compact_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def memory(pool: Pool) -> str:
    """The engine's memory request and limit: everything it maps, counted once (memory.py)."""
    return models.format_size(account(pool).total)


def _resources(pool: Pool) -> dict[str, Any]:
    spec = pool.spec
    # request = limit: the scheduler reserves what the tiers pin, and a leak is OOM-killed in the
    # pod instead of pressuring the node (and its other pools' engines)
    requests: dict[str, Any] = {"memory": memory(pool)}
    limits: dict[str, Any] = {"memory": memory(pool)}
    if spec.model.gpus:
        limits["nvidia.com/gpu"] = spec.model.gpus
    disk = spec.tiers.disk
    if disk and disk.volume.empty_dir is not None and disk.volume.empty_dir.medium == "":
        requests["ephemeral-storage"] = disk.size  # reserve node disk so the kubelet never evicts us
    base = {k: v for k, v in (("requests", requests), ("limits", limits)) if v}
    return merge(base, spec.model.resources)


def _disk_volume(pool: Pool) -> dict[str, Any] | None:
    disk = pool.spec.tiers.disk
    if disk is None:
        return None
    source = disk.volume
    if source.host_path is not None:
        # Directory, not DirectoryOrCreate: a missing NVMe mount fails the pod instead of filling the
        # node's root disk through a directory the kubelet would create in its place
        return {"name": "kv-disk", "hostPath": {"path": source.host_path.path, "type": "Directory"}}
    if source.empty_dir is not None:
        empty: dict[str, Any] = {"sizeLimit": disk.size}
        if source.empty_dir.medium:
            empty["medium"] = source.empty_dir.medium
        return {"name": "kv-disk", "emptyDir": empty}
    if source.ephemeral is not None:
        claim: dict[str, Any] = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": disk.size}}}
        if source.ephemeral.storage_class_name:
            claim["storageClassName"] = source.ephemeral.storage_class_name
        return {
            "name": "kv-disk",
            "ephemeral": {"volumeClaimTemplate": {"metadata": {"labels": pool.labels("engine")}, "spec": claim}},
        }
    assert source.persistent_volume_claim is not None
    return {"name": "kv-disk", "persistentVolumeClaim": {"claimName": source.persistent_volume_claim.claim_name}}


def _model_volumes(pool: Pool) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(volume, mount) for the weights (always read-only: engines never write a model) and the
    Hugging Face cache (read-only with hfCache.readOnly)."""
    model = pool.spec.model
    out = []
    source = model.volume
    if source is not None:
        volume: dict[str, Any] = {"name": "model"}
        if source.persistent_volume_claim is not None:
            volume["persistentVolumeClaim"] = {"claimName": source.persistent_volume_claim.claim_name, "readOnly": True}
        elif source.host_path is not None:
            volume["hostPath"] = {"path": source.host_path.path, "type": "Directory"}
        else:
            assert source.image is not None
            image = {"reference": source.image.reference}
            if source.image.pull_policy:
                image["pullPolicy"] = source.image.pull_policy
            volume["image"] = image
        mount = {"name": "model", "mountPath": source.mount_path, "readOnly": True}
        if source.sub_path:
            mount["subPath"] = source.sub_path
        out.append((volume, mount))
    cache = model.hf_cache
    if cache is not None:
        claim: dict[str, Any] = {"claimName": cache.persistent_volume_claim.claim_name}
        if cache.read_only:
            claim["readOnly"] = True
        out.append(({"name": "hf-cache", "persistentVolumeClaim": claim},
                    {"name": "hf-cache", "mountPath": models.HF_CACHE_DIR, "readOnly": cache.read_only}))
    return out


def model_env(pool: Pool) -> list[dict[str, Any]]:
    """HF_HOME on the cache volume (offline when it is read-only) and HF_TOKEN from its Secret."""
    model = pool.spec.model
    env = []
    if model.hf_cache is not None:
        env.append({"name": "HF_HOME", "value": models.HF_CACHE_DIR})
        if model.hf_cache.read_only:
            env.append({"name": "HF_HUB_OFFLINE", "value": "1"})
    if model.hf_token_secret_ref is not None:
        ref = model.hf_token_secret_ref
        env.append(secret_env("HF_TOKEN", ref.name, ref.key))
    return env


def _ca_volumes(pool: Pool) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(volume, mount) per backend CA: only the ca.crt key of its Secret, never a private key."""
    out = []
    for tier in ("redis", "s3"):
        ref = backend_ca(pool, tier)
        if ref is None:
            continue
        name, key = ref
        volume = {"name": f"{tier}-ca", "secret": {"secretName": name, "items": [{"key": key, "path": "ca.crt"}]}}
        out.append((volume, {"name": f"{tier}-ca", "mountPath": f"{TLS_CA_DIR}/{tier}", "readOnly": True}))
    return out


def _wait_init(pool: Pool) -> list[dict[str, Any]]:
    targets = []
    if pool.managed_redis:
        targets.append(f"{pool.svc_host(pool.redis)}:{REDIS_PORT}")
    if pool.managed_s3:
        targets.append(f"{pool.svc_host(pool.minio)}:{MINIO_PORT}")
    if not targets:
        return []
    return [
        {
            "name": "wait-for-backends",
            "image": pool.spec.model.image or pool.settings.connector_image,
            "imagePullPolicy": pool.settings.image_pull_policy,
            "command": ["python3", "-c", WAIT_SCRIPT, str(pool.settings.backend_wait_seconds), *targets],
            "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}},
            "securityContext": CONTAINER_SECURITY,
        }
    ]


POD_NAME_ENV = "POD_NAME"  # downward API; the kubelet expands $(POD_NAME) in args


def kv_events_config(pool: Pool) -> dict[str, Any] | None:
    """vLLM's `--kv-events-config` (KVEventsConfig): a ZMQ publisher on every engine, one topic per
    pod so a subscriber knows whose cache an event describes."""
    events = pool.spec.kv_events
    if events is None or not events.enabled:
        return None
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events.port}",
            "topic": f"kv@$({POD_NAME_ENV})"}


def _fleet_args(pool: Pool) -> list[str]:
    """Flags the router and external routers need: cache_aware tokenizes each request through the
    engine's /v1/chat/completions/render (served with --enable-scale-out, behind the API key)."""
    args = []
    router = pool.spec.router
    if router is not None and router.policy == "cache_aware":
        args.append("--enable-scale-out")
    events = kv_events_config(pool)
    if events is not None:
        args += ["--kv-events-config", compact_json(events)]
    return args


def engine_args(pool: Pool) -> list[str]:
    """`vllm serve` arguments: the model, the port, the KV connector, the fleet flags, the user's."""
    model = pool.spec.model
    return [
        model.name,
        "--host", "0.0.0.0",
        "--port", str(HTTP_PORT),
        "--tensor-parallel-size", str(model.tensor_parallel_size),
        "--kv-transfer-config", compact_json(kv_transfer_config(pool)),
        *_fleet_args(pool),
        *model.extra_args,
    ]


def cpu_platform_env(pool: Pool) -> list[dict[str, Any]]:
    """`gpus: 0`: the paged KV cache's size in GiB (memory.py counts it). Unset, vLLM's CPU worker
    would take --gpu-memory-utilization (0.9) of the NUMA node's memory, far beyond the pod's limit."""
    if pool.spec.model.gpus:
        return []
    return [{"name": models.CPU_KV_CACHE_ENV, "value": str(pool.spec.model.cpu_kv_cache_gib)}]


def engine_env(pool: Pool) -> list[dict[str, Any]]:
    """The hash seed and API key from Secrets, HOME, the pod name (KV event topics), the backends'
    credentials, the model's (HF_HOME, HF_TOKEN), then the user's env."""
    api_key = pool.spec.service.api_key_secret_ref
    events = kv_events_config(pool) is not None
    return [
        secret_env("PYTHONHASHSEED", pool.keys_secret, HASH_SEED),
        {"name": "HOME", "value": HOME},
        *([{"name": POD_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}] if events else []),
        *([secret_env("VLLM_API_KEY", api_key.name, api_key.key)] if api_key else []),  # vLLM's --api-key
        *secret_envs(pool),
        *model_env(pool),
        *cpu_platform_env(pool),
        *pool.spec.model.env,
    ]


def engine_volumes(pool: Pool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, the container's mounts): the connector config, /dev/shm, HOME, the model's
    volume and Hugging Face cache, the disk tier and the backends' CAs."""
    mounts: list[dict[str, Any]] = [
        {"name": "kvpool-config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "home", "mountPath": HOME},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "kvpool-config", "configMap": {"name": pool.config_map}},
        # native mode: vLLM's host region is a file here, so /dev/shm holds it besides shmSize
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": models.format_size(account(pool).shm_bytes)}},
        {"name": "home", "emptyDir": {}},
    ]
    for volume, mount in _model_volumes(pool):
        volumes.append(volume)
        mounts.append(mount)
    disk = _disk_volume(pool)
    if disk is not None:
        volumes.append(disk)
        mount = {"name": "kv-disk", "mountPath": DISK_PATH}
        if "hostPath" in disk or "persistentVolumeClaim" in disk:
            mount["subPath"] = store_namespace(pool)  # shared beyond this pool: it sees only its own directory
        mounts.append(mount)
    for volume, mount in _ca_volumes(pool):
        volumes.append(volume)
        mounts.append(mount)
    return volumes, mounts


def _health_probe(period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": "/health", "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


STARTUP_PROBE_PERIOD = 10
STARTUP_FAILURES = 180  # model download + load may take up to 30 minutes


def startup_failures(pool: Pool) -> int:
    """The startup probe's failureThreshold: 30 minutes, plus the time warm start may hold engine
    start (vLLM's /health answers only once the pre-warm is done or its time is up)."""
    warm = pool.spec.warm_start if pool.spec.connector == "tiered" else None
    extra = -(-warm.max_seconds // STARTUP_PROBE_PERIOD) if warm is not None else 0
    return STARTUP_FAILURES + extra


def engine_container(pool: Pool, mounts: list[dict[str, Any]]) -> dict[str, Any]:
    """The vLLM container: image, arguments, env, ports, probes, resources."""
    model = pool.spec.model
    events = pool.spec.kv_events if kv_events_config(pool) is not None else None
    container: dict[str, Any] = {
        "name": "vllm",
        "image": model.image or pool.settings.connector_image,
        "imagePullPolicy": pool.settings.image_pull_policy,
        "command": ["vllm", "serve"],
        "args": engine_args(pool),
        "env": engine_env(pool),
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
                  *([{"name": "kv-events", "containerPort": events.port, "protocol": "TCP"}] if events else [])],
        "startupProbe": _health_probe(STARTUP_PROBE_PERIOD, startup_failures(pool)),
        "readinessProbe": _health_probe(10, 3),
        "livenessProbe": _health_probe(15, 4),
        "securityContext": CONTAINER_SECURITY,
        "volumeMounts": mounts,
    }
    resources = _resources(pool)
    if resources:
        container["resources"] = resources
    return container


def engine_uid(pool: Pool) -> int:
    """The pool's own uid (and gid) in the operator's range, from `<namespace>/<name>`: the
    connector's 0600 files and 0700 directories are then unreadable to other pools' engines even
    where a mount would reach them. Stable across restarts and re-creation, so a pool keeps its
    disk tier's files; a digest, not a secret (subPath and the hostPath allow-lists are the
    boundary; this is the second wall)."""
    settings = pool.settings
    digest = hashlib.sha256(f"{pool.namespace}/{pool.name}".encode()).digest()
    return settings.engine_uid_first + int.from_bytes(digest[:8], "big") % settings.engine_uid_count


def engine_pod_spec(pool: Pool) -> dict[str, Any]:
    """The engines' pod: non-root, no token, no service links, the wait for backends, placement."""
    volumes, mounts = engine_volumes(pool)
    uid = engine_uid(pool)
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 60,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": uid,
            "runAsGroup": uid,
            "fsGroup": pool.settings.engine_fs_group,  # shared: enters the kubelet's per-pool subPath directories
            "fsGroupChangePolicy": "OnRootMismatch",  # a large disk tier is not re-chowned at every start
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [engine_container(pool, mounts)],
        "volumes": volumes,
    }
    init = _wait_init(pool)
    if init:
        pod_spec["initContainers"] = init
    sched = pool.spec.scheduling
    if sched.node_selector:
        pod_spec["nodeSelector"] = dict(sched.node_selector)
    if sched.tolerations:
        pod_spec["tolerations"] = copy.deepcopy(sched.tolerations)
    if sched.affinity:
        pod_spec["affinity"] = copy.deepcopy(sched.affinity)
    return pod_spec


def render_engine(pool: Pool) -> list[dict[str, Any]]:
    return [
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": pool.meta(pool.name, "engine"),
            "spec": {
                **replicas_field(pool.spec.replicas, pool.spec.autoscaling),  # the autoscaler's, if any
                "selector": {"matchLabels": pool.selector("engine")},
                "template": {
                    "metadata": {
                        "labels": {**pool.labels("engine"), **role_labels(pool, DECODE)},
                        "annotations": {CHECKSUM_ANNOTATION: checksum(config_data(pool))},
                    },
                    "spec": engine_pod_spec(pool),
                },
            },
        }
    ]
