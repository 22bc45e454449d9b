"""kvpool's host-copy OffloadingWorker (native mode on the CPU platform), without an engine:
the block <-> host sub-block mapping against hand-computed positions and vLLM's own pointer
arithmetic, and byte-exact round trips through real host tensors laid out the way vLLM's
connector registers them (int8 block views, padded pages, several KV groups)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from vllm.v1.kv_offload.base import GPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.gpu_worker import compute_sub_block_ptrs

from kvpool_connector.native.host_copy import HostCopyWorker, Run, plan_copies, runs
from tests.connector.native.harness import PagedCache


def test_plan_follows_vllms_mapping_with_an_unaligned_first_chunk():
    """6 blocks starting at logical block 2 of a 4-block chunk: chunk 7 gets sub-blocks 2 and
    3, chunk 3 all four; a second group of 2 aligned blocks fills half of chunk 5."""
    plan = plan_copies(paged_block_ids=[10, 11, 12, 13, 14, 15, 40, 41], chunk_ids=[7, 3, 5],
                       group_sizes=[6, 2], block_indices=[2, 8], blocks_per_chunk=4)
    assert [c.group for c in plan] == [0, 1]
    assert plan[0].paged.tolist() == [10, 11, 12, 13, 14, 15]
    assert plan[0].host.tolist() == [7 * 4 + 2, 7 * 4 + 3, 3 * 4, 3 * 4 + 1, 3 * 4 + 2,
                                     3 * 4 + 3]
    assert plan[1].paged.tolist() == [40, 41] and plan[1].host.tolist() == [20, 21]


def test_plan_skips_empty_groups_and_rejects_leftover_chunks():
    plan = plan_copies([1, 2], [0], group_sizes=[0, 2], block_indices=[0, 4], blocks_per_chunk=2)
    assert [(c.group, c.host.tolist()) for c in plan] == [(1, [0, 1])]
    with pytest.raises(AssertionError, match="left over"):
        plan_copies([1, 2], [0, 1], group_sizes=[2], block_indices=[0], blocks_per_chunk=2)


@pytest.mark.parametrize("skip", [0, 1, 3])
def test_host_addresses_equal_vllms_pointer_arithmetic(skip):
    """Where each block lands, in bytes, equals vLLM's `compute_sub_block_ptrs` for the same
    chunks and skip (the function vLLM's CUDA worker builds its copy descriptors with)."""
    bpc, page, row_stride = 4, 96, 4 * 96 + 128  # rows padded, as in the shared region
    base = torch.zeros(8 * row_stride, dtype=torch.int8)
    host = base.as_strided((8, bpc * page), (row_stride, 1))
    chunks = np.array([6, 1, 4], dtype=np.int32)
    size = 3 * bpc - skip - 1
    plan = plan_copies(np.arange(size), chunks, [size], [skip], bpc)[0]
    ours = base.data_ptr() + plan.host // bpc * row_stride + plan.host % bpc * page
    theirs = np.empty(size, dtype=np.int64)
    compute_sub_block_ptrs(chunks, bpc, theirs, host, skip_count=skip)
    assert ours.tolist() == theirs.tolist()


def test_runs_merge_blocks_adjacent_on_both_sides_within_a_chunk():
    plan = plan_copies([4, 5, 6, 7, 9, 10], [3, 8], [6], [1], blocks_per_chunk=4)[0]
    # sub-blocks 13,14,15 | 32,33,34 of chunks 3 and 8; paged 4,5,6 | 7 | 9,10
    assert runs(plan, 4) == [Run(4, 3, 1, 3), Run(7, 8, 0, 1), Run(9, 8, 1, 2)]


def host_views(pages: list[int], bpc: int, num_chunks: int, pad: int = 64):
    """Per-tensor views into one region of padded rows, as `create_next_worker_view` cuts."""
    row = sum(p * bpc for p in pages) + pad
    region = torch.full((num_chunks * row,), 7, dtype=torch.int8)
    views, offset = [], 0
    for p in pages:
        views.append(region.as_strided((num_chunks, p * bpc), (row, 1), offset))
        offset += p * bpc
    return region, views


def test_store_then_load_is_byte_exact_and_touches_nothing_else():
    pages, unpadded, bpc = [256, 256, 192], [256, 256, 160], 2
    src = PagedCache(pages, unpadded, num_blocks=16, seed=1)
    groups = [[0, 1], [2]]  # two KV groups, the second with padded pages
    region, views = host_views(pages, bpc, num_chunks=8)
    worker = HostCopyWorker(src.canonical(groups), views, bpc)
    # group 0: blocks 3,5,9 from logical block 1 (chunks 6, 2); group 1: blocks 4,8 (chunk 0)
    paged = GPULoadStoreSpec([3, 5, 9, 4, 8], group_sizes=[3, 2], block_indices=[1, 0])
    host = CPULoadStoreSpec([6, 2, 0])
    before = region.clone()
    assert worker.submit_store(11, paged, host)
    [done] = worker.get_finished()
    assert (done.job_id, done.success) == (11, True)
    assert done.transfer_size == 3 * (256 + 256) + 2 * 160 and done.transfer_time >= 0
    assert worker.get_finished() == []
    worker.wait({11})  # completed at submit: returns at once

    def sub_block(t, chunk, j):
        return views[t][chunk, j * pages[t]:(j + 1) * pages[t]]

    for t in (0, 1):  # chunk 6 sub-block 1 <- block 3, chunk 2 <- blocks 5, 9
        for (chunk, j), block in zip([(6, 1), (2, 0), (2, 1)], [3, 5, 9], strict=True):
            assert torch.equal(sub_block(t, chunk, j), src.tensors[t][block])
    for (chunk, j), block in zip([(0, 0), (0, 1)], [4, 8], strict=True):
        assert torch.equal(sub_block(2, chunk, j)[:160], src.tensors[2][block][:160])
        assert (sub_block(2, chunk, j)[160:] == 7).all()  # padding is not KV: not copied
    written = (region != before).nonzero().numel()
    assert written <= done.transfer_size  # nothing outside the copied pages changed

    dst = PagedCache(pages, unpadded, num_blocks=16, seed=2)
    untouched = [t.clone() for t in dst.tensors]
    loader = HostCopyWorker(dst.canonical(groups), views, bpc)
    assert loader.submit_load(12, host, GPULoadStoreSpec([0, 1, 2, 7, 15], [3, 2], [1, 0]))
    assert [r.job_id for r in loader.get_finished()] == [12]
    for t, blocks in ((0, [3, 5, 9]), (1, [3, 5, 9])):
        for new, old in zip([0, 1, 2], blocks, strict=True):
            assert torch.equal(dst.tensors[t][new], src.tensors[t][old])
    for new, old in zip([7, 15], [4, 8], strict=True):
        assert torch.equal(dst.tensors[2][new][:160], src.tensors[2][old][:160])
        assert torch.equal(dst.tensors[2][new][160:], untouched[2][new][160:])
    for t in range(3):  # blocks the load did not name are untouched
        others = [b for b in range(16) if b not in ([0, 1, 2] if t < 2 else [7, 15])]
        assert torch.equal(dst.tensors[t][others], untouched[t][others])


def test_shutdown_releases_the_views_before_the_region():
    calls = []
    src = PagedCache([64], [64], num_blocks=4, seed=3)
    _, views = host_views([64], 1, num_chunks=2)
    worker = HostCopyWorker(src.canonical([[0]]), views, 1, on_shutdown=lambda: calls.append(1))
    worker.shutdown()
    worker.shutdown()
    assert calls == [1] and worker._host == [] and worker._paged == []
