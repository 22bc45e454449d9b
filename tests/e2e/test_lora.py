"""A LoRA adapter's KV is keyed by its weights, not its name and path (connector/adapters.py).

The operator's mistake this guards against: version 2 of an adapter written over version 1's
path, then a fresh engine. vLLM's block hashes name the adapter by name and path only, so
before the adapter digest the fresh engine loaded version 1's KV from the pool (a hit, with
a valid MAC) and its greedy tokens differed from version 2's recompute.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from tests.e2e.conftest import MAX_TOKENS, connector_engine, disk_files, token_prompt

pytestmark = pytest.mark.vllm

PROMPT = token_prompt(700, seed=77)
HIT = 640  # 2 full chunks of 256 and the tail object of one more 128-token block
LORA = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1, "max_model_len": 4096}


def write_adapter(path, model_dir, seed: int) -> None:
    """A random rank-8 LoRA adapter for the model's q_proj and v_proj, in PEFT's format
    (peft itself is not a dependency), large enough to change the model's KV."""
    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    outs = {"q_proj": heads * head_dim, "v_proj": cfg["num_key_value_heads"] * head_dim}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for mod, out in outs.items():
            base = f"base_model.model.model.layers.{layer}.self_attn.{mod}"
            tensors[f"{base}.lora_A.weight"] = torch.randn(8, hidden, generator=g) * 0.5
            tensors[f"{base}.lora_B.weight"] = torch.randn(out, 8, generator=g) * 0.5
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "bias": "none",
        "target_modules": list(outs), "base_model_name_or_path": str(model_dir),
        "task_type": "CAUSAL_LM"}))


def _ask(eng, path) -> dict:
    return eng.generate([{"prompt_token_ids": PROMPT,
                          "lora": {"name": "sql", "id": 1, "path": str(path)}}],
                        max_tokens=MAX_TOKENS)[0]


def test_a_new_adapter_version_at_the_same_path_misses_and_the_same_version_hits(
        tiny_model, tmp_path, namespace, audit_dir, audit):
    adapter, disk = tmp_path / "adapters" / "sql", tmp_path / "disk"
    tiers = [{"type": "cpu", "size": "64Mi"},
             {"type": "disk", "path": str(disk), "size": "256Mi"}]
    write_adapter(adapter, tiny_model, seed=1)
    with connector_engine(tiny_model, tiers, namespace, audit_dir=audit_dir, **LORA) as eng:
        v1_cold = _ask(eng, adapter)
    assert v1_cold["num_cached_tokens"] == 0 and len(disk_files(disk)) >= 2

    # the same version, a fresh engine: its KV comes from the pool, exactly as saved
    with connector_engine(tiny_model, tiers, namespace, audit_dir=audit_dir, **LORA) as eng:
        v1_again = _ask(eng, adapter)
    assert v1_again["num_cached_tokens"] == HIT
    assert v1_again["token_ids"] == v1_cold["token_ids"]
    assert audit.check() > 0

    # version 2 written over version 1's path: a fresh engine must not load version 1's KV
    write_adapter(adapter, tiny_model, seed=2)
    with connector_engine(tiny_model, tiers, namespace, audit_dir=audit_dir, **LORA) as eng:
        v2 = _ask(eng, adapter)
        v2_hit = _ask(eng, adapter)  # and version 2's own KV is saved and hit
    assert v2["num_cached_tokens"] == 0, "version 1's KV was served to version 2"
    assert v2["token_ids"] != v1_cold["token_ids"]  # the adapters do change the output
    assert v2_hit["num_cached_tokens"] == HIT and v2_hit["token_ids"] == v2["token_ids"]
    audit.check()


def test_an_adapter_rewritten_while_an_engine_runs_never_reaches_the_pool_from_it(
        tiny_model, tmp_path, namespace, audit_dir, audit):
    """Version 2 written over version 1's path while an engine that loaded version 1 runs: that
    engine may still compute version 1's KV (vLLM keeps the adapter in its LoRA cache, and its
    prefix cache holds version 1's blocks under the same name and path). Before, it saved that
    KV under version 2's digest, and a fresh engine serving version 2 loaded it (a hit of 640
    tokens, valid MAC, version 1's KV). Now the changed adapter stays out of the pool on the
    running engine; the fresh engine computes version 2 and then hits its own KV."""
    adapter, disk = tmp_path / "adapters" / "sql", tmp_path / "disk"
    tiers = [{"type": "cpu", "size": "64Mi"},
             {"type": "disk", "path": str(disk), "size": "256Mi"}]
    write_adapter(adapter, tiny_model, seed=1)
    with connector_engine(tiny_model, tiers, namespace, audit_dir=audit_dir, **LORA) as eng:
        _ask(eng, adapter)
        write_adapter(adapter, tiny_model, seed=2)  # while the engine runs
        _ask(eng, adapter)  # out of the pool: nothing saved under version 2's key space
    with connector_engine(tiny_model, tiers, namespace, audit_dir=audit_dir, **LORA) as eng:
        v2 = _ask(eng, adapter)
        v2_hit = _ask(eng, adapter)
    assert v2["num_cached_tokens"] == 0, "version 1's KV was served to version 2"
    assert v2_hit["num_cached_tokens"] == HIT and v2_hit["token_ids"] == v2["token_ids"]
    audit.check()
