"""What this operator admits beyond the CRD's rules: decided by its settings, not by pool creators.

The CRD (models.py) checks that a spec is well formed; anyone RBAC lets create a KVCachePool can
still ask for a node directory, an image or an external address. These rules come from the
operator's settings (chart `operator.settings`), so a pool gets no more than the operator's
installer allowed. Pure: a spec and settings in, problems naming the field out (ConfigValid=False).
"""

from __future__ import annotations

from kvpool_operator import models
from kvpool_operator.settings import Settings


def under(path: str, prefix: str) -> bool:
    """Whole path components: /mnt/nvme0/kv is under /mnt/nvme0, /mnt/nvme0evil is not."""
    return prefix == "/" or path == prefix or path.startswith(prefix + "/")


def image_under(image: str, prefix: str) -> bool:
    """Whole image-name parts: `registry.example` admits registry.example/x, registry.example:5000/x
    and registry.example@sha256:..., never registry.example.evil.com/x; a prefix that ends on a
    boundary (`registry.example/`, `redis:`) is matched as written."""
    if prefix.endswith(("/", ":", "@")):
        return image.startswith(prefix)
    return image == prefix or image.startswith((prefix + "/", prefix + ":", prefix + "@"))


def refusals(spec: models.KVCachePoolSpec, settings: Settings) -> list[str]:
    out = []
    disk = spec.tiers.disk
    if disk is not None and disk.volume.host_path is not None:
        path = disk.volume.host_path.path.rstrip("/") or "/"
        allowed = settings.allowed_host_path_prefixes
        if not allowed:
            out.append("spec.tiers.disk.volume.hostPath: refused by this operator (its setting "
                       "allowedHostPathPrefixes is empty); use emptyDir, ephemeral or persistentVolumeClaim")
        elif not any(under(path, prefix) for prefix in allowed):
            out.append(f"spec.tiers.disk.volume.hostPath.path: {path} is not under an allowed prefix "
                       f"(operator setting allowedHostPathPrefixes: {', '.join(allowed)})")
    images = [("spec.model.image", spec.model.image)]
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
