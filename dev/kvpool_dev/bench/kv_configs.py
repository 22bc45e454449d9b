"""`--kv-transfer-config` dicts for the benchmark and the demo (pure functions).

Which connector an engine gets is decided here once, so the demo and `bench e2e` agree on
names, tiers and the fallback while the kvpool connector is not importable.
"""

from __future__ import annotations

import importlib
from typing import Any

KVPOOL_MODULE = "kvpool_connector.vllm"
TIMED_MODULE = "kvpool_dev.bench.timed_connector"
POOL_KEY_ENV = "KVPOOL_POOL_KEY"  # the engines' pool key (object names, MACs, encryption)
# vLLM's native offloading with kvpool's spec (runs on the CPU platform too)
NATIVE_SPEC = {"spec_name": "KVPoolOffloadingSpec", "spec_module_path": "kvpool_connector.native"}
NATIVE_TIER_MODULE = "kvpool_connector.vllm_tiers"


def pool_key_env() -> dict[str, str]:
    """Environment giving engines a fresh random pool key (one per benchmark or demo run)."""
    import secrets

    return {POOL_KEY_ENV: secrets.token_urlsafe(32)}


def kvpool_connector_available() -> bool:
    """True when `kvpool_connector.vllm.KVPoolConnector` imports (with vLLM present)."""
    try:
        return hasattr(importlib.import_module(KVPOOL_MODULE), "KVPoolConnector")
    except ImportError:
        return False


def kvpool_config(tiers: list[dict[str, Any]], namespace: str, chunk_tokens: int = 256,
                  timed: bool = False, **connector_keys: Any) -> dict[str, Any]:
    """The kvpool connector with the given store tiers; the pool key comes from
    POOL_KEY_ENV (see pool_key_env)."""
    return {
        "kv_connector": "TimedKVPoolConnector" if timed else "KVPoolConnector",
        "kv_connector_module_path": TIMED_MODULE if timed else KVPOOL_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"namespace": namespace, "tiers": list(tiers),
                                      "chunk_tokens": chunk_tokens,
                                      "security": {"key_env": POOL_KEY_ENV}, **connector_keys},
    }


def native_config(cpu_bytes: int, chunk_tokens: int = 256,
                  secondary_tiers: list[dict[str, Any]] | None = None, timed: bool = False,
                  **extra: Any) -> dict[str, Any]:
    """vLLM's OffloadingConnector with `KVPoolOffloadingSpec`: vLLM's host tier of `cpu_bytes`
    (chunks of `chunk_tokens`), vLLM's scheduler and eviction, optional secondary tiers (see
    native_kvpool_tier); `extra` are further vLLM offloading keys."""
    cfg: dict[str, Any] = {
        "kv_connector": "TimedOffloadingConnector" if timed else "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {**NATIVE_SPEC, "cpu_bytes_to_use": int(cpu_bytes),
                                      "block_size": chunk_tokens, **extra},
    }
    if timed:
        cfg["kv_connector_module_path"] = TIMED_MODULE
    if secondary_tiers:
        cfg["kv_connector_extra_config"]["secondary_tiers"] = list(secondary_tiers)
    return cfg


def native_kvpool_tier(tiers: list[dict[str, Any]], namespace: str,
                       security: dict[str, Any] | None = None, **store_keys: Any
                       ) -> dict[str, Any]:
    """kvpool's secondary tier of native mode over the given store tiers (disk, redis, s3),
    keyed by the pool key in POOL_KEY_ENV unless `security` says otherwise."""
    return {"type": "kvpool", "module_path": NATIVE_TIER_MODULE, "namespace": namespace,
            "tiers": list(tiers), "security": security or {"key_env": POOL_KEY_ENV},
            **store_keys}


def example_config(storage_path: str, timed: bool = False) -> dict[str, Any]:
    """vLLM's in-tree ExampleConnector (safetensors files per layer): the baseline."""
    cfg: dict[str, Any] = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                           "kv_connector_extra_config": {"shared_storage_path": storage_path}}
    if timed:
        cfg.update(kv_connector="TimedExampleConnector", kv_connector_module_path=TIMED_MODULE)
    return cfg


def cpu_tier(size: str = "2Gi") -> dict[str, Any]:
    return {"type": "cpu", "size": size}


def disk_tier(path: str, size: str = "8Gi") -> dict[str, Any]:
    return {"type": "disk", "path": path, "size": size}


def redis_tier(url: str, password_env: str | None = None) -> dict[str, Any]:
    tier: dict[str, Any] = {"type": "redis", "url": url}
    if password_env:
        tier["password_env"] = password_env
    return tier


def s3_tier(endpoint: str, bucket: str, region: str = "us-east-1") -> dict[str, Any]:
    """Credentials come from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in the engine's env."""
    return {"type": "s3", "endpoint": endpoint, "bucket": bucket, "region": region}
