"""`--kv-transfer-config` dicts for the benchmark and the demo (pure functions).

Which connector an engine gets is decided here once, so the demo and `bench e2e` agree on
names, tiers and the fallback while the kvpool connector is not importable.
"""

from __future__ import annotations

import importlib
from typing import Any

KVPOOL_MODULE = "kvpool_connector.vllm"
TIMED_MODULE = "kvpool_connector.bench.timed_connector"
POOL_KEY_ENV = "KVPOOL_POOL_KEY"  # the engines' pool key (object names, MACs, encryption)


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
