"""Chunk keys: from vLLM's own sha256 block-hash chain, equal across processes, different
for anything that changes the KV bytes."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash

from kvpool_connector.connector.keys import (
    PREFIX_LEN,
    KeySpace,
    adapter_prefix,
    chunk_keys,
    rank_key,
)

SPACE = KeySpace(namespace="pool", model="/models/m", model_hash="h1", vllm_version="0.32.0",
                 dtype="torch.bfloat16/auto", layout="spec-fp", tp_size=1,
                 hash_algo="sha256", chunk_tokens=256)


def _block_hashes(tokens: list[int], block_size: int = 128) -> list[bytes]:
    init_none_hash(sha256)
    from vllm.v1.core import kv_cache_utils
    parent, out = kv_cache_utils.NONE_HASH, []
    for i in range(len(tokens) // block_size):
        parent = hash_block_tokens(sha256, parent, tokens[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out


def test_only_complete_chunks_get_keys_and_the_key_is_the_last_block_hash():
    hashes = _block_hashes(list(range(1000)))  # 7 full blocks -> 3 full chunks of 2 blocks
    keys = chunk_keys(SPACE.prefix(), hashes, 2)
    assert len(keys) == 3
    assert all(k.startswith(SPACE.prefix()) and k.endswith(hashes[2 * i + 1])
               for i, k in enumerate(keys))
    assert chunk_keys(SPACE.prefix(), hashes, 2, start=1, limit=2) == keys[1:2]
    assert chunk_keys(SPACE.prefix(), hashes[:1], 2) == []  # shorter than a chunk


def test_a_changed_token_changes_its_chunk_and_every_later_one():
    a = list(range(1024))
    b = list(a)
    b[300] += 1  # inside chunk 1 (tokens 256..511)
    ka = chunk_keys(SPACE.prefix(), _block_hashes(a), 2)
    kb = chunk_keys(SPACE.prefix(), _block_hashes(b), 2)
    assert ka[0] == kb[0] and all(x != y for x, y in zip(ka[1:], kb[1:], strict=True))


def test_key_space_separates_models_layouts_dtypes_and_ranks():
    variants = [dataclasses.replace(SPACE, **{f: v}) for f, v in [
        ("model", "/models/other"), ("layout", "other-fp"), ("dtype", "torch.float16/auto"),
        ("tp_size", 2), ("namespace", "other"), ("hash_algo", "xxhash"),
        ("chunk_tokens", 512), ("model_hash", "h2"), ("vllm_version", "0.33.0"),
        ("pp_size", 2), ("pp_layers", "0-1,1-2")]]
    variants += [dataclasses.replace(SPACE, tp_size=4, tp_replicas=n) for n in (2, 4)]
    prefixes = {v.prefix() for v in variants} | {SPACE.prefix()}
    assert len(prefixes) == len(variants) + 1


def test_keys_are_equal_across_processes_with_different_hash_seeds():
    code = ("from kvpool_connector.connector.keys import KeySpace;"
            "print(KeySpace('pool','/m','h','v','bf16','fp',1,'sha256',256).prefix().hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout.strip()
            for seed in ("0", "12345")}
    assert outs == {KeySpace('pool', '/m', 'h', 'v', 'bf16', 'fp', 1, 'sha256', 256)
                    .prefix().hex()}


def test_revision_quantization_or_overrides_give_a_new_key_space(tiny_model):
    """A rolling update that changes the model's revision, quantization or hf_overrides must
    never load KV computed before it: the model hash (vLLM's real ModelConfig) changes."""
    from vllm.config import ModelConfig

    from kvpool_connector.identity import model_config_hash

    path = str(tiny_model)
    base = model_config_hash(ModelConfig(model=path))
    assert model_config_hash(ModelConfig(model=path)) == base  # stable
    changed = {model_config_hash(ModelConfig(model=path, **kw)) for kw in (
        {"revision": "v2"}, {"quantization": "fp8"}, {"hf_overrides": {"rope_theta": 5000.0}})}
    assert len(changed) == 3 and base not in changed


def test_every_rank_and_stage_has_its_own_keys_and_rank_0_the_logical_ones():
    """Two pipeline stages (other layers) or two tensor ranks (other heads) never store
    under one key; tensor rank 0 of stage 0 stores under the logical key itself."""
    space = dataclasses.replace(SPACE, tp_size=2, pp_size=2, pp_layers="0-14,14-28")
    tags = space.rank_tags()
    assert tags[0] == b"" and len(set(tags)) == 4
    key = chunk_keys(space.prefix(), _block_hashes(list(range(512))), 2)[0]
    owned = [rank_key(key, t) for t in tags]
    assert owned[0] == key and len(set(owned)) == 4
    assert all(k[PREFIX_LEN:] == key[PREFIX_LEN:] for k in owned)  # same block hash suffix
    with pytest.raises(ValueError, match="tp2/pp0 outside tp2/pp2"):
        space.rank_tag(2, 0)


def test_replicated_kv_is_one_object_per_stage_written_by_tensor_rank_0():
    mla = dataclasses.replace(SPACE, tp_size=4, pp_size=2, pp_layers="0-1,1-2", tp_replicas=4)
    assert mla.rank_tags() == [b"", b"tp0/pp1"]
    assert {mla.rank_tag(t, 1) for t in range(4)} == {b"tp0/pp1"}
    assert [mla.stores_shared(t) for t in range(4)] == [True, False, False, False]
    assert all(dataclasses.replace(mla, tp_replicas=1).stores_shared(t) for t in range(4))


def test_replica_groups_store_one_copy_each():
    """kv_tp_replicas 2 at TP 4 (a cache with 2 shards): ranks 0-1 hold one half of the heads,
    2-3 the other; one object per group, written by its first rank, and a hit needs both."""
    gqa = dataclasses.replace(SPACE, tp_size=4, tp_replicas=2)
    assert gqa.rank_tags() == [b"", b"tp1/pp0"]
    assert [gqa.rank_tag(t, 0) for t in range(4)] == [b"", b"", b"tp1/pp0", b"tp1/pp0"]
    assert [gqa.stores_shared(t) for t in range(4)] == [True, False, True, False]
    with pytest.raises(ValueError, match="kv_tp_replicas 3 does not divide the tensor parallel size 4"):
        dataclasses.replace(SPACE, tp_size=4, tp_replicas=3)


def test_replicas_come_from_vllms_kv_cache_config():
    """The count is vLLM's own (kv_cache_groups_tp_replicas over every layer's spec), not a
    type check of one spec: MLA at TP 4 -> 4, a 2-shard cache -> 2, plain attention -> 1."""
    import torch
    from vllm.v1.core.kv_cache_utils import kv_cache_groups_tp_replicas
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MLAAttentionSpec,
    )

    from kvpool_connector.connector.connector import tp_replicas

    def config(spec) -> KVCacheConfig:
        groups = [KVCacheGroupSpec(["l0"], spec)]
        cfg = KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_groups=groups)
        cfg.kv_tp_replicas = kv_cache_groups_tp_replicas(groups, tp_size=4)
        return cfg

    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, max_tp_shards=1)
    two = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16, max_tp_shards=2)
    plain = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    assert [tp_replicas(config(s)) for s in (mla, two, plain)] == [4, 2, 1]


def test_an_adapter_has_its_own_key_space_per_content():
    p = SPACE.prefix()
    a1, a2 = adapter_prefix(p, b"v1" * 16), adapter_prefix(p, b"v2" * 16)
    assert len({p, a1, a2}) == 3 and len(a1) == PREFIX_LEN
    assert adapter_prefix(p, b"v1" * 16) == a1
