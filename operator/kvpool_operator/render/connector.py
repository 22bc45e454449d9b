"""The engine's KV connector configuration: `--kv-transfer-config` and the mounted store config.

tiered: kvpool's KVPoolConnector reads every tier from /etc/kvpool/connector.yaml.
native: vLLM's OffloadingConnector (`cpu_bytes_to_use`, `eviction_policy`, `block_size`); disk,
Redis and S3 become kvpool's secondary tier (`kvpool_connector.vllm_tiers`), which reads the same
store config file and seals every object with the pool key. vLLM's own `fs` tier (no key, no
checks on what it reads back) holds the disk tier only when the pool opts out of kvpool's tier,
and then only on a per-pod volume (models.py refuses the rest).
The store config is built from the connector's own pydantic models (one schema, one size
grammar). Secrets never appear here: the store config names environment variables instead. Every shared
tier is keyed: `security.key_env` names the pool key (and the previous one during a rotation).
"""

from __future__ import annotations

import hashlib
from typing import Any

from kvpool_connector.config import (
    CpuTierConfig,
    DiskTierConfig,
    RedisTierConfig,
    S3TierConfig,
    SecurityConfig,
    parse_size,
)
from kvpool_connector.connector.config import ConnectorConfig, WarmStartConfig
from kvpool_operator.render.common import (
    CONFIG_FILE,
    DISK_PATH,
    MINIO_BUCKET,
    MINIO_PORT,
    POOL_KEY,
    POOL_KEY_ENV,
    PREVIOUS_POOL_KEY,
    PREVIOUS_POOL_KEY_ENV,
    REDIS_ENGINE_USER,
    REDIS_KEY_PREFIX,
    REDIS_PASSWORD_ENV,
    REDIS_PORT,
    S3_ACCESS_KEY_ENV,
    S3_SECRET_KEY_ENV,
    Pool,
    ca_file,
    secret_env,
)

KVPOOL_CONNECTOR = "KVPoolConnector"
KVPOOL_MODULE = "kvpool_connector.vllm"
KVPOOL_TIER_TYPE = "kvpool"
KVPOOL_TIER_MODULE = "kvpool_connector.vllm_tiers"
KVPOOL_OFFLOADING_SPEC = "KVPoolOffloadingSpec"  # vLLM loads it by spec_name + spec_module_path
KVPOOL_NATIVE_MODULE = "kvpool_connector.native"


STORE_NAMESPACE_MAX = 63  # the store's namespace: [A-Za-z0-9][A-Za-z0-9._-]{0,62}


def store_namespace(pool: Pool) -> str:
    """`<namespace>.<name>`: unique per pool (Kubernetes namespaces have no dots), store-safe. Too
    long, it keeps a prefix and a 64-bit digest of the whole: two pools must not share a namespace
    (their directory, Redis prefix and bucket prefix) by a chosen or lucky collision."""
    value = f"{pool.namespace}.{pool.name}"
    if len(value) <= STORE_NAMESPACE_MAX:
        return value
    return f"{value[:STORE_NAMESPACE_MAX - 17]}-{hashlib.sha256(value.encode()).hexdigest()[:16]}"


# Host memory the connector may hold beyond its CPU tier, per pod (split across tensor-parallel
# ranks like the tiers): each lower tier's write queue, and the save staging of KVPoolConnector;
# memory.py counts them in the engine's memory request.
QUEUE_BYTES = "1Gi"
STAGING_BYTES = "1Gi"


def _per_rank(pool: Pool, size: str) -> str:
    """Tier sizes in the spec are per pod; with tensor parallelism every rank keeps its own share."""
    ranks = pool.spec.model.tensor_parallel_size
    return size if ranks == 1 else str(parse_size(size) // ranks)


def redis_url(pool: Pool) -> str:
    redis = pool.spec.tiers.redis
    if redis is None:
        return ""
    if redis.external is not None:
        return redis.external.url
    scheme = "rediss" if redis.managed and redis.managed.tls else "redis"
    return f"{scheme}://{pool.svc_host(pool.redis)}:{REDIS_PORT}/0"


def s3_endpoint(pool: Pool) -> str:
    s3 = pool.spec.tiers.s3
    if s3 is None:
        return ""
    if s3.external is not None:
        return s3.external.endpoint
    scheme = "https" if s3.managed and s3.managed.tls else "http"
    return f"{scheme}://{pool.svc_host(pool.minio)}:{MINIO_PORT}"


def _redis_tier(pool: Pool) -> RedisTierConfig:
    redis = pool.spec.tiers.redis
    assert redis is not None
    tier: dict[str, Any] = {"url": redis_url(pool), "key_prefix": REDIS_KEY_PREFIX}
    username = redis.external.username if redis.external is not None else REDIS_ENGINE_USER
    if username:
        tier["username"] = username
    if redis.managed is not None or (redis.external and redis.external.password_secret_ref):
        tier["password_env"] = REDIS_PASSWORD_ENV
    if backend_ca(pool, "redis") is not None:
        tier["tls_ca_file"] = ca_file("redis")
    if redis.external is not None and redis.external.cluster:
        tier["cluster"] = True
    return RedisTierConfig(type="redis", **tier)


def backend_ca(pool: Pool, tier: str) -> tuple[str, str] | None:
    """(Secret, key) of the CA the engines verify a backend's TLS with, when it is not a system CA:
    a managed backend's own tls Secret, or an external one's caSecretRef."""
    backend = getattr(pool.spec.tiers, tier)
    if backend is not None and backend.managed is not None and backend.managed.tls is not None:
        return backend.managed.tls.secret_name, "ca.crt"
    if backend is not None and backend.external is not None and backend.external.ca_secret_ref is not None:
        return backend.external.ca_secret_ref.name, backend.external.ca_secret_ref.key
    return None


def _s3_tier(pool: Pool) -> S3TierConfig:
    s3 = pool.spec.tiers.s3
    assert s3 is not None
    tls = {"tls_ca_file": ca_file("s3")} if backend_ca(pool, "s3") is not None else {}
    if s3.managed is not None:  # the bucket exists before the engines can reach MinIO (its bootstrap)
        return S3TierConfig(type="s3", endpoint=s3_endpoint(pool), bucket=MINIO_BUCKET, prefix="", region="us-east-1",
                            access_key_env=S3_ACCESS_KEY_ENV, secret_key_env=S3_SECRET_KEY_ENV,
                            path_style=True, create_bucket=False, **tls)
    external = s3.external
    assert external is not None
    credentials = ({"access_key_env": S3_ACCESS_KEY_ENV, "secret_key_env": S3_SECRET_KEY_ENV}
                   if external.credentials_secret_ref is not None else {})
    return S3TierConfig(type="s3", endpoint=external.endpoint, bucket=external.bucket, prefix=external.prefix,
                        region=external.region, **credentials, path_style=external.path_style, create_bucket=False,
                        **tls)


def vllm_fs_disk(pool: Pool) -> bool:
    """Whether the disk tier is vLLM's `fs` tier: native mode without kvpool's secondary tier (a
    per-pod volume, models.py). Everywhere else it is kvpool's, authenticated with the pool key."""
    spec = pool.spec
    return spec.tiers.disk is not None and spec.connector == "native" and not spec.native.kvpool_secondary_tier


def connector_config(pool: Pool) -> ConnectorConfig | None:
    """The connector's own config model for this pool, or None when the mode needs none.

    Built from kvpool_connector's pydantic models (the single source of the config's schema),
    so a field the connector does not know, or a value it would refuse, fails here, at
    render time, not at engine start."""
    tiers = pool.spec.tiers
    out: list[Any] = []
    if pool.spec.connector == "tiered" and tiers.cpu:
        out.append(CpuTierConfig(type="cpu", size=_per_rank(pool, tiers.cpu.size), eviction=tiers.cpu.eviction_policy))
    if tiers.disk and not vllm_fs_disk(pool):
        out.append(DiskTierConfig(type="disk", path=DISK_PATH, size=_per_rank(pool, tiers.disk.size)))
    if tiers.redis:
        out.append(_redis_tier(pool))
    if tiers.s3:
        out.append(_s3_tier(pool))
    if not out:
        return None
    fields: dict[str, Any] = {
        "namespace": store_namespace(pool), "chunk_tokens": pool.spec.chunk_tokens, "tiers": out,
        "queue_bytes": _per_rank(pool, QUEUE_BYTES),
        "security": SecurityConfig(key_env=POOL_KEY_ENV, previous_key_env=PREVIOUS_POOL_KEY_ENV,
                                   encrypt=pool.spec.security.encryption)}
    if pool.spec.connector == "tiered":  # KVPoolConnector keys: the native tier saves no requests itself
        fields |= {"staging_bytes": _per_rank(pool, STAGING_BYTES),
                   "require_cache_salt": pool.spec.security.require_cache_salt,
                   "save_decode_tokens": pool.spec.save_decode}
        if pool.spec.lookup_wait_ms is not None:
            fields["lookup_wait_ms"] = pool.spec.lookup_wait_ms
        warm = pool.spec.warm_start
        if warm is not None:
            fields["warm_start"] = WarmStartConfig(
                enabled=True, refresh_seconds=warm.refresh_seconds, top_k=warm.top_k,
                max_bytes=_per_rank(pool, warm.max_bytes), max_seconds=warm.max_seconds)
    return ConnectorConfig(**fields)


def mounted_store_config(pool: Pool) -> dict[str, Any] | None:
    """The YAML mounted at /etc/kvpool/connector.yaml (the fields set above, sizes in bytes)."""
    config = connector_config(pool)
    return None if config is None else config.model_dump(mode="json", exclude_unset=True)


def kv_transfer_config(pool: Pool, prefill: bool = False) -> dict[str, Any]:
    """The JSON passed as `vllm serve --kv-transfer-config`. `prefill`: the engines of
    spec.prefill, the only ones that honour a request's ask for a handover (`handover_requests`,
    inline over the shared config file): on any other engine a client could force the
    handover's write-through."""
    if pool.spec.connector == "tiered":
        connector_keys: dict[str, Any] = {"config_file": CONFIG_FILE}
        if prefill:
            connector_keys["handover_requests"] = True
        return {
            "kv_connector": KVPOOL_CONNECTOR,
            "kv_connector_module_path": KVPOOL_MODULE,
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": connector_keys,
        }
    tiers = pool.spec.tiers
    assert tiers.cpu is not None  # validated: native needs a CPU tier
    extra: dict[str, Any] = {
        "cpu_bytes_to_use": parse_size(tiers.cpu.size),
        "eviction_policy": tiers.cpu.eviction_policy,
        "block_size": pool.spec.chunk_tokens,
    }
    secondary: list[dict[str, Any]] = []
    if vllm_fs_disk(pool):
        secondary.append({"type": "fs", "root_dir": DISK_PATH})
    if connector_config(pool) is not None:  # disk, Redis, S3: sealed with the pool key
        secondary.append({"type": KVPOOL_TIER_TYPE, "module_path": KVPOOL_TIER_MODULE, "config_file": CONFIG_FILE})
    worker = pool.spec.native.offload_worker
    if worker != "vllm":  # kvpool's spec: vLLM's tiering spec whose worker also runs on CPU nodes
        extra |= {"spec_name": KVPOOL_OFFLOADING_SPEC, "spec_module_path": KVPOOL_NATIVE_MODULE,
                  "offload_worker": worker}
    elif secondary:
        extra["spec_name"] = "TieringOffloadingSpec"
    if secondary:
        extra["secondary_tiers"] = secondary
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def secret_envs(pool: Pool) -> list[dict[str, Any]]:
    """Keys and credentials reach the engine only as env valueFrom.secretKeyRef."""
    tiers = pool.spec.tiers
    env: list[dict[str, Any]] = []
    if connector_config(pool) is not None:  # the store keys every object; the previous key is optional
        env.append(secret_env(POOL_KEY_ENV, pool.keys_secret, POOL_KEY))
        env.append(secret_env(PREVIOUS_POOL_KEY_ENV, pool.keys_secret, PREVIOUS_POOL_KEY, optional=True))
    if tiers.redis and tiers.redis.managed:
        env.append(secret_env(REDIS_PASSWORD_ENV, pool.redis, "enginePassword"))  # the ACL user, not default
    elif tiers.redis and tiers.redis.external and tiers.redis.external.password_secret_ref:
        ref = tiers.redis.external.password_secret_ref
        env.append(secret_env(REDIS_PASSWORD_ENV, ref.name, ref.key))
    if tiers.s3 and tiers.s3.managed:  # the bucket-scoped user, never MinIO's root
        env.append(secret_env(S3_ACCESS_KEY_ENV, pool.minio, "engineAccessKey"))
        env.append(secret_env(S3_SECRET_KEY_ENV, pool.minio, "engineSecretKey"))
    elif tiers.s3 and tiers.s3.external and tiers.s3.external.credentials_secret_ref:
        creds = tiers.s3.external.credentials_secret_ref
        env.append(secret_env(S3_ACCESS_KEY_ENV, creds.name, creds.access_key_key))
        env.append(secret_env(S3_SECRET_KEY_ENV, creds.name, creds.secret_key_key))
    return env
