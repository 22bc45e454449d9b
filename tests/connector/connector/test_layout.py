"""Chunk gather/scatter over the paged KV layouts of vLLM's attention backends.

Real torch tensors shaped and strided like each backend's registered caches (the backends
themselves need CUDA kernels that this machine cannot run).
"""

from __future__ import annotations

import pytest
import torch

from kvpool_connector.connector.layout import KVLayout, find_block_dim

NUM_BLOCKS = 12


def _cpu_attn():          # CPU backend: [B, heads, block_size, 2*head_size]
    return torch.randn(NUM_BLOCKS, 2, 16, 2 * 32)


def _flash_attn_legacy():  # K/V first: [2, B, block_size, heads, head_size]
    return torch.randn(2, NUM_BLOCKS, 16, 2, 32)


def _hnd_strided():        # logical [B, H, N, C], physically [B, N, H, C] (NHD memory)
    return torch.randn(NUM_BLOCKS, 16, 2, 64).permute(0, 2, 1, 3)


def _layer_outer():        # logical [B, H, N, C] viewed from an [H, B, N, C] allocation
    return torch.randn(2, NUM_BLOCKS, 16, 64).permute(1, 0, 2, 3)


def _mla():                # one latent per token: [B, N, C]
    return torch.randn(NUM_BLOCKS, 16, 576).to(torch.bfloat16)


def _kernel_split():       # manager block of 32 tokens split in 2 kernel blocks of 16
    return torch.randn(NUM_BLOCKS * 2, 2, 16, 64)


def _small_blocks():       # host blocks under layout._ROW_COPY_BYTES: gathered by np.take
    return torch.randn(NUM_BLOCKS, 1, 4, 16)


LAYOUTS = [_cpu_attn, _flash_attn_legacy, _hnd_strided, _layer_outer, _mla, _kernel_split,
           _small_blocks]


def _caches(make, n_layers=3):
    torch.manual_seed(0)
    return {f"model.layers.{i}.attn": make() for i in range(n_layers)}


@pytest.mark.parametrize("make", LAYOUTS, ids=lambda f: f.__name__.strip("_"))
def test_gather_then_scatter_restores_exactly_those_blocks(make):
    src = _caches(make)
    src_layout = KVLayout(src, list(src), NUM_BLOCKS, "TEST")
    ids = torch.tensor([7, 2, 9])
    buf = torch.empty(src_layout.chunk_nbytes(3), dtype=torch.uint8)
    src_layout.gather(ids, buf)

    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    dst_layout = KVLayout(dst, list(dst), NUM_BLOCKS, "TEST")
    assert dst_layout.fingerprint() == src_layout.fingerprint()
    new_ids = torch.tensor([0, 5, 11])
    dst_layout.scatter(buf, 3, [0, 1, 2], new_ids.tolist())
    for name in src:
        v2 = dst_layout.layers[dst_layout.layer_index(name)]
        v1 = src_layout.layers[src_layout.layer_index(name)]
        got = v2.tensor.index_select(v2.block_dim, new_ids)
        want = v1.tensor.index_select(v1.block_dim, ids)
        assert torch.equal(got, want)
        untouched = [b for b in range(NUM_BLOCKS) if b not in new_ids.tolist()]
        assert not v2.tensor.index_select(v2.block_dim, torch.tensor(untouched)).any()


def test_partial_rows_and_single_layer_scatter():
    src = _caches(_cpu_attn)
    src_layout = KVLayout(src, list(src), NUM_BLOCKS)
    buf = torch.empty(src_layout.chunk_nbytes(2), dtype=torch.uint8)
    src_layout.gather(torch.tensor([3, 4]), buf)
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    dst_layout = KVLayout(dst, list(dst), NUM_BLOCKS)
    dst_layout.scatter(buf, 2, [1], [8], layer=1)  # 2nd block, layer 1
    name1 = list(src)[1]
    assert torch.equal(dst[name1][8], src[name1][4])
    assert not dst[list(src)[0]].any() and not dst[list(src)[2]].any()
    assert dst[name1].count_nonzero() == src[name1][4].count_nonzero()


def test_payload_is_layer_major_one_contiguous_object():
    src = _caches(_cpu_attn, n_layers=2)
    layout = KVLayout(src, list(src), NUM_BLOCKS)
    buf = torch.empty(layout.chunk_nbytes(2), dtype=torch.uint8)
    layout.gather(torch.tensor([1, 6]), buf)
    per_layer = src["model.layers.0.attn"][0].numel() * 4 * 2
    first = buf[:per_layer].view(torch.float32).view(2, *src["model.layers.0.attn"].shape[1:])
    assert torch.equal(first[1], src["model.layers.0.attn"][6])


def test_fingerprint_differs_between_layouts_and_dtypes():
    fps = {KVLayout(_caches(m), list(_caches(m)), NUM_BLOCKS, "X").fingerprint() for m in LAYOUTS}
    # cpu_attn, hnd_strided and layer_outer share one logical shape: payloads are written
    # in logical order, so their bytes are interchangeable; the other three differ.
    assert len(fps) == len(LAYOUTS) - 2
    a = KVLayout(_caches(_cpu_attn), ["model.layers.0.attn"], NUM_BLOCKS, "CPU_ATTN")
    b = KVLayout(_caches(_cpu_attn), ["model.layers.0.attn"], NUM_BLOCKS, "FLASH_ATTN")
    assert a.fingerprint() != b.fingerprint()


def test_block_dim_discovery():
    assert find_block_dim((NUM_BLOCKS, 2, 16, 64), NUM_BLOCKS) == 0
    assert find_block_dim((2, NUM_BLOCKS, 16, 2, 32), NUM_BLOCKS) == 1
    assert find_block_dim((NUM_BLOCKS * 4, 2, 16, 64), NUM_BLOCKS) == 0
    with pytest.raises(ValueError, match="holds 12 blocks"):
        find_block_dim((2, 5, 7), NUM_BLOCKS)


def test_layers_sharing_one_tensor_are_stored_once():
    t = _cpu_attn()
    layout = KVLayout({"a": t, "b": t}, ["a", "b"], NUM_BLOCKS)
    assert len(layout.layers) == 1 and layout.layer_index("a") == 0


def test_payload_bytes_do_not_depend_on_physical_strides():
    """The fast path (blocks as contiguous rows) and the strided path write the same bytes."""
    logical = _caches(_cpu_attn)
    strided = {k: v.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3) for k, v in logical.items()}
    a, b = (KVLayout(c, list(c), NUM_BLOCKS) for c in (logical, strided))
    assert a.layers[0].flat is not None and b.layers[0].flat is None
    ids = torch.tensor([4, 0, 10])
    pa, pb = (torch.empty(a.chunk_nbytes(3), dtype=torch.uint8) for _ in range(2))
    a.gather(ids, pa)
    b.gather(ids, pb)
    assert torch.equal(pa, pb)
    b.scatter(pa, 3, [0, 1, 2], [1, 2, 3])  # a payload of one path loads into the other
    for k in logical:
        assert torch.equal(strided[k][1:4], logical[k][ids])

