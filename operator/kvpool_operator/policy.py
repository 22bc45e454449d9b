"""What this operator admits beyond the CRD's rules: decided by its settings, not by pool creators.

The CRD (models.py) checks that a spec is well formed; anyone RBAC lets create a KVCachePool can
still ask for a node directory, an image or an external address. These rules come from the
operator's settings (chart `operator.settings`), so a pool gets no more than the operator's
installer allowed. Pure: a spec and settings in, problems naming the field out (ConfigValid=False).
"""

from __future__ import annotations

from typing import Any

from kvpool_connector.config import parse_size
from kvpool_operator import models
from kvpool_operator.settings import Settings, overlaps, under


def image_under(image: str, prefix: str) -> bool:
    """Whole image-name parts: `registry.example` admits registry.example/x, registry.example:5000/x
    and registry.example@sha256:..., never registry.example.evil.com/x; a prefix that ends on a
    boundary (`registry.example/`, `redis:`) is matched as written."""
    if prefix.endswith(("/", ":", "@")):
        return image.startswith(prefix)
    return image == prefix or image.startswith((prefix + "/", prefix + ":", prefix + "@"))


def _host_path_refusals(field: str, path: str, allowed: tuple[str, ...], setting: str, instead: str) -> list[str]:
    """A hostPath (normalised: no trailing /) outside the setting's prefixes, named."""
    if not allowed:
        return [f"{field}: refused by this operator (its setting {setting} is empty); use {instead}"]
    if not any(under(path, prefix) for prefix in allowed):
        return [f"{field}.path: {path} is not under an allowed prefix (operator setting {setting}: "
                f"{', '.join(allowed)})"]
    return []


def refusals(spec: models.KVCachePoolSpec, settings: Settings) -> list[str]:
    out = []
    disk = spec.tiers.disk
    if disk is not None and disk.volume.host_path is not None:
        out += _host_path_refusals("spec.tiers.disk.volume.hostPath", disk.volume.host_path.path.rstrip("/") or "/",
                                   settings.allowed_host_path_prefixes, "allowedHostPathPrefixes",
                                   "emptyDir, ephemeral or persistentVolumeClaim")
    model_volume = spec.model.volume
    if model_volume is not None and model_volume.host_path is not None:
        field = "spec.model.volume.hostPath"
        path = model_volume.host_path.path.rstrip("/") or "/"
        out += _host_path_refusals(field, path, settings.allowed_model_host_path_prefixes,
                                   "allowedModelHostPathPrefixes", "persistentVolumeClaim or image")
        # mounted whole (no forced subPath): over a disk-tier directory it would read every pool's tier
        for disk_dir in settings.allowed_host_path_prefixes:
            if overlaps(path, disk_dir):
                out.append(f"{field}.path: {path} overlaps the disk-tier prefix {disk_dir} (operator setting "
                           "allowedHostPathPrefixes): a model volume there would read other pools' disk tiers")
    images = [("spec.model.image", spec.model.image)]
    if model_volume is not None and model_volume.image is not None:
        images.append(("spec.model.volume.image.reference", model_volume.image.reference))
    if spec.tiers.redis and spec.tiers.redis.managed:
        images.append(("spec.tiers.redis.managed.image", spec.tiers.redis.managed.image))
    if spec.tiers.s3 and spec.tiers.s3.managed:
        images.append(("spec.tiers.s3.managed.image", spec.tiers.s3.managed.image))
    if spec.router is not None:
        images.append(("spec.router.image", spec.router.image))
    prefixes = settings.allowed_image_prefixes
    for field, image in images:
        if image and prefixes and not any(image_under(image, prefix) for prefix in prefixes):
            out.append(f"{field}: {image} does not start with an allowed prefix "
                       f"(operator setting allowedImagePrefixes: {', '.join(prefixes)})")
    if not settings.allow_external_backends:
        for tier in ("redis", "s3"):
            if getattr(getattr(spec.tiers, tier), "external", None) is not None:
                out.append(f"spec.tiers.{tier}.external: refused by this operator (its setting "
                           "allowExternalBackends is false); use managed")
    if spec.inference_pool is not None and spec.inference_pool.enabled and not settings.inference_pools:
        out.append("spec.inferencePool.enabled: refused by this operator (its setting inferencePools is false: "
                   "it holds no RBAC for InferencePools, and their CRD may not be installed)")
    for field, scaling in (("spec.autoscaling", spec.autoscaling),
                           ("spec.prefill.autoscaling", spec.prefill.autoscaling if spec.prefill else None)):
        if scaling is not None and scaling.min_replicas == 0 and not settings.keda:
            out.append(f"{field}.minReplicas: 0 needs KEDA (this operator's setting keda is false, and a "
                       "HorizontalPodAutoscaler cannot scale to zero)")
    return out


def insecure_backends(spec: models.KVCachePoolSpec) -> list[str]:
    """Backends reached without a password or without TLS, managed or external: allowed, but worth a
    Warning (BackendsSecure=False): whoever reaches them, or reads the pod network, reads the cache
    (prompts can be reconstructed from KV tensors unless security.encryption is on) or evicts it;
    objects stay authenticated by the pool key."""
    out = []
    for tier, what in (("redis", "the engines' password"), ("s3", "the engines' request signatures")):
        managed = getattr(getattr(spec.tiers, tier), "managed", None)
        if managed is not None and managed.tls is None:
            out.append(f"spec.tiers.{tier}.managed: no tls, so the cache and {what} cross the pod network in "
                       "cleartext (the NetworkPolicy limits who connects, not who reads the wire); set tls.secretName")
    redis = spec.tiers.redis.external if spec.tiers.redis else None
    if redis is not None:
        if redis.password_secret_ref is None:
            out.append("spec.tiers.redis.external: no passwordSecretRef, so any client that reaches this Redis "
                       "can read and evict the pool's cache")
        if not redis.url.startswith("rediss://"):
            out.append("spec.tiers.redis.external.url: redis:// sends the cache and the password in cleartext; "
                       "use rediss://")
    s3 = spec.tiers.s3.external if spec.tiers.s3 else None
    if s3 is not None and not s3.endpoint.startswith("https://"):
        out.append("spec.tiers.s3.external.endpoint: http:// sends the cache in cleartext; use https://")
    return out


def exposure_warnings(spec: models.KVCachePoolSpec) -> list[str]:
    """Allowed but worth a warning in the operator's log: an API reachable from outside the cluster
    without an API key (anyone who reaches the node port or load balancer generates, and reads
    /metrics)."""
    service = spec.service
    if service.type != "ClusterIP" and service.api_key_secret_ref is None:
        return [f"spec.service.type: {service.type} without apiKeySecretRef: whoever reaches it outside the "
                "cluster uses the engines (and reads /metrics); set service.apiKeySecretRef"]
    return []


# The most memory a node of each sort has, generously (docs/operator.md, "Sizes"): the largest
# 8-GPU servers carry 2-3 TiB of host memory, the largest memory-optimised machines 32 TiB (AWS
# u7in-32tb). A pod asking for more is never scheduled: almost always a unit typo (1Pi for 1Ti).
GPU_NODE_MEMORY_MAX = 4 * 2**40
NODE_MEMORY_MAX = 32 * 2**40


def _memory_request(pod_spec: dict[str, Any]) -> int | None:
    """The memory a pod's containers request (their limits where no request); None when a value
    is not a size this operator reads (the user's own resources in another spelling)."""
    total = 0
    for container in pod_spec.get("containers", []):
        resources = container.get("resources") or {}
        value = (resources.get("requests") or {}).get("memory") or (resources.get("limits") or {}).get("memory")
        if value is None:
            continue
        try:
            total += parse_size(str(value))
        except ValueError:
            return None
    return total


def _asks_gpus(pod_spec: dict[str, Any]) -> bool:
    return any("nvidia.com/gpu" in ((c.get("resources") or {}).get("limits") or {})
               for c in pod_spec.get("containers", []))


def _memory_fields(spec: models.KVCachePoolSpec, component: str) -> str:
    """The spec fields a component's memory request comes from, the largest first."""
    if component == "prefill" and spec.prefill is not None:
        resources = spec.prefill.resources
        if any("memory" in (resources.get(part) or {}) for part in ("requests", "limits")):
            return "spec.prefill.resources"
    if component in ("engine", "prefill"):
        resources = spec.model.resources
        if any("memory" in (resources.get(part) or {}) for part in ("requests", "limits")):
            return "spec.model.resources"
        parts = [("spec.model.memoryOverhead", spec.model.memory_overhead), ("spec.model.shmSize", spec.model.shm_size)]
        if spec.tiers.cpu is not None:
            parts.append(("spec.tiers.cpu.size", spec.tiers.cpu.size))
        return max(parts, key=lambda p: parse_size(p[1]))[0]
    if component == "redis":
        return "spec.tiers.redis.managed.memory"
    if component == "router":
        return "spec.router.resources"
    return f"spec ({component})"


def _human(nbytes: int) -> str:
    unit, suffix = max(((u, s) for u, s in ((2**40, "Ti"), (2**50, "Pi"), (2**60, "Ei")) if nbytes >= u),
                       default=(2**30, "Gi"))
    return f"{nbytes / unit:.1f}{suffix}"


def model_warnings(spec: models.KVCachePoolSpec) -> list[str]:
    """A model volume the engines would not read: name is not a path under its mountPath, so vLLM
    downloads `name` at every start anyway (the volume was meant to prevent that)."""
    volume = spec.model.volume
    if volume is None:
        return []
    mount = volume.mount_path.rstrip("/")
    name = spec.model.name.rstrip("/")
    if name == mount or name.startswith(mount + "/"):
        return []
    return [f"spec.model.name: {spec.model.name!r} is not under spec.model.volume.mountPath {volume.mount_path}: "
            "vLLM reads the hub id (a download at every start), not the mounted weights"]


def size_warnings(spec: models.KVCachePoolSpec, manifests: list[dict[str, Any]]) -> list[str]:
    """Pods whose memory request no node of their sort has (GPU nodes for GPU pods): allowed
    (someone may have such a node), but reported (SizesFit=False, a CLI warning), since such a
    pod stays Pending forever with nothing else saying why."""
    out = []
    for manifest in manifests:
        pod_spec = ((manifest.get("spec") or {}).get("template") or {}).get("spec")
        if not isinstance(pod_spec, dict):
            continue
        request = _memory_request(pod_spec)
        gpus = _asks_gpus(pod_spec)
        bound = GPU_NODE_MEMORY_MAX if gpus else NODE_MEMORY_MAX
        if request is None or request <= bound:
            continue
        component = manifest["metadata"].get("labels", {}).get("app.kubernetes.io/component", manifest["kind"])
        node = "a GPU node" if gpus else "any node"
        out.append(f"{_memory_fields(spec, component)}: {manifest['kind']}/{manifest['metadata']['name']} requests "
                   f"{_human(request)} of memory per pod, more than {node} has (bound "
                   f"{models.format_size(bound)}): it would never be scheduled; is the unit right?")
    return out
