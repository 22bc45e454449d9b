"""Helpers of the connector package's tests (fixtures are in conftest.py)."""

from __future__ import annotations


def engine_configs(model, kv_transfer: dict, hash_algo: str = "sha256", lora: bool = False,
                   **model_kwargs):
    """(VllmConfig, KVCacheConfig) as an engine hands them to its KV connector: a real vLLM
    config of a local `model` (nothing started) and one KV cache group of two layers, 16
    tokens per block, 4 KiB per layer and block (bfloat16, one KV head of 64)."""
    import torch
    from vllm.config import CacheConfig, KVTransferConfig, LoRAConfig, ModelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )

    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(model), dtype="bfloat16", **model_kwargs),
        cache_config=CacheConfig(block_size=16, prefix_caching_hash_algo=hash_algo),
        kv_transfer_config=KVTransferConfig(**kv_transfer),
        lora_config=LoRAConfig(max_lora_rank=8, max_loras=1) if lora else None)  # --enable-lora
    layer = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64,
                              dtype=torch.bfloat16)
    page, blocks = layer.page_size_bytes, 64
    kv_cache_config = KVCacheConfig(
        num_blocks=blocks,
        kv_cache_tensors=[KVCacheTensor(size=2 * blocks * page, layers=["l0", "l1"],
                                        layer_stride=blocks * page, block_stride=page)],
        kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], layer)])
    return vllm_config, kv_cache_config
