"""A request's block ids across vLLM's KV cache groups, as save and load plans name them.

With the hybrid KV cache manager (hybrid models: one group per attention type) every group
holds its own block for each block-sized position of a request, and a sliding-window
group's blocks behind the window are vLLM's null block (freed; `remove_skipped_blocks`).
Plans name a chunk's blocks group-major (layout.py): n ids of group 0, then n of group 1.
A save needs a real block in every group at every position the group stores (a null block
holds nothing of this request): a sliding-window group stores only the last
`window_blocks` positions of an object, the ones a later hit can read. A load writes only
the real ones (vLLM computes nothing over the others). Single-group models get exactly the
ids they had.
"""

from __future__ import annotations

from collections.abc import Sequence

# vLLM's BlockPool.null_block: the pool's first block, never handed to a request as its own
# (tests/connector/connector/test_block_groups.py checks it against vLLM's BlockPool)
NULL_BLOCK = 0

BlockIds = Sequence[Sequence[int]]  # per KV cache group, a request's block ids


def window_blocks(sliding_window: int, block_size: int) -> int:
    """Blocks of a sliding-window group that a hit ending at an object's last block boundary
    (or after it) can read of that object: vLLM keeps the blocks from token
    `num_computed - sliding_window + 1` on (SlidingWindowManager.get_num_skipped_tokens), so
    the last cdiv(sliding_window - 1, block_size) blocks before a boundary."""
    return max(1, -(-(sliding_window - 1) // block_size))


def allocated(ids_by_group: BlockIds) -> int:
    """Positions every group has a block for (null or real)."""
    return min((len(g) for g in ids_by_group), default=0)


def save_ids(ids_by_group: BlockIds, lo: int, hi: int,
             keep: Sequence[int | None] | None = None) -> list[int] | None:
    """Group-major ids of positions [lo, hi), or None when a group lacks a real block at one
    of the positions it stores (`keep`: per group, its last ones; not allocated yet, or out
    of a sliding window already)."""
    if lo >= hi or allocated(ids_by_group) < hi:
        return None
    out: list[int] = []
    for g, ids in enumerate(ids_by_group):
        part = list(ids[lo:hi])
        k = keep[g] if keep is not None else None
        stored = part if k is None else part[max(0, len(part) - k):]
        if len(ids_by_group) > 1 and NULL_BLOCK in stored:
            return None
        out.extend(part)
    return out


def load_rows(ids_by_group: BlockIds, lo: int, hi: int, base: int, n_in_src: int
              ) -> tuple[list[int], list[int]]:
    """(group-major rows within an object of `n_in_src` positions starting at position
    `base`, destination block ids) of positions [lo, hi), each group's null blocks left out."""
    rows: list[int] = []
    dst: list[int] = []
    multi = len(ids_by_group) > 1
    for g, ids in enumerate(ids_by_group):
        for b in range(lo, min(hi, len(ids))):
            if multi and ids[b] == NULL_BLOCK:
                continue
            rows.append(g * n_in_src + b - base)
            dst.append(ids[b])
    return rows, dst
