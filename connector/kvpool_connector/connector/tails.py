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

A *partial-block object* is the one vLLM block the history ends inside, of which its first
`n` tokens are the match (the block is copied whole: a load writes it into the request's new
block and vLLM computes from token `n` on, over whatever the rest held). vLLM hashes only
full blocks, so its key is a sha256 of the chained hash of the block before it and those `n`
token ids: it names the whole token prefix, exactly, and a request whose block goes on
differently derives another key. Saved at finish for everything computed and, for a
prefill's handover, at prefill end for all but the last prompt token (what a decode engine
may claim: it computes only that token). Requests with multimodal inputs or prompt
embeddings never use one: their token ids do not name their KV.

A lookup takes the longest match: the leading full chunks, then at most one tail right after
them (the longest one present), then at most one partial-block object right after those
(the longest one present). Pure functions here; scheduler.py calls them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from .keys import block_hash_bytes

TAIL_MARK = b"\x00tail"
PART_MARK = b"\x00part"


def tail_key(prefix: bytes, block_hashes: Sequence, first_block: int, n_blocks: int) -> bytes:
    """Key of the tail covering blocks [first_block, first_block + n_blocks)."""
    assert 0 < n_blocks < 256
    last = block_hash_bytes(block_hashes[first_block + n_blocks - 1])
    return prefix + TAIL_MARK + bytes([n_blocks]) + last


def part_key(prefix: bytes, parent_hash, tokens: Sequence[int]) -> bytes:
    """Key of the partial-block object holding `tokens` right after the full block whose
    vLLM hash is `parent_hash`."""
    assert 0 < len(tokens) < 1 << 16
    digest = hashlib.sha256(block_hash_bytes(parent_hash))
    digest.update(np.asarray(tokens, dtype="<i8").tobytes())
    return _part_key(prefix, len(tokens), digest)


def _part_key(prefix: bytes, n: int, digest) -> bytes:
    return prefix + PART_MARK + n.to_bytes(2, "big") + digest.digest()


def is_tail_key(key: bytes, prefix_len: int = 16) -> bool:
    """A tail or a partial-block object: what the local tiers evict first."""
    return key[prefix_len:prefix_len + len(TAIL_MARK)] in (TAIL_MARK, PART_MARK)


def part_usable(request: Any) -> bool:
    """Whether the request's token ids alone name its KV (no images, audio or embeddings
    whose hashes vLLM puts in its block hashes only)."""
    return not getattr(request, "mm_features", None) and getattr(
        request, "prompt_embeds", None) is None


def part_candidates(prefix: bytes, block_hashes: Sequence, token_ids: Sequence[int],
                    n_blocks: int, block_size: int, max_tokens: int
                    ) -> list[tuple[int, bytes]]:
    """(token count, key) of the partial-block objects that could follow the first
    `n_blocks` full blocks of a request (`part_usable`), longest first: fewer than a block,
    and within the first `max_tokens` tokens (vLLM computes at least the last prompt token)."""
    if n_blocks <= 0 or n_blocks > len(block_hashes):
        return []
    start = n_blocks * block_size
    tokens = np.asarray(token_ids[start:start + min(block_size - 1, max_tokens - start)],
                        dtype="<i8")
    digest = hashlib.sha256(block_hash_bytes(block_hashes[n_blocks - 1]))
    out = []
    for n, token in enumerate(tokens.tobytes()[i:i + 8] for i in range(0, 8 * len(tokens), 8)):
        digest.update(token)  # one pass over the block: each key extends the previous one
        out.append((n + 1, _part_key(prefix, n + 1, digest)))
    return out[::-1]


def tail_candidates(prefix: bytes, block_hashes: Sequence, full_chunks: int,
                    blocks_per_chunk: int, max_blocks: int) -> list[tuple[int, bytes]]:
    """(block count, key) of the tails that could follow `full_chunks` chunks, longest
    first: at most blocks_per_chunk - 1 blocks, and only blocks the request may claim
    (`max_blocks`: vLLM must compute at least the last prompt token)."""
    first = full_chunks * blocks_per_chunk
    top = min(blocks_per_chunk - 1, len(block_hashes) - first, max_blocks - first)
    return [(n, tail_key(prefix, block_hashes, first, n)) for n in range(top, 0, -1)]


def request_options(request: Any, save_decode: bool, tails: bool) -> tuple[bool, bool]:
    """(save decode KV, use tail objects) for one request: the pool's settings, which
    `kv_transfer_params={"kvpool": {"save_decode": false, "tails": false}}` may turn off
    but never on (a client does not choose what of other requests' blocks is stored)."""
    params = getattr(request, "kv_transfer_params", None)
    opts = params.get("kvpool") if isinstance(params, dict) else None
    if isinstance(opts, dict):
        if opts.get("save_decode") is False:
            save_decode = False
        if opts.get("tails") is False:
            tails = False
    return save_decode, tails
