"""Hybrid models (issue 58): a request's blocks in several KV cache groups, as save and load
plans name them (block_groups.py), the layout's group-major payloads (layout.py), the
groups kvpool accepts, and a failed load reported by request.

Real torch tensors shaped like vLLM's hybrid caches: layers of different groups share one
tensor (one block pool), each group indexing it with its own block ids.
"""

from __future__ import annotations

import pytest
import torch
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from kvpool_connector.connector.audit import block_digests, paged_digests
from kvpool_connector.connector.block_groups import NULL_BLOCK, load_rows, save_ids, window_blocks
from kvpool_connector.connector.config import ConnectorConfigError
from kvpool_connector.connector.connector import check_kv_cache_groups
from kvpool_connector.connector.layout import KVLayout
from kvpool_connector.connector.metadata import ChunkLoad, KVPoolMetadata, LoadJob
from kvpool_connector.connector.worker import WorkerSide
from kvpool_connector.store import open_store

NUM_BLOCKS = 12


def test_the_null_block_is_vllms():
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=16)
    assert pool.null_block.block_id == NULL_BLOCK
    assert NULL_BLOCK not in [b.block_id for b in pool.get_new_blocks(7)]


def test_one_group_plans_the_ids_it_always_had():
    ids = [[5, 6, 7, 8, 9]]
    assert save_ids(ids, 2, 4) == [7, 8]
    assert save_ids(ids, 4, 6) is None  # not allocated yet
    assert load_rows(ids, 1, 3, 0, 4) == ([1, 2], [6, 7])


def test_a_save_names_every_groups_blocks_group_major_and_never_a_null_one():
    full, window = [5, 6, 7, 8], [NULL_BLOCK, NULL_BLOCK, 3, 4]
    assert save_ids([full, window], 2, 4) == [7, 8, 3, 4]
    assert save_ids([full, window], 0, 2) is None  # out of the window: nothing to save
    assert save_ids([full, window], 1, 3) is None


def test_a_load_writes_each_groups_real_blocks_only():
    full, window = [5, 6, 7, 8], [NULL_BLOCK, NULL_BLOCK, 3, 4]
    # positions 0..3 of an object of 4 positions starting at 0: group 1's rows are 4 + j
    assert load_rows([full, window], 0, 4, 0, 4) == ([0, 1, 2, 3, 6, 7], [5, 6, 7, 8, 3, 4])
    # the second chunk of 2 positions (base 2)
    assert load_rows([full, window], 2, 4, 2, 2) == ([0, 1, 2, 3], [7, 8, 3, 4])


def _hybrid_caches(seed: int) -> dict[str, torch.Tensor]:
    """Layer f (group 0, full attention) shares its tensor with layer s (group 1, sliding
    window), as vLLM's hybrid manager allocates them; layer f2 is group 0's own."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randn(NUM_BLOCKS, 2, 16, 64, generator=g)
    return {"f": shared, "s": shared, "f2": torch.randn(NUM_BLOCKS, 2, 16, 64, generator=g)}


def _layout(caches) -> KVLayout:
    return KVLayout(caches, [["f", "f2"], ["s"]], NUM_BLOCKS, "TEST")


def test_a_hybrid_payload_holds_each_groups_layers_at_its_own_blocks():
    caches = _hybrid_caches(0)
    layout = _layout(caches)
    assert [[v.name for v in g] for g in layout.groups] == [["f", "f2"], ["s"]]
    assert layout.chunk_nbytes(2) == 3 * 2 * caches["f"][0].numel() * 4
    buf = torch.empty(layout.chunk_nbytes(2), dtype=torch.uint8)
    layout.gather(torch.tensor([1, 2, 9, 10]), buf)  # group 0: 1, 2; group 1: 9, 10
    words = buf.view(torch.float32).view(3, 2, 2, 16, 64)
    assert torch.equal(words[0], caches["f"][[1, 2]])
    assert torch.equal(words[1], caches["f2"][[1, 2]])
    assert torch.equal(words[2], caches["s"][[9, 10]])

    dst = _hybrid_caches(1)
    before = {k: v.clone() for k, v in dst.items()}
    out = _layout(dst)
    # group 0's two positions, group 1's second only (its first is out of the window)
    out.scatter(buf, 2, [0, 1, 3], [4, 5, 7])
    assert torch.equal(dst["f"][[4, 5]], caches["f"][[1, 2]])
    assert torch.equal(dst["f2"][[4, 5]], caches["f2"][[1, 2]])
    assert torch.equal(dst["s"][7], caches["s"][10])
    changed = {b for b in range(NUM_BLOCKS) if not torch.equal(dst["f"][b], before["f"][b])}
    assert changed == {4, 5, 7}  # f and s share the tensor: nothing else written
    assert all(torch.equal(dst["f2"][b], before["f2"][b])
               for b in range(NUM_BLOCKS) if b not in (4, 5))
    # the audit names rows alike on both sides
    saved = block_digests(layout, buf, 2)
    assert paged_digests(out, [0, 1, 3], [4, 5, 7], 2) == [saved[0], saved[1], saved[3]]


def test_a_single_group_keeps_its_fingerprint_and_a_hybrid_one_differs():
    caches = _hybrid_caches(0)
    one = KVLayout({"f": caches["f"], "f2": caches["f2"]}, ["f", "f2"], NUM_BLOCKS, "TEST")
    assert one.fingerprint() == KVLayout({"f": caches["f"], "f2": caches["f2"]},
                                         [["f", "f2"]], NUM_BLOCKS, "TEST").fingerprint()
    assert "groups=" not in one.fingerprint()
    assert "groups=2,1" in _layout(caches).fingerprint()


def _groups(*specs) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)])


def test_full_and_sliding_window_groups_are_served_others_refused_in_one_line():
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    window = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64,
                               dtype=torch.bfloat16, sliding_window=256)
    check_kv_cache_groups(_groups(full, window), 16)
    mamba = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float32,))
    with pytest.raises(ConnectorConfigError, match="group 1 of kind MambaSpec") as err:
        check_kv_cache_groups(_groups(full, mamba), 16)
    assert "\n" not in str(err.value)
    other = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=64,
                              dtype=torch.bfloat16, sliding_window=256)
    with pytest.raises(ConnectorConfigError, match="group 1 has 32"):
        check_kv_cache_groups(_groups(full, other), 16)


def test_a_failed_hybrid_load_is_reported_by_request_never_by_block():
    """vLLM 0.32 raises on block-level load errors with several KV cache groups (block ids
    repeat across groups); the request goes to failed_recving and is recomputed instead."""
    layout = _layout(_hybrid_caches(0))
    store = open_store({"namespace": "hybrid-test", "tiers": [{"type": "cpu", "size": "16Mi"}]},
                       layout=b"l")
    side = WorkerSide(store, blocks_per_chunk=2, layerwise=False)
    side.register(layout)
    try:
        load = LoadJob("r", [ChunkLoad(b"m" * 16, rows=[0, 1, 3], block_ids=[4, 5, 7])],
                       is_async=True)
        side.submit_loads(KVPoolMetadata(loads=[load]))
        assert side.get_finished(KVPoolMetadata(idle=True))[1] == {"r"}
        assert side.take_load_errors() == set()
        assert side.loads.take_failed_requests() == {"r"}
        assert side.worker_meta().failed_loads == {"r": [b"m" * 16]}
    finally:
        side.shutdown()
        store.close()


def test_a_sliding_window_group_keeps_the_blocks_a_later_hit_can_read():
    # vLLM reads the tokens from num_computed - window + 1 on: the last cdiv(window - 1,
    # block) blocks before a boundary
    assert window_blocks(256, 128) == 2
    assert window_blocks(128, 16) == 8
    assert window_blocks(4096, 16) == 256
    assert window_blocks(16, 16) == 1
    full, window = [5, 6, 7, 8], [NULL_BLOCK, NULL_BLOCK, 3, 4]
    # group 1 stores the last 2 positions of an object: its nulls before them do not matter
    assert save_ids([full, window], 0, 4, [None, 2]) == [5, 6, 7, 8, NULL_BLOCK, NULL_BLOCK, 3, 4]
    assert save_ids([full, [NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 4]], 0, 4, [None, 2]) is None


def test_a_trimmed_payload_holds_a_windows_last_blocks_only():
    caches = _hybrid_caches(0)
    layout = KVLayout(caches, [["f", "f2"], ["s"]], NUM_BLOCKS, "TEST", keep=[None, 1])
    block = caches["f"][0].numel() * 4
    assert layout.chunk_nbytes(3) == (2 * 3 + 1) * block  # group 1: its last position
    assert layout.chunk_nbytes(1) == 3 * block
    assert "keep=all,1" in layout.fingerprint()
    buf = torch.empty(layout.chunk_nbytes(3), dtype=torch.uint8)
    layout.gather(torch.tensor([1, 2, 3, NULL_BLOCK, NULL_BLOCK, 9]), buf)
    words = buf.view(torch.float32)
    assert torch.equal(words[-block // 4:].view(2, 16, 64), caches["s"][9])

    dst = _hybrid_caches(1)
    out = KVLayout(dst, [["f", "f2"], ["s"]], NUM_BLOCKS, "TEST", keep=[None, 1])
    out.scatter(buf, 3, [0, 1, 2, 5], [4, 5, 6, 8])
    assert torch.equal(dst["f2"][[4, 5, 6]], caches["f2"][[1, 2, 3]])
    assert torch.equal(dst["s"][8], caches["s"][9])
    with pytest.raises(IndexError, match="group 1 stores the last 1 of 3"):
        out.scatter(buf, 3, [4], [10])  # a position the object does not hold
    saved = block_digests(layout, buf, 3)
    assert saved[3:5] == [None, None] and saved[5] is not None
    assert paged_digests(out, [0, 5], [4, 8], 3) == [saved[0], saved[5]]
