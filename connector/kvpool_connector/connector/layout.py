"""Where the KV of one block lives in vLLM's paged caches, for any attention backend.

vLLM registers one tensor per attention layer. Its block dimension is found from the tensor
and the block count of the KV cache config, not assumed: the standardized per-layer view is
logical `[B, H, N, C]` (CPU backend: `[B, heads, block_size, 2*head_size]`; MLA: one latent
per token, H == 1), older CUDA layouts put K/V first (`[2, B, ...]`), and kernel-block
splitting makes B a multiple of the manager's block count. Whatever the strides (NHD/HND,
layer-outer or block-outer), `index_select` along the block dimension yields the blocks in
logical order, so the stored bytes do not depend on the physical memory layout; the backend
and shapes still go into the fingerprint so one layout is never read as another.

A chunk's payload is one contiguous buffer: for each layer in order, that layer's blocks of
the chunk (`index_select` output). All layers of a chunk are one object: one large transfer.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class LayerView:
    name: str
    tensor: torch.Tensor  # the registered cache, kernel blocks grouped per manager block
    block_dim: int
    block_shape: tuple[int, ...]  # shape of one block's slice (block dim removed)
    # [num_blocks, words] view when each block is one contiguous run (fast path), else None
    flat: torch.Tensor | None = None
    # the same memory as a numpy array, for caches in host memory (see KVLayout.gather)
    flat_np: np.ndarray | None = None

    @property
    def block_bytes(self) -> int:
        return math.prod(self.block_shape) * self.tensor.element_size()

    def gathered_shape(self, n: int) -> tuple[int, ...]:
        s = list(self.block_shape)
        s.insert(self.block_dim, n)
        return tuple(s)


def find_block_dim(shape: tuple[int, ...], num_blocks: int) -> int:
    """The dimension indexing blocks: dim 0 in vLLM's standardized view, else the first
    dimension whose size is a whole multiple of the block count (kernel-block splits)."""
    if shape and shape[0] >= num_blocks and shape[0] % num_blocks == 0:
        return 0
    for d, size in enumerate(shape):
        if size >= num_blocks and size % num_blocks == 0:
            return d
    raise ValueError(f"no dimension of KV cache shape {tuple(shape)} holds {num_blocks} blocks")


def layer_view(name: str, t: torch.Tensor, num_blocks: int) -> LayerView:
    d = find_block_dim(tuple(t.shape), num_blocks)
    ratio = t.shape[d] // num_blocks
    if ratio > 1:  # kernel blocks: group them under their manager block
        t = t.unflatten(d, (num_blocks, ratio))
    shape = list(t.shape)
    del shape[d]
    flat = _flat_view(t, d)
    flat_np = flat.numpy() if flat is not None and flat.device.type == "cpu" else None
    return LayerView(name, t, d, tuple(shape), flat, flat_np)


def _flat_view(t: torch.Tensor, block_dim: int) -> torch.Tensor | None:
    """Blocks as rows of machine words, when every block is one contiguous run in logical
    order: whole-block copies then run at memcpy speed (element-typed, 4-D index_select is
    an order of magnitude slower on CPU)."""
    if block_dim != 0:
        return None
    try:
        rows = t.view(t.shape[0], -1).view(torch.uint8)
    except RuntimeError:  # inner dims strided (e.g. NHD memory behind an HND view)
        return None
    for dt in (torch.int64, torch.int32, torch.int16):
        try:
            return rows.view(dt)
        except RuntimeError:
            continue
    return rows


# Host blocks at least this large are gathered one row copy at a time: np.take copies an
# [n, words] array item by item, 2x slower than a memcpy per row for 32 KiB rows (16 scattered
# blocks x 32 layers: 1.9 ms against 1.0 ms on epyc-zen5-2core); below ~8 KiB the Python loop
# costs more than it saves.
_ROW_COPY_BYTES = 8 << 10


class KVLayout:
    """Gather/scatter of whole chunks between the paged caches and flat byte buffers."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], layer_names: list[str],
                 num_blocks: int, backend: str = "unknown"):
        names = [n for n in layer_names if n in kv_caches] or list(kv_caches)
        # Layers sharing one tensor (cross-layer KV sharing) are stored once.
        seen: dict[int, str] = {}
        self.layers: list[LayerView] = []
        for n in names:
            t = kv_caches[n]
            key = t.data_ptr()
            if key in seen:
                continue
            seen[key] = n
            self.layers.append(layer_view(n, t, num_blocks))
        if not self.layers:
            raise ValueError("no KV cache tensors registered")
        self.num_blocks = num_blocks
        self.backend = backend
        self.dtype = self.layers[0].tensor.dtype
        self.device = self.layers[0].tensor.device
        self.block_bytes = sum(layer_kv.block_bytes for layer_kv in self.layers)
        self._index = {layer_kv.name: i for i, layer_kv in enumerate(self.layers)}

    def fingerprint(self) -> str:
        """Everything that decides how to interpret a payload's bytes: the backend, each
        layer's dtype and block shape, and which layers they are (a digest of their names:
        two pipeline stages with alike layers hold different ones)."""
        names = hashlib.sha256("\n".join(v.name for v in self.layers).encode()).hexdigest()
        parts = [f"backend={self.backend}", f"layers={names[:32]}"]
        for layer_kv in self.layers:
            shape = "x".join(map(str, layer_kv.block_shape))
            parts.append(f"{layer_kv.tensor.dtype}:{layer_kv.block_dim}:{shape}")
        return "kvlayout-v2;" + ";".join(parts)

    def layer_index(self, name: str) -> int | None:
        return self._index.get(name)

    def chunk_nbytes(self, n_blocks: int) -> int:
        return self.block_bytes * n_blocks

    def _segments(self, buf: torch.Tensor, n: int):
        """Per-layer typed views of a flat uint8 buffer holding `n` blocks per layer."""
        off = 0
        for layer_kv in self.layers:
            nbytes = layer_kv.block_bytes * n
            typed = buf[off:off + nbytes].view(layer_kv.tensor.dtype)
            yield layer_kv, typed.view(layer_kv.gathered_shape(n))
            off += nbytes

    @property
    def host_flat(self) -> bool:
        """Every layer is a host cache of whole-block rows: numpy copies (gather, scatter,
        scatter_bytes) apply."""
        return all(v.flat_np is not None for v in self.layers)

    def _np_segments(self, buf: torch.Tensor | np.ndarray, n: int):
        """Per-layer numpy views `[n, words]` of a flat uint8 host buffer (layers with a
        flat_np view only)."""
        raw = buf if isinstance(buf, np.ndarray) else buf.numpy()
        off = 0
        for layer_kv in self.layers:
            nbytes = layer_kv.block_bytes * n
            assert layer_kv.flat_np is not None  # callers check every layer has one
            yield layer_kv, raw[off:off + nbytes].view(layer_kv.flat_np.dtype).reshape(n, -1)
            off += nbytes

    def gather(self, block_ids: torch.Tensor, out: torch.Tensor) -> None:
        """Copy blocks (all layers) into `out`, a flat uint8 buffer of chunk_nbytes(n).

        Host caches copy with numpy, one single-threaded memcpy per layer (a slice when the
        blocks are adjacent, else `take`): torch's index_select hands every copy to the
        intra-op thread pool the forward pass keeps busy, ~2x slower per chunk on 2 shared
        cores, ~7x for the per-block copies of scatter."""
        n = len(block_ids)
        if out.device.type == "cpu" and self.host_flat:
            ids = block_ids.numpy()
            first = int(ids[0]) if n else 0
            adjacent = n > 0 and bool((ids == np.arange(first, first + n)).all())
            rows = ids.tolist()
            for layer_kv, dst in self._np_segments(out, n):
                src = layer_kv.flat_np
                if adjacent:
                    np.copyto(dst, src[first:first + n])
                elif layer_kv.block_bytes >= _ROW_COPY_BYTES:
                    for j, b in enumerate(rows):  # one memcpy per block (see _ROW_COPY_BYTES)
                        dst[j] = src[b]
                else:
                    np.take(src, ids, axis=0, out=dst)
            return
        idx = block_ids.to(self.device, non_blocking=True)
        for layer_kv, segment in self._segments(out, n):
            if layer_kv.flat is not None and segment.device == layer_kv.flat.device:
                torch.index_select(layer_kv.flat, 0, idx,
                                   out=segment.view(layer_kv.flat.dtype).view(n, -1))
            elif layer_kv.flat is not None:  # device cache -> pinned host buffer
                segment.view(layer_kv.flat.dtype).view(n, -1).copy_(
                    layer_kv.flat.index_select(0, idx), non_blocking=True)
            else:
                segment.copy_(layer_kv.tensor.index_select(layer_kv.block_dim, idx),
                              non_blocking=True)

    def scatter(self, src: torch.Tensor, n_in_src: int, rows: list[int],
                block_ids: list[int], layer: int | None = None) -> None:
        """Copy blocks `rows` (positions within the payload) of a payload holding
        `n_in_src` blocks into the paged caches at `block_ids`; one layer or all."""
        if src.device.type == "cpu" and self.host_flat:
            self._scatter_np(src, n_in_src, rows, block_ids, layer)
            return
        if self.device.type != "cpu":
            self._scatter_device(src, n_in_src, rows, block_ids, layer)
            return
        for i, (layer_kv, segment) in enumerate(self._segments(src, n_in_src)):
            if layer is not None and i != layer:
                continue
            if layer_kv.flat is not None:
                words = segment.view(layer_kv.flat.dtype).view(n_in_src, -1)
                for j, b in zip(rows, block_ids, strict=True):
                    layer_kv.flat[b].copy_(words[j], non_blocking=True)
            else:
                for j, b in zip(rows, block_ids, strict=True):
                    layer_kv.tensor.select(layer_kv.block_dim, b).copy_(
                        segment.select(layer_kv.block_dim, j), non_blocking=True)


    def scatter_bytes(self, raw: np.ndarray, n_in_src: int, rows: list[int],
                      block_ids: list[int]) -> None:
        """scatter, all layers, from a flat uint8 numpy array of a payload in host memory
        (a store's own bytes, read in place: no buffer in between); host_flat layouts only."""
        assert self.host_flat, "scatter_bytes needs a host cache of whole-block rows"
        self._scatter_np(raw, n_in_src, rows, block_ids, None)

    def _scatter_device(self, src: torch.Tensor, n_in_src: int, rows: list[int],
                        block_ids: list[int], layer: int | None) -> None:
        """Caches on a device: each layer's segment crosses in one copy (a contiguous run of
        the payload) and lands with one index_copy_ along the block dimension. Copying block
        by block instead was one small, strided host->device copy per block and layer (512
        for a 256-token chunk of a 32-layer model): 1.3 GB/s on an H200 against 52 GB/s for
        the same bytes in one copy (`kvpool bench copy`). The device holds one layer's
        segment at a time (two with a subset of rows), not the chunk. Asynchronous on the
        current stream (the worker's copy stream): the caller keeps `src` alive until that
        stream is synchronized."""
        if not rows:
            return
        # bounds checked here: on a device an index out of range is an asynchronous assert
        # that poisons the process's CUDA context, not an IndexError for this one load
        if len(rows) != len(block_ids) or len(set(block_ids)) != len(block_ids):
            raise IndexError("scatter: rows and block_ids differ in length or repeat a block")
        if min(rows) < 0 or max(rows) >= n_in_src or min(block_ids) < 0 \
                or max(block_ids) >= self.num_blocks:
            raise IndexError(f"scatter: a row outside 0..{n_in_src - 1} or a block outside "
                             f"0..{self.num_blocks - 1}")
        pinned = self.device.type == "cuda"  # a pinned index crosses without a staging sync
        dst = torch.tensor(block_ids, dtype=torch.long, pin_memory=pinned).to(
            self.device, non_blocking=True)
        pick = (None if list(rows) == list(range(n_in_src))
                else torch.tensor(rows, dtype=torch.long, pin_memory=pinned).to(
                    self.device, non_blocking=True))
        for i, (layer_kv, segment) in enumerate(self._segments(src, n_in_src)):
            if layer is not None and i != layer:
                continue
            part = segment.to(self.device, non_blocking=True)
            if pick is not None:
                part = part.index_select(layer_kv.block_dim, pick)
            layer_kv.tensor.index_copy_(layer_kv.block_dim, dst, part)

    def _scatter_np(self, src: torch.Tensor | np.ndarray, n_in_src: int, rows: list[int],
                    block_ids: list[int], layer: int | None) -> None:
        if not rows:
            return
        dst_ids = np.asarray(block_ids, dtype=np.int64)
        src_rows = (None if list(rows) == list(range(n_in_src))
                    else np.asarray(rows, dtype=np.int64))
        for i, (layer_kv, words) in enumerate(self._np_segments(src, n_in_src)):
            if layer is None or i == layer:  # one numpy copy per layer (see gather)
                layer_kv.flat_np[dst_ids] = words if src_rows is None else words[src_rows]


def spec_fingerprint(kv_cache_config, model: str) -> str:
    """What the scheduler and every worker know alike about the KV layout, before any tensor
    exists: used inside chunk keys so all of them compute the same keys. Per group its spec,
    not its layers: a pipeline stage's workers and the scheduler (which vLLM gives stage
    0's config) list different layers; which layers a worker holds is in its stored
    objects' layout (KVLayout.fingerprint) and its rank key (keys.py)."""
    groups = kv_cache_config.kv_cache_groups
    parts = [f"model={model}", f"layout={getattr(kv_cache_config, 'kv_cache_layout', None)}"]
    for g in groups:
        s = g.kv_cache_spec
        specs = getattr(s, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs, in a worker
        if isinstance(specs, dict) and specs:
            s = next(iter(specs.values()))  # what vLLM gives the scheduler in its place
        fields = [type(s).__name__]
        for attr in ("block_size", "num_kv_heads", "head_size", "head_size_v", "dtype",
                     "cache_dtype_str", "page_size_bytes"):
            if hasattr(s, attr):
                with contextlib.suppress(Exception):  # a property that does not apply to this spec
                    fields.append(f"{attr}={getattr(s, attr)}")
        parts.append(",".join(fields))
    return ";".join(parts)
