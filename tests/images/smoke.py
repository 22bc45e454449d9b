"""The pool the image smoke tests render and reconcile (not a test module)."""

from __future__ import annotations

from typing import Any

NS = "smoke"


def smoke_pool(engine_image: str, model: str, dtype: str) -> dict[str, Any]:
    """The smallest CPU pool that exercises the connector's cpu and disk tiers and the router."""
    return {
        "apiVersion": "kvpool.dev/v1alpha1", "kind": "KVCachePool",
        "metadata": {"name": "smoke", "namespace": NS},
        "spec": {
            "model": {
                "name": model, "image": engine_image, "gpus": 0, "shmSize": "256Mi", "memoryOverhead": "2Gi",
                "cpuKvCacheGiB": 1,  # VLLM_CPU_KVCACHE_SPACE
                # --enforce-eager: the CPU image has no C++ compiler for torch.compile (docs/helm.md)
                "extraArgs": ["--enforce-eager", "--served-model-name", "tiny", "--max-model-len", "4096",
                              "--dtype", dtype, "--no-enable-prefix-caching", "--enable-prompt-tokens-details"],
                "env": [{"name": "HF_HUB_OFFLINE", "value": "1"},
                        {"name": "VLLM_NO_USAGE_STATS", "value": "1"}],
            },
            "tiers": {"cpu": {"size": "256Mi"}, "disk": {"size": "1Gi", "volume": {"emptyDir": {}}}},
            "router": {"policy": "cache_aware"},
        },
    }
