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

Hybrid models (vLLM's hybrid KV cache manager: one KV cache group per attention type, e.g.
sliding-window beside full attention) give each group its own block ids in one shared block
pool, and layers of different groups share one tensor. A payload then holds, group after
group, each group's layers at that group's blocks; the block ids of a chunk's n positions
are passed group-major (n ids of group 0, then n of group 1, ...) and a load's rows count
group-major too (row g * n + j: position j of group g), so one list of ints still names
them. A sliding-window group stores only the last `keep` positions of an object (the blocks
a hit ending at or after the object's end can read: block_groups.window_blocks); its other
positions' ids are ignored and loading one of them is an error. A group that is one layer
in a single-group model keeps today's bytes exactly.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Sequence
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


def _as_groups(layer_names: Sequence[str] | Sequence[Sequence[str]]) -> list[list[str]]:
    """One group of names, or a list of groups (vLLM's kv_cache_groups' layer names)."""
    if layer_names and not isinstance(layer_names[0], str):
        return [list(g) for g in layer_names]
    return [list(layer_names)]  # type: ignore[arg-type]


class KVLayout:
    """Gather/scatter of whole chunks between the paged caches and flat byte buffers.
    `layer_names`: the layers of the one KV cache group, or a list of groups' layers
    (hybrid models; see the module's docstring)."""

    def __init__(self, kv_caches: dict[str, torch.Tensor],
                 layer_names: Sequence[str] | Sequence[Sequence[str]],
                 num_blocks: int, backend: str = "unknown",
                 keep: Sequence[int | None] | None = None):
        groups = _as_groups(layer_names)
        # per group: the last positions of an object it stores (None: all of them)
        self.keep: list[int | None] = list(keep) if keep is not None else [None] * len(groups)
        if len(self.keep) != len(groups) or any(k is not None and k < 1 for k in self.keep):
            raise ValueError(f"keep {self.keep} does not give {len(groups)} groups a count")
        if len(groups) == 1:
            groups = [[n for n in groups[0] if n in kv_caches] or list(kv_caches)]
        self.groups: list[list[LayerView]] = []
        for names in groups:
            # Layers sharing one tensor within a group (cross-layer KV sharing) are stored
            # once; across groups a shared tensor is the hybrid manager's: other blocks.
            seen: set[int] = set()
            views = []
            for n in names:
                if n not in kv_caches or kv_caches[n].data_ptr() in seen:
                    continue
                seen.add(kv_caches[n].data_ptr())
                views.append(layer_view(n, kv_caches[n], num_blocks))
            self.groups.append(views)
        self.layers: list[LayerView] = [v for g in self.groups for v in g]
        # the group of each layer of self.layers, in order
        self._group_of = [g for g, views in enumerate(self.groups) for _ in views]
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
        if len(self.groups) > 1:  # a single group keeps its fingerprint (stored objects)
            parts.append("groups=" + ",".join(str(len(g)) for g in self.groups))
        if any(k is not None for k in self.keep):
            parts.append("keep=" + ",".join("all" if k is None else str(k) for k in self.keep))
        for layer_kv in self.layers:
            shape = "x".join(map(str, layer_kv.block_shape))
            parts.append(f"{layer_kv.tensor.dtype}:{layer_kv.block_dim}:{shape}")
        return "kvlayout-v2;" + ";".join(parts)

    def layer_index(self, name: str) -> int | None:
        return self._index.get(name)

    def chunk_nbytes(self, n_blocks: int) -> int:
        """Bytes of a payload of `n_blocks` positions (every group's blocks it keeps)."""
        if all(k is None for k in self.keep):
            return self.block_bytes * n_blocks
        return sum(v.block_bytes * self.kept(self._group_of[i], n_blocks)
                   for i, v in enumerate(self.layers))

    def kept(self, group: int, n: int) -> int:
        """Positions group `group` stores of an object of `n` (its last ones)."""
        k = self.keep[group]
        return n if k is None else min(n, k)

    def positions(self, n_ids: int) -> int:
        """Positions (blocks per group) named by `n_ids` group-major block ids."""
        return n_ids // len(self.groups)

    def by_group(self, rows: Sequence[int], block_ids: Sequence[int], n_in_src: int
                 ) -> list[tuple[list[int], list[int]]]:
        """(rows within the group, block ids) of each group, from group-major rows."""
        out: list[tuple[list[int], list[int]]] = [([], []) for _ in self.groups]
        for row, b in zip(rows, block_ids, strict=True):
            g, j = divmod(row, n_in_src)
            if g >= len(self.groups):
                raise IndexError(f"row {row} outside the payload's {len(self.groups)} groups "
                                 f"of {n_in_src} blocks")
            out[g][0].append(j)
            out[g][1].append(b)
        return out

    def _segments(self, buf: torch.Tensor, n: int):
        """Per-layer typed views of a flat uint8 buffer of `n` positions (each layer's
        group's kept blocks of them)."""
        off = 0
        for i, layer_kv in enumerate(self.layers):
            k = self.kept(self._group_of[i], n)
            nbytes = layer_kv.block_bytes * k
            typed = buf[off:off + nbytes].view(layer_kv.tensor.dtype)
            yield layer_kv, typed.view(layer_kv.gathered_shape(k))
            off += nbytes

    def group_of(self, layer: int) -> int:
        """The KV cache group of layer `layer` (an index into self.layers)."""
        return self._group_of[layer]

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
        for i, layer_kv in enumerate(self.layers):
            k = self.kept(self._group_of[i], n)
            nbytes = layer_kv.block_bytes * k
            assert layer_kv.flat_np is not None  # callers check every layer has one
            yield layer_kv, raw[off:off + nbytes].view(layer_kv.flat_np.dtype).reshape(k, -1)
            off += nbytes

    def _ids_by_group(self, block_ids: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
        """(positions, each group's ids) of group-major block ids."""
        n = self.positions(len(block_ids))
        if len(block_ids) != n * len(self.groups):
            raise ValueError(f"{len(block_ids)} block ids for {len(self.groups)} KV cache "
                             "groups: not a whole number per group")
        return n, [block_ids[(g + 1) * n - self.kept(g, n):(g + 1) * n]
                   for g in range(len(self.groups))]

    def gather(self, block_ids: torch.Tensor, out: torch.Tensor) -> None:
        """Copy blocks (all layers) into `out`, a flat uint8 buffer of chunk_nbytes(n);
        `block_ids`: n per group, group-major.

        Host caches copy with numpy, one single-threaded memcpy per layer (a slice when the
        blocks are adjacent, else `take`): torch's index_select hands every copy to the
        intra-op thread pool the forward pass keeps busy, ~2x slower per chunk on 2 shared
        cores, ~7x for the per-block copies of scatter."""
        n, per_group = self._ids_by_group(block_ids)
        if out.device.type == "cpu" and self.host_flat:
            plans = []
            for ids_t in per_group:
                ids = ids_t.numpy()
                k = len(ids)
                first = int(ids[0]) if k else 0
                adjacent = k > 0 and bool((ids == np.arange(first, first + k)).all())
                plans.append((ids, first, adjacent, ids.tolist()))
            for i, (layer_kv, dst) in enumerate(self._np_segments(out, n)):
                ids, first, adjacent, rows = plans[self._group_of[i]]
                src = layer_kv.flat_np
                if adjacent:
                    np.copyto(dst, src[first:first + len(rows)])
                elif layer_kv.block_bytes >= _ROW_COPY_BYTES:
                    for j, b in enumerate(rows):  # one memcpy per block (see _ROW_COPY_BYTES)
                        dst[j] = src[b]
                else:
                    np.take(src, ids, axis=0, out=dst)
            return
        idx = [ids.to(self.device, non_blocking=True) for ids in per_group]
        for i, (layer_kv, segment) in enumerate(self._segments(out, n)):
            g_idx = idx[self._group_of[i]]
            k = len(g_idx)
            if layer_kv.flat is not None and segment.device == layer_kv.flat.device:
                torch.index_select(layer_kv.flat, 0, g_idx,
                                   out=segment.view(layer_kv.flat.dtype).view(k, -1))
            elif layer_kv.flat is not None:  # device cache -> pinned host buffer
                segment.view(layer_kv.flat.dtype).view(k, -1).copy_(
                    layer_kv.flat.index_select(0, g_idx), non_blocking=True)
            else:
                segment.copy_(layer_kv.tensor.index_select(layer_kv.block_dim, g_idx),
                              non_blocking=True)

    def _parts(self, rows: Sequence[int], block_ids: Sequence[int], n_in_src: int
               ) -> list[tuple[list[int], list[int], int]]:
        """Per group: (rows among its stored blocks, block ids, blocks it stores)."""
        if len(self.groups) == 1 and self.keep[0] is None:
            return [(list(rows), list(block_ids), n_in_src)]
        out = []
        for g, (g_rows, ids) in enumerate(self.by_group(rows, block_ids, n_in_src)):
            k = self.kept(g, n_in_src)
            shifted = [j - (n_in_src - k) for j in g_rows]
            if shifted and min(shifted) < 0:
                raise IndexError(f"scatter: group {g} stores the last {k} of {n_in_src} "
                                 f"positions, not position {min(g_rows)}")
            out.append((shifted, ids, k))
        return out

    def scatter(self, src: torch.Tensor, n_in_src: int, rows: list[int],
                block_ids: list[int], layer: int | None = None) -> None:
        """Copy blocks `rows` (group-major positions within the payload) of a payload
        holding `n_in_src` blocks per group into the paged caches at `block_ids`; one layer
        or all."""
        parts = self._parts(rows, block_ids, n_in_src)
        if src.device.type == "cpu" and self.host_flat:
            self._scatter_np(src, n_in_src, parts, layer)
            return
        if self.device.type != "cpu":
            self._scatter_device(src, n_in_src, parts, layer)
            return
        for i, (layer_kv, segment) in enumerate(self._segments(src, n_in_src)):
            if layer is not None and i != layer:
                continue
            g_rows, g_ids, k = parts[self._group_of[i]]
            if layer_kv.flat is not None:
                words = segment.view(layer_kv.flat.dtype).view(k, -1)
                for j, b in zip(g_rows, g_ids, strict=True):
                    layer_kv.flat[b].copy_(words[j], non_blocking=True)
            else:
                for j, b in zip(g_rows, g_ids, strict=True):
                    layer_kv.tensor.select(layer_kv.block_dim, b).copy_(
                        segment.select(layer_kv.block_dim, j), non_blocking=True)


    def scatter_bytes(self, raw: np.ndarray, n_in_src: int, rows: list[int],
                      block_ids: list[int]) -> None:
        """scatter, all layers, from a flat uint8 numpy array of a payload in host memory
        (a store's own bytes, read in place: no buffer in between); host_flat layouts only."""
        assert self.host_flat, "scatter_bytes needs a host cache of whole-block rows"
        self._scatter_np(raw, n_in_src, self._parts(rows, block_ids, n_in_src), None)

    def _scatter_device(self, src: torch.Tensor, n_in_src: int,
                        parts: list[tuple[list[int], list[int], int]],
                        layer: int | None) -> None:
        """Caches on a device: each layer's segment crosses in one copy (a contiguous run of
        the payload) and lands with one index_copy_ along the block dimension. Copying block
        by block instead was one small, strided host->device copy per block and layer (512
        for a 256-token chunk of a 32-layer model): 1.3 GB/s on an H200 against 52 GB/s for
        the same bytes in one copy (`kvpool bench copy`). The device holds one layer's
        segment at a time (two with a subset of rows), not the chunk. Asynchronous on the
        current stream (the worker's copy stream): the caller keeps `src` alive until that
        stream is synchronized."""
        pinned = self.device.type == "cuda"  # a pinned index crosses without a staging sync
        targets: list[tuple[torch.Tensor, torch.Tensor | None] | None] = []
        for rows, block_ids, k in parts:
            if not rows:
                targets.append(None)
                continue
            # bounds checked here: on a device an index out of range is an asynchronous
            # assert that poisons the process's CUDA context, not an IndexError for this load
            if len(rows) != len(block_ids) or len(set(block_ids)) != len(block_ids):
                raise IndexError("scatter: rows and block_ids differ in length or repeat a "
                                 "block")
            if min(rows) < 0 or max(rows) >= k or min(block_ids) < 0 \
                    or max(block_ids) >= self.num_blocks:
                raise IndexError(f"scatter: a row outside 0..{k - 1} or a block "
                                 f"outside 0..{self.num_blocks - 1}")
            dst = torch.tensor(block_ids, dtype=torch.long, pin_memory=pinned).to(
                self.device, non_blocking=True)
            pick = (None if list(rows) == list(range(k))
                    else torch.tensor(rows, dtype=torch.long, pin_memory=pinned).to(
                        self.device, non_blocking=True))
            targets.append((dst, pick))
        for i, (layer_kv, segment) in enumerate(self._segments(src, n_in_src)):
            target = targets[self._group_of[i]]
            if (layer is not None and i != layer) or target is None:
                continue
            dst, pick = target
            part = segment.to(self.device, non_blocking=True)
            if pick is not None:
                part = part.index_select(layer_kv.block_dim, pick)
            layer_kv.tensor.index_copy_(layer_kv.block_dim, dst, part)

    def _scatter_np(self, src: torch.Tensor | np.ndarray, n_in_src: int,
                    parts: list[tuple[list[int], list[int], int]], layer: int | None) -> None:
        plans = []
        for rows, block_ids, k in parts:
            plans.append(None if not rows else (
                np.asarray(block_ids, dtype=np.int64),
                None if list(rows) == list(range(k)) else np.asarray(rows, dtype=np.int64)))
        for i, (layer_kv, words) in enumerate(self._np_segments(src, n_in_src)):
            plan = plans[self._group_of[i]]
            if plan is not None and (layer is None or i == layer):  # one numpy copy per layer
                dst_ids, src_rows = plan
                layer_kv.flat_np[dst_ids] = words if src_rows is None else words[src_rows]


def group_specs(spec) -> list:
    """The specs of one KV cache group: in a worker vLLM may give a group a
    UniformTypeKVCacheSpecs (a spec per layer, all of one type), the scheduler one spec."""
    specs = getattr(spec, "kv_cache_specs", None)
    return list(specs.values()) if isinstance(specs, dict) and specs else [spec]


def spec_fingerprint(kv_cache_config, model: str) -> str:
    """What the scheduler and every worker know alike about the KV layout, before any tensor
    exists: used inside chunk keys so all of them compute the same keys. Per group its spec,
    not its layers: a pipeline stage's workers and the scheduler (which vLLM gives stage
    0's config) list different layers; which layers a worker holds is in its stored
    objects' layout (KVLayout.fingerprint) and its rank key (keys.py)."""
    groups = kv_cache_config.kv_cache_groups
    parts = [f"model={model}", f"layout={getattr(kv_cache_config, 'kv_cache_layout', None)}"]
    for g in groups:
        s = group_specs(g.kv_cache_spec)[0]  # a worker's first: what the scheduler is given
        fields = [type(s).__name__]
        for attr in ("block_size", "num_kv_heads", "head_size", "head_size_v", "dtype",
                     "cache_dtype_str", "page_size_bytes"):
            if hasattr(s, attr):
                with contextlib.suppress(Exception):  # a property that does not apply to this spec
                    fields.append(f"{attr}={getattr(s, attr)}")
        parts.append(",".join(fields))
    return ";".join(parts)
