"""The native-mode test harness: vLLM's offloading configs and keys, host KV tensors as
vLLM registers them, and one engine's scheduler half (vLLM's real tiering manager with
kvpool's tier) driven the way vLLM's OffloadingConnector drives it. Only the copy between
the paged KV cache and the primary tier's rows differs between the tests: written and read
directly (what vLLM's CUDA worker would move), or moved by kvpool's host-copy worker."""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from tests.connector.helpers import engine_configs

BLOCK_BYTES = 8192       # one worker's KV bytes per vLLM block
BLOCKS_PER_CHUNK = 4     # a chunk (one object) = 32 KiB
NUM_CHUNKS = 64
TIER_MODULE = "kvpool_connector.vllm_tiers"  # the module path configs name
NATIVE = {"spec_name": "KVPoolOffloadingSpec", "spec_module_path": "kvpool_connector.native"}

T = TypeVar("T")


def offloading_config(extra: dict, model: str = "test-model", dtype: str = "bfloat16",
                      block_bytes: int = BLOCK_BYTES, kv_events: bool = False) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=block_bytes,
        enable_kv_cache_events=kv_events,
        extra_config=extra,
        engine_id=f"kvpool-test-{uuid.uuid4().hex[:8]}",
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=BLOCKS_PER_CHUNK),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=True),
    )


def kvpool_tiering(tier_options: dict, host_bytes: int, tier_type: str = "kvpool") -> dict:
    """The `kv_connector_extra_config` of native offloading with a kvpool secondary tier."""
    return {"cpu_bytes_to_use": host_bytes,
            "secondary_tiers": [{"type": tier_type, "module_path": TIER_MODULE, **tier_options}]}


def chunk_keys(prefix: str, n: int) -> list[bytes]:
    """vLLM-style chained sha256 block hashes packed into OffloadKeys."""
    keys, parent = [], b""
    for i in range(n):
        parent = hashlib.sha256(parent + f"{prefix}:{i}".encode()).digest()
        keys.append(make_offload_key(parent, 0))
    return keys


def payloads(n: int) -> list[bytes]:
    return [os.urandom(BLOCK_BYTES * BLOCKS_PER_CHUNK) for _ in range(n)]


def poll(attempt: Callable[[], T | None], step: Callable[[], None], what: str,
         timeout: float = 20.0) -> T:
    """attempt() until it gives an answer (not None), with step() (vLLM's next schedule
    step) between tries, within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while (answer := attempt()) is None:
        assert time.monotonic() < deadline, f"{what} did not finish in {timeout}s"
        step()
        time.sleep(0.01)
    return answer


class PagedCache:
    """Host KV tensors as vLLM's OffloadingConnector registers them: one int8 `(num_blocks,
    page)` view per tensor; `unpadded[t]` bytes of each page are KV, the rest padding."""

    def __init__(self, pages: list[int], unpadded: list[int], num_blocks: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.tensors = [torch.randint(-128, 128, (num_blocks, p), dtype=torch.int8, generator=gen)
                        for p in pages]
        self.unpadded = unpadded

    def canonical(self, groups: list[list[int]]) -> CanonicalKVCaches:
        """`groups[g]`: the tensor indices of group g's layers."""
        return CanonicalKVCaches(
            tensors=[CanonicalKVCacheTensor(t, t.shape[1]) for t in self.tensors],
            group_data_refs=[[CanonicalKVCacheRef(i, self.unpadded[i]) for i in g]
                             for g in groups])


class SchedulerHalf:
    """One engine's TieringOffloadingManager (vLLM's primary host tier and its secondary
    tiers) driven as vLLM's OffloadingConnector drives it: per request, lookups in prefix
    order (RETRY and HIT_PENDING: ask again next step), then a store or a load, then the
    request's end. The copies between the paged cache and the primary rows are the
    subclass's: `copy_in` after prepare_store, `copy_out` after prepare_load."""

    def __init__(self, manager) -> None:
        self.manager = manager
        self.tier = manager.secondary_tiers[0]

    def step(self) -> None:
        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def settle(self, timeout: float = 20.0) -> None:
        """Until the cascade into the secondary tiers is done."""
        poll(lambda: None if self.manager.has_pending_work() else True, self.step,
             "the tier jobs", timeout)
        self.step()

    def _hits(self, keys: list, ctx: ReqContext, timeout: float) -> int:
        def attempt() -> int | None:
            for i, key in enumerate(keys):
                result = self.manager.lookup(key, ctx)
                if result is LookupResult.MISS:
                    return i
                if result is not LookupResult.HIT:
                    return None  # pending: the whole prefix is asked again next step
            return len(keys)

        return poll(attempt, self.step, "the lookups", timeout)

    def offload(self, keys: list, *copy_args: Any) -> None:
        """A request's prompt chunks: paged cache -> primary rows -> cascade."""
        ctx = ReqContext(req_id=uuid.uuid4().hex)
        self.manager.on_new_request(ctx)
        out = self.manager.prepare_store(keys, ctx)
        assert out is not None
        self.copy_in(out, *copy_args)
        self.manager.complete_store(out.keys_to_store, ctx)
        self.manager.on_request_finished(ctx)
        self.settle()

    def load(self, keys: list, *copy_args: Any, timeout: float = 20.0) -> tuple[int, Any]:
        """(chunks hit, what copy_out returned: None without hits)."""
        ctx = ReqContext(req_id=uuid.uuid4().hex)
        self.manager.on_new_request(ctx)
        hits, copied = self._hits(keys, ctx, timeout), None
        if hits:
            spec = self.manager.prepare_load(keys[:hits], ctx)
            copied = self.copy_out(spec, hits, *copy_args)
            self.manager.complete_load(keys[:hits], ctx)
        self.manager.on_request_finished(ctx)
        self.step()
        return hits, copied

    def copy_in(self, prepared, *args: Any) -> None:
        raise NotImplementedError

    def copy_out(self, load_spec, hits: int, *args: Any) -> Any:
        raise NotImplementedError


class RowEngine(SchedulerHalf):
    """The scheduler half with the primary rows written and read directly: exactly the bytes
    vLLM's CUDA worker (`CPUOffloadingWorker`) would move. Built from an `OffloadingConfig`
    directly or, with `engine_model`, by vLLM's OffloadingConnector from that model's real
    VllmConfig (the KV geometry of `offloading_config`)."""

    def __init__(self, tier_options: dict, tier_type: str = "kvpool",
                 engine_model: Path | None = None, hash_algo: str = "sha256",
                 model_kwargs: dict | None = None, lora: bool = False, **cfg_kwargs):
        extra = kvpool_tiering(tier_options, NUM_CHUNKS * BLOCK_BYTES * BLOCKS_PER_CHUNK,
                               tier_type)
        self.connector = None
        if engine_model is None:
            manager = TieringOffloadingSpec(offloading_config(extra, **cfg_kwargs)).get_manager()
        else:
            self.connector = scheduler_connector(extra, engine_model, hash_algo, lora=lora,
                                                 **(model_kwargs or {}))
            manager = self.connector.connector_scheduler.manager
        super().__init__(manager)
        self.rows = manager.primary_tier.get_kv_memoryview().cast("B")
        self.row_bytes = self.tier.block_size_bytes

    def row(self, chunk_id) -> memoryview:
        return self.rows[int(chunk_id) * self.row_bytes:(int(chunk_id) + 1) * self.row_bytes]

    def offload(self, keys: list[bytes], data: list[bytes]) -> None:
        super().offload(keys, dict(zip(keys, data, strict=True)))

    def copy_in(self, prepared, by_key: dict) -> None:
        for key, chunk_id in zip(prepared.keys_to_store, prepared.store_spec.block_ids, strict=True):
            self.row(chunk_id)[:] = by_key[key]

    def load(self, keys: list[bytes], timeout: float = 20.0) -> list[bytes]:
        """The bytes of the chunks a request would load (its hit prefix), as the primary
        rows hand them to the CUDA worker."""
        return super().load(keys, timeout=timeout)[1] or []

    def copy_out(self, load_spec, hits: int) -> list[bytes]:
        return [bytes(self.row(chunk_id)) for chunk_id in load_spec.block_ids]

    def close(self) -> None:
        self.rows.release()
        (self.connector or self.manager).shutdown()

    def __enter__(self) -> RowEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def scheduler_connector(extra: dict, model: Path, hash_algo: str = "sha256", lora: bool = False,
                        **model_kwargs):
    """vLLM's OffloadingConnector, scheduler role, built the way an engine builds it (the KV
    geometry of `offloading_config`: two layers of BLOCK_BYTES / 2 per block of 16 tokens)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    vllm_config, kv_cache_config = engine_configs(
        model, {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
                                              "block_size": 16 * BLOCKS_PER_CHUNK, **extra}},
        hash_algo, lora=lora, **model_kwargs)
    assert 2 * kv_cache_config.kv_cache_groups[0].kv_cache_spec.page_size_bytes == BLOCK_BYTES
    return OffloadingConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)


class NativeHalves(SchedulerHalf):
    """Both halves of one engine's native offloading, minus the model: the scheduler half
    with `KVPoolOffloadingSpec`'s manager and the worker half's HostCopyWorker, sharing
    vLLM's host region, over a paged cache of two layers of `page` bytes per block."""

    def __init__(self, tier_options: dict, seed: int, page: int = 4096, num_blocks: int = 32):
        from kvpool_connector.native import KVPoolOffloadingSpec
        from kvpool_connector.native.host_copy import HostCopyWorker

        extra = {**NATIVE, **kvpool_tiering(tier_options,
                                            NUM_CHUNKS * BLOCKS_PER_CHUNK * 2 * page)}
        cfg = offloading_config(extra, block_bytes=2 * page)
        self.paged = PagedCache([page, page], [page, page], num_blocks, seed)
        # two roles, two spec objects (as in an engine); the worker maps the region first
        self.worker = KVPoolOffloadingSpec(cfg).get_worker(self.paged.canonical([[0, 1]]))
        assert isinstance(self.worker, HostCopyWorker)
        super().__init__(KVPoolOffloadingSpec(cfg).get_manager())
        self.job = 0

    def _transfer(self, submit, *specs) -> None:
        self.job += 1
        assert submit(self.job, *specs)
        assert [r.job_id for r in self.worker.get_finished()] == [self.job]

    def load(self, keys: list[bytes], blocks: list[int], timeout: float = 20.0) -> int:
        """Chunks hit and loaded into the paged `blocks`."""
        return super().load(keys, blocks, timeout=timeout)[0]

    def copy_in(self, prepared, blocks: list[int]) -> None:
        assert len(prepared.keys_to_store) * BLOCKS_PER_CHUNK == len(blocks)
        self._transfer(self.worker.submit_store, GPULoadStoreSpec(blocks, [len(blocks)], [0]),
                       prepared.store_spec)

    def copy_out(self, load_spec, hits: int, blocks: list[int]) -> None:
        n = hits * BLOCKS_PER_CHUNK
        self._transfer(self.worker.submit_load, load_spec,
                       GPULoadStoreSpec(blocks[:n], [n], [0]))

    def close(self) -> None:
        self.manager.shutdown()
        self.worker.shutdown()
