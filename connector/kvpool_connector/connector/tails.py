"""Tail objects and decode KV: every computed history token reusable at vLLM block granularity.

Full chunks (`chunk_tokens`) are the pool's unit, but a conversation's next turn shares its
whole history with the previous one: the previous prompt, the generated answer and the
blocks past the last full chunk. A *tail object* holds those blocks (fewer than a chunk's
worth, whole vLLM blocks only) and is saved when a prompt's prefill ends and when a request
finishes. Its key is the key space prefix, a marker, the block count and the chained vLLM
hash of its last block, so it names the whole token prefix up to that block, can never be
taken for a full chunk (different length and marker), and two tails of different lengths
after the same chunks never collide. Tails are sealed and stored like every object, and the
local tiers evict them before full chunks (the worker's store is given `is_tail_key` as its
evict-first predicate, store/tiered.py `set_evict_first`).

A lookup takes the longest match: the leading full chunks, then at most one tail right after
them (the longest one present). Pure functions here; scheduler.py calls them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .keys import block_hash_bytes

TAIL_MARK = b"\x00tail"


def tail_key(prefix: bytes, block_hashes: Sequence, first_block: int, n_blocks: int) -> bytes:
    """Key of the tail covering blocks [first_block, first_block + n_blocks)."""
    assert 0 < n_blocks < 256
    last = block_hash_bytes(block_hashes[first_block + n_blocks - 1])
    return prefix + TAIL_MARK + bytes([n_blocks]) + last


def is_tail_key(key: bytes, prefix_len: int = 16) -> bool:
    return key[prefix_len:prefix_len + len(TAIL_MARK)] == TAIL_MARK


def tail_candidates(prefix: bytes, block_hashes: Sequence, full_chunks: int,
                    blocks_per_chunk: int, max_blocks: int) -> list[tuple[int, bytes]]:
    """(block count, key) of the tails that could follow `full_chunks` chunks, longest
    first: at most blocks_per_chunk - 1 blocks, and only blocks the request may claim
    (`max_blocks`: vLLM must compute at least the last prompt token)."""
    first = full_chunks * blocks_per_chunk
    top = min(blocks_per_chunk - 1, len(block_hashes) - first, max_blocks - first)
    return [(n, tail_key(prefix, block_hashes, first, n)) for n in range(top, 0, -1)]


def find_tail(candidates: list[tuple[int, bytes]], present: Callable[[bytes], bool]
              ) -> tuple[int, bytes | None]:
    """The longest candidate `present` finds: (block count, key), or (0, None)."""
    for n, key in candidates:
        if present(key):
            return n, key
    return 0, None


def request_options(request: Any, save_decode: bool, tails: bool) -> tuple[bool, bool]:
    """(save decode KV, use tail objects) for one request: the pool's defaults, overridden by
    `kv_transfer_params={"kvpool": {"save_decode": false, "tails": false}}`."""
    params = getattr(request, "kv_transfer_params", None)
    opts = params.get("kvpool") if isinstance(params, dict) else None
    if isinstance(opts, dict):
        if isinstance(opts.get("save_decode"), bool):
            save_decode = opts["save_decode"]
        if isinstance(opts.get("tails"), bool):
            tails = opts["tails"]
    return save_decode, tails
