"""Chunk keys: content addresses that every engine of a pool computes identically.

A chunk is `blocks_per_chunk` consecutive vLLM blocks. vLLM already hashes each full block
as a chain (sha256 of parent hash, token ids and extra keys such as LoRA or multimodal
hashes), so the hash of a chunk's *last* block identifies the whole token prefix up to the
end of that chunk. The key adds everything that changes the bytes of the KV for the same
tokens: model, dtype, KV layout fingerprint, tensor-parallel rank and world size, and the
hash algorithm. No Python `hash()` anywhere: keys are equal across processes and hosts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import xxhash


@dataclass(frozen=True)
class KeySpace:
    """What, besides the tokens, makes two chunks interchangeable."""

    namespace: str
    model: str
    dtype: str
    layout: str  # fingerprint of the paged KV layout (see layout.py)
    tp_rank: int
    tp_size: int
    hash_algo: str
    chunk_tokens: int

    def prefix(self) -> bytes:
        """Short stable digest of the key space, first part of every key."""
        text = "|".join(str(x) for x in (
            "kvpool-chunk-v1", self.namespace, self.model, self.dtype, self.layout,
            f"tp{self.tp_rank}/{self.tp_size}", self.hash_algo, self.chunk_tokens))
        return xxhash.xxh3_128_digest(text.encode())


def block_hash_bytes(block_hash) -> bytes:
    """vLLM's BlockHash is bytes (or a BlockHashWithGroupId wrapping bytes)."""
    if isinstance(block_hash, (bytes, bytearray, memoryview)):
        return bytes(block_hash)
    inner = getattr(block_hash, "block_hash", None)
    if isinstance(inner, (bytes, bytearray)):
        return bytes(inner)
    raise TypeError(f"unsupported block hash type {type(block_hash).__name__}")


def chunk_keys(prefix: bytes, block_hashes: Sequence, blocks_per_chunk: int,
               start: int = 0, limit: int | None = None) -> list[bytes]:
    """Keys of the complete chunks [start, limit) covered by `block_hashes`.

    Key = 16-byte digest of the key space + the chunk's last block hash (32 bytes for
    sha256). Only complete chunks get keys: a partial tail is recomputed, never guessed.
    """
    n = len(block_hashes) // blocks_per_chunk
    if limit is not None:
        n = min(n, limit)
    return [prefix + block_hash_bytes(block_hashes[(c + 1) * blocks_per_chunk - 1])
            for c in range(start, n)]
