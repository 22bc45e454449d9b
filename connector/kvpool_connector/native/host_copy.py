"""vLLM's `OffloadingWorker` for the CPU platform: paged KV <-> the primary tier's host rows by
plain memory copies.

vLLM's own worker (`CPUOffloadingWorker`) drives CUDA/XPU copy streams and batched DMA
kernels; on the CPU platform the paged KV cache already is host memory, so a transfer is a
memcpy per run of adjacent blocks and KV tensor (no streams, no events). The block mapping is
vLLM's (`SingleDirectionOffloadingHandler.transfer_async`): block `i` of a group goes to
sub-block `(block_indices[g] % blocks_per_chunk) + i` of the group's run of primary chunks, for
every data reference of the group, `page_size_bytes` (un-padded) bytes each.

Transfers run to completion inside `submit_store`/`submit_load`: on the CPU platform a copy
competes with the forward pass for the same cores and memory bandwidth, so a copy thread would
only interleave the two, and a finished copy makes `wait` (vLLM's fence before a block is
reused) trivially true. `get_finished` reports them at the end of the step, as the contract
asks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..amx import ask_for_amx_tiles
from .contract import GPULoadStoreSpec, OffloadingWorker, TransferResult

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import CanonicalKVCaches, LoadStoreSpec


@dataclass(frozen=True)
class GroupCopy:
    """One KV cache group's share of a transfer: paged block `paged[i]` <-> host sub-block
    `host[i]` (a chunk id times `blocks_per_chunk` plus the position inside the chunk)."""

    group: int
    paged: np.ndarray
    host: np.ndarray


def plan_copies(paged_block_ids: np.ndarray, chunk_ids: np.ndarray, group_sizes, block_indices,
                blocks_per_chunk: int) -> list[GroupCopy]:
    """Which paged block goes to which host sub-block (pure; vLLM's mapping, see the module
    docstring). `paged_block_ids` are ordered by group, `group_sizes[g]` of them per group;
    each group's chunks start at sub-block `block_indices[g] % blocks_per_chunk`."""
    paged_block_ids = np.asarray(paged_block_ids, dtype=np.int64)
    chunk_ids = np.asarray(chunk_ids, dtype=np.int64)
    assert len(group_sizes) == len(block_indices), (group_sizes, block_indices)
    assert sum(group_sizes) == len(paged_block_ids), (group_sizes, len(paged_block_ids))
    out: list[GroupCopy] = []
    paged_at = chunk_at = 0
    for group, (size, first_index) in enumerate(zip(group_sizes, block_indices, strict=True)):
        if size == 0:
            continue
        skip = int(first_index) % blocks_per_chunk
        n_chunks = -(-(size + skip) // blocks_per_chunk)
        chunks = chunk_ids[chunk_at:chunk_at + n_chunks]
        assert len(chunks) == n_chunks, f"group {group}: {len(chunks)} chunks, need {n_chunks}"
        sub_blocks = (chunks[:, None] * blocks_per_chunk + np.arange(blocks_per_chunk)).ravel()
        out.append(GroupCopy(group, paged_block_ids[paged_at:paged_at + size],
                             sub_blocks[skip:skip + size]))
        paged_at += size
        chunk_at += n_chunks
    assert chunk_at == len(chunk_ids), f"{len(chunk_ids) - chunk_at} chunks left over"
    return out


@dataclass(frozen=True)
class Run:
    """`length` paged blocks from `paged_start` <-> sub-blocks `sub_start`.. of host chunk
    `chunk`: contiguous on both sides, so one copy per KV tensor."""

    paged_start: int
    chunk: int
    sub_start: int
    length: int


def runs(copy: GroupCopy, blocks_per_chunk: int) -> list[Run]:
    """Merge a group's block-by-block mapping into runs (pure): consecutive paged blocks going
    to consecutive sub-blocks of one chunk (a chunk's KV tensors are not adjacent in a host
    row, so a run never crosses chunks)."""
    out: list[Run] = []
    for paged, host in zip(copy.paged.tolist(), copy.host.tolist(), strict=True):
        chunk, sub = divmod(host, blocks_per_chunk)
        last = out[-1] if out else None
        if last is not None and last.chunk == chunk and paged == last.paged_start + \
                last.length and sub == last.sub_start + last.length:
            out[-1] = Run(last.paged_start, chunk, last.sub_start, last.length + 1)
        else:
            out.append(Run(paged, chunk, sub, 1))
    return out


class HostCopyWorker(OffloadingWorker):
    """Moves blocks between the paged KV tensors (host memory on the CPU platform) and the
    primary tier's per-tensor host views (`host_views[t]`: `(num_chunks, page_t *
    blocks_per_chunk)` int8), synchronously (see the module docstring)."""

    def __init__(self, kv_caches: CanonicalKVCaches, host_views: list[torch.Tensor],
                 blocks_per_chunk: int, on_shutdown=None) -> None:
        assert len(host_views) == len(kv_caches.tensors)
        if kv_caches.tensors:  # before a first step that is a full hit (amx.py)
            ask_for_amx_tiles(kv_caches.tensors[0].tensor.device.type)
        self.blocks_per_chunk = blocks_per_chunk
        self.group_refs = kv_caches.group_data_refs
        self._paged: list[np.ndarray] = []  # (num_blocks, page) int8
        self._host: list[np.ndarray] = []   # (num_chunks, blocks_per_chunk, page) int8
        for canonical, host in zip(kv_caches.tensors, host_views, strict=True):
            page = canonical.page_size_bytes
            paged = canonical.tensor  # vLLM registers (num_blocks, page) int8 block views
            assert paged.dtype == torch.int8 and paged.dim() == 2 and paged.shape[1] == page, \
                (paged.dtype, tuple(paged.shape), page)
            assert paged.device.type == "cpu", "HostCopyWorker moves host memory only"
            assert host.dtype == torch.int8 and host.shape[1] == page * blocks_per_chunk, \
                (tuple(host.shape), page, blocks_per_chunk)
            # (chunk, sub-block, byte): sub-blocks are uniformly strided only inside a chunk.
            # numpy views of the same memory: np.copyto is a plain single-threaded memcpy,
            # where torch's copy_ hands each slice to the intra-op thread pool that the
            # forward pass already keeps busy (several times slower on a few shared cores).
            self._paged.append(paged.numpy())
            self._host.append(host.as_strided(
                (host.shape[0], blocks_per_chunk, page),
                (host.stride(0), page, 1), host.storage_offset()).numpy())
        self._finished: list[TransferResult] = []
        self._on_shutdown = on_shutdown

    def _copy(self, job_id: int, paged_spec: GPULoadStoreSpec, host_spec: LoadStoreSpec,
              to_host: bool) -> bool:
        """One memcpy per run and KV tensor (torch's index_select/index_put_ over the same
        blocks is an order of magnitude slower)."""
        t0 = time.perf_counter()
        nbytes = 0
        for copy in plan_copies(paged_spec.block_ids, host_spec.block_ids,
                                paged_spec.group_sizes, paged_spec.block_indices,
                                self.blocks_per_chunk):
            refs = [(self._paged[r.tensor_idx], self._host[r.tensor_idx], r.page_size_bytes)
                    for r in self.group_refs[copy.group]]
            for run in runs(copy, self.blocks_per_chunk):
                blocks = slice(run.paged_start, run.paged_start + run.length)
                subs = slice(run.sub_start, run.sub_start + run.length)
                for paged, host, size in refs:  # the un-padded page: what vLLM's worker copies
                    src, dst = paged[blocks, :size], host[run.chunk, subs, :size]
                    if not to_host:
                        src, dst = dst, src
                    np.copyto(dst, src)
                    nbytes += size * run.length
        self._finished.append(TransferResult(job_id=job_id, success=True, transfer_size=nbytes,
                                             transfer_time=time.perf_counter() - t0))
        return True

    # -- vLLM's OffloadingWorker -----------------------------------------------------------

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec,
                     dst_spec: LoadStoreSpec) -> bool:
        return self._copy(job_id, src_spec, dst_spec, to_host=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec,
                    dst_spec: GPULoadStoreSpec) -> bool:
        return self._copy(job_id, dst_spec, src_spec, to_host=False)

    def get_finished(self) -> list[TransferResult]:
        done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every submitted transfer has completed

    def shutdown(self) -> None:
        self._paged.clear()
        self._host.clear()
        if self._on_shutdown is not None:
            self._on_shutdown()
            self._on_shutdown = None
