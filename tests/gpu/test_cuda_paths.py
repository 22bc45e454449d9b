"""The connector's CUDA paths on a real GPU: chunk gather/scatter over CUDA-resident caches
of the layouts vLLM's CUDA backends register, and the worker half's saves (gathered on its
copy stream into pinned buffers, stored on the saver thread) and loads (async on the
loader thread, sync in the step, layer by layer) against a real store, every byte compared.

CI has no GPU: these are skipped there (`pytest -m cuda` on a GPU machine runs them; the
command is in docs/development.md). They need the connector, torch with CUDA and the
store's libraries, not vLLM: where vLLM does not import, tests/gpu/vllm_shim.py supplies
the four base classes of vLLM's that the worker half subclasses.
"""

from __future__ import annotations

import os
import secrets
import time

import pytest
import torch

from tests.gpu import vllm_shim

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")]

vllm_shim.install()

from kvpool_connector.connector.layout import KVLayout  # noqa: E402
from kvpool_connector.connector.metadata import (  # noqa: E402
    ChunkLoad,
    KVPoolMetadata,
    LoadJob,
    SaveJob,
)
from kvpool_connector.connector.worker import WorkerSide  # noqa: E402
from kvpool_connector.store import open_store  # noqa: E402

NUM_BLOCKS, BPC, BLOCK = 16, 2, 16
KEY_ENV = "KVPOOL_GPU_TEST_POOL_KEY"


def _rand(shape, dtype):
    """Random bytes viewed as `dtype` on the GPU (every bit pattern, NaNs included: the
    comparisons are of bytes)."""
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * size), dtype=torch.uint8,
                        device="cuda")
    return raw.view(dtype)


def _flash_attn(dtype):     # vLLM's FlashAttention on CUDA: [2, B, block_size, heads, head]
    return _rand((2, NUM_BLOCKS, BLOCK, 4, 64), dtype)


def _flashinfer(dtype):     # FlashInfer: [B, 2, block_size, heads, head]
    return _rand((NUM_BLOCKS, 2, BLOCK, 4, 64), dtype)


def _hnd(dtype):            # an HND view of NHD memory: strided inner dims
    return _rand((NUM_BLOCKS, 2, BLOCK, 4, 64), dtype).permute(0, 1, 3, 2, 4)


def _mla(dtype):            # MLA: one latent per token, [B, block_size, 576]
    return _rand((NUM_BLOCKS, BLOCK, 576), dtype)


def _kernel_split(dtype):   # a manager block split into two kernel blocks
    return _rand((NUM_BLOCKS * 2, 2, BLOCK // 2, 4, 64), dtype)


LAYOUTS = [_flash_attn, _flashinfer, _hnd, _mla, _kernel_split]


# uint8: vLLM's fp8 KV caches are registered as uint8 tensors
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.uint8], ids=str)
@pytest.mark.parametrize("make", LAYOUTS, ids=lambda f: f.__name__.strip("_"))
def test_gather_then_scatter_on_cuda_moves_exactly_those_blocks(make, dtype):
    """Device caches -> pinned host bytes -> other blocks of zeroed caches: those blocks
    equal the originals bit for bit, no other block is touched, and the bytes do not depend
    on the physical layout (the host payload equals the CPU path's for the same blocks)."""
    torch.manual_seed(0)
    src = {f"layer.{i}": make(dtype) for i in range(3)}
    layout = KVLayout(src, list(src), NUM_BLOCKS, "CUDA-TEST")
    ids = torch.tensor([7, 2, 9, 14])
    buf = torch.empty(layout.chunk_nbytes(4), dtype=torch.uint8, pin_memory=True)
    layout.gather(ids, buf)
    torch.cuda.synchronize()
    cpu = {k: v.cpu() for k, v in src.items()}
    cpu_buf = torch.empty_like(buf, pin_memory=False)
    KVLayout(cpu, list(cpu), NUM_BLOCKS, "CUDA-TEST").gather(ids, cpu_buf)
    assert torch.equal(buf, cpu_buf)

    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    dst_layout = KVLayout(dst, list(dst), NUM_BLOCKS, "CUDA-TEST")
    new_ids = [0, 5, 11, 15]
    dst_layout.scatter(buf, 4, [0, 1, 2, 3], new_ids)
    torch.cuda.synchronize()
    for name in src:
        v1, v2 = (lay.layers[lay.layer_index(name)] for lay in (layout, dst_layout))
        got = v2.tensor.index_select(v2.block_dim, torch.tensor(new_ids, device="cuda"))
        want = v1.tensor.index_select(v1.block_dim, ids.cuda())
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        rest = torch.tensor([b for b in range(NUM_BLOCKS) if b not in new_ids], device="cuda")
        assert not v2.tensor.index_select(v2.block_dim, rest).view(torch.uint8).any()
    # a subset of the payload's rows (the rest of the chunk was in vLLM's own cache), and a
    # short payload (a tail of 3 blocks): only those rows land, where they are sent
    short = torch.empty(layout.chunk_nbytes(3), dtype=torch.uint8, pin_memory=True)
    layout.gather(ids[:3], short)
    for payload, n, rows, to in ((buf, 4, [1, 3], [4, 12]), (short, 3, [2], [13])):
        dst_layout.scatter(payload, n, rows, to)
        torch.cuda.synchronize()
        for name in src:
            v1, v2 = (lay.layers[lay.layer_index(name)] for lay in (layout, dst_layout))
            got = v2.tensor.index_select(v2.block_dim, torch.tensor(to, device="cuda"))
            want = v1.tensor.index_select(v1.block_dim, ids[rows].cuda())
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    # an index out of range is this load's IndexError, not a device assert that would
    # poison the process's CUDA context
    for rows, to in (([0], [NUM_BLOCKS]), ([4], [1]), ([0, 1], [2, 2])):
        with pytest.raises(IndexError):
            dst_layout.scatter(buf, 4, rows, to)
    torch.cuda.synchronize()  # the context is still good


@pytest.fixture
def gpu_pool_key():
    os.environ[KEY_ENV] = secrets.token_urlsafe(32)
    yield
    os.environ.pop(KEY_ENV, None)


def _worker(tiers, layerwise=False):
    torch.manual_seed(1)
    caches = {f"layer.{i}": _rand((2, NUM_BLOCKS, BLOCK, 4, 64), torch.bfloat16)
              for i in range(4)}
    layout = KVLayout(caches, list(caches), NUM_BLOCKS, "CUDA-TEST")
    store = open_store({"namespace": "gpu-test", "security": {"key_env": KEY_ENV},
                        "tiers": tiers}, layout=layout.fingerprint().encode())
    side = WorkerSide(store, blocks_per_chunk=BPC, layerwise=layerwise, block_size=BLOCK)
    side.register(layout)
    assert side.cuda and side.copy_stream is not None
    return side, store, caches


SLOW = 400_000_000  # GPU cycles (~0.2 s): a stream held this long shows a missing wait


def _blocks(caches, ids):
    return [c[:, ids].clone() for c in caches.values()]


def _saved(side, store, keys, timeout=30.0):
    """Wait for the saver thread to have stored every key (a condition, not a sleep)."""
    deadline = time.monotonic() + timeout
    stored: list[bytes] = []
    while set(stored) < set(keys) and time.monotonic() < deadline:
        side.get_finished(KVPoolMetadata(idle=True))
        meta = side.worker_meta()  # None: nothing to report this step
        stored += meta.stored_keys if meta else []
    assert set(stored) >= set(keys), f"saved {len(stored)} of {len(keys)}"
    assert store.flush(timeout)


def _loaded(side, req, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if req in side.get_finished(KVPoolMetadata(idle=True))[1]:
            return
    raise AssertionError(f"{req} never finished loading")


@pytest.mark.parametrize("tiers", ["cpu", "cpu+disk"])
def test_worker_saves_and_loads_back_bit_for_bit_on_cuda(tiers, tmp_path, gpu_pool_key):
    """Saves gathered on the copy stream (the forward's writes waited for) and stored by
    the saver thread; loads back into other blocks: async (loader thread), sync (in the
    step) and, with a disk tier, from disk after the cpu tier lost them."""
    cfg = [{"type": "cpu", "size": "64Mi"}]
    if tiers == "cpu+disk":
        cfg.append({"type": "disk", "path": str(tmp_path), "size": "64Mi"})
    side, store, caches = _worker(cfg)
    # a first save, so that every kernel below is loaded (CUDA loads a kernel's module at
    # its first launch, which can order streams that nothing else orders)
    for c in caches.values():
        c[:, 14:16].view(torch.int16).bitwise_xor_(0x5A5A)
    side.submit_saves(KVPoolMetadata(saves=[SaveJob("w0", [b"z" * 16], [[14, 15]])]))
    _saved(side, store, [b"z" * 16])
    # the forward's last kernels write blocks 0..3 on the compute stream, late (the stream
    # is held first): a gather that did not wait for the compute stream reads the old bytes
    want = [b.view(torch.int16).bitwise_xor(0x5A5A).view(torch.bfloat16)
            for b in _blocks(caches, slice(0, 4))]
    torch.cuda.synchronize()
    torch.cuda._sleep(SLOW)
    for c in caches.values():
        c[:, 0:4].view(torch.int16).bitwise_xor_(0x5A5A)
    keys = [b"a" * 16, b"b" * 16]
    side.submit_saves(KVPoolMetadata(saves=[SaveJob("w", keys, [[0, 1], [2, 3]])]))
    _saved(side, store, keys)
    if tiers == "cpu+disk":  # the cpu tier lost them: the disk serves, via the loader
        store.runners[0].tier.delete_many(store.object_names(keys))
    load = LoadJob("r", [ChunkLoad(keys[0], rows=[0, 1], block_ids=[8, 9]),
                         ChunkLoad(keys[1], rows=[0, 1], block_ids=[10, 11])], is_async=True)
    side.submit_loads(KVPoolMetadata(loads=[load]))
    _loaded(side, "r")
    torch.cuda.synchronize()
    assert side.take_load_errors() == set()
    for got, exp in zip(_blocks(caches, slice(8, 12)), want, strict=True):
        assert torch.equal(got.view(torch.uint8), exp.view(torch.uint8))
    if tiers == "cpu":  # a sync load in the step: in its blocks before the forward reads
        sync = LoadJob("s", [ChunkLoad(keys[1], rows=[0, 1], block_ids=[12, 13])],
                       is_async=False)
        with torch.cuda.stream(side.copy_stream):  # the copy stream busy: the forward
            torch.cuda._sleep(SLOW)                # must still see the scattered blocks
        side.submit_loads(KVPoolMetadata(loads=[sync]))
        side.finish_sync_loads()
        torch.cuda.current_stream().synchronize()  # what the forward's stream has done
        assert side.take_load_errors() == set()
        for got, exp in zip(_blocks(caches, slice(12, 14)), want, strict=True):
            assert torch.equal(got.view(torch.uint8), exp[:, 2:4].view(torch.uint8))
    side.shutdown()
    store.close()


def test_layerwise_loads_land_layer_by_layer_on_cuda(gpu_pool_key):
    """A sync load with layerwise on runs on the loader thread layer by layer while the
    forward starts; wait_layer(name): that layer's blocks are in place when it returns (what
    the attention of that layer reads next on the compute stream)."""
    side, store, caches = _worker([{"type": "cpu", "size": "64Mi"}], layerwise=True)
    want = _blocks(caches, slice(0, 2))
    side.submit_saves(KVPoolMetadata(saves=[SaveJob("w", [b"c" * 16], [[0, 1]])]))
    _saved(side, store, [b"c" * 16])
    load = LoadJob("r", [ChunkLoad(b"c" * 16, rows=[0, 1], block_ids=[6, 7])], is_async=False)
    with torch.cuda.stream(side.copy_stream):  # the copies queued behind a busy stream:
        torch.cuda._sleep(SLOW)                # wait_layer must order the reads after them
    side.submit_loads(KVPoolMetadata(loads=[load]))
    assert side.loads.sync_loads and side.loads.sync_loads[0].layer_done  # layer by layer, in flight
    for i, name in enumerate(caches):
        side.wait_layer(name)
        got = caches[name][:, 6:8].clone()  # on the compute stream, as attention reads
        torch.cuda.current_stream().synchronize()
        assert torch.equal(got.view(torch.uint8), want[i].view(torch.uint8)), name
    side.finish_sync_loads()
    assert side.take_load_errors() == set()
    side.shutdown()
    store.close()
