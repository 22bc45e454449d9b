"""Chunk keys: content addresses that every engine of a pool computes identically.

A chunk is `blocks_per_chunk` consecutive vLLM blocks. vLLM already hashes each full block
as a chain (sha256 of parent hash, token ids and extra keys such as LoRA, multimodal hashes
or the request's cache_salt), so the hash of a chunk's *last* block identifies the whole
token prefix up to the end of that chunk. The key adds everything that changes the bytes of
the KV for the same tokens: the model and its configuration (vLLM's model config hash, which
covers revision and quantization, plus hf_overrides, which that hash leaves out), dtype, KV
layout fingerprint, tensor-parallel rank and world size, the hash algorithm, the vLLM
version and kvpool's own format version. A rolling update that changes any of them starts
a new key space instead of loading KV computed under the old one. No Python `hash()`
anywhere: keys are equal across processes and hosts. (The store then derives object names
from these keys with the pool key, so they never appear in a shared tier.)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

KEY_FORMAT = "kvpool-chunk-v2"  # bump when the key derivation or the payload layout changes


def model_config_hash(model_config) -> str:
    """Everything of vLLM's model config that can change the KV of the same tokens.

    vLLM's `compute_hash()` covers the model, revision, quantization, dtype and the rest of
    the computation graph's factors, but ignores `hf_overrides` (which can change rope
    scaling, head counts, ...): both go in."""
    overrides = getattr(model_config, "hf_overrides", None)
    try:
        overrides_text = json.dumps(overrides, sort_keys=True, default=repr)
    except TypeError:  # a callable override: its name is the best stable identity
        overrides_text = repr(getattr(overrides, "__qualname__", overrides))
    text = f"{model_config.compute_hash()}|{overrides_text}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class KeySpace:
    """What, besides the tokens, makes two chunks interchangeable."""

    namespace: str
    model: str
    model_hash: str  # model_config_hash(): revision, quantization, overrides, ...
    vllm_version: str
    dtype: str
    layout: str  # fingerprint of the paged KV layout (see layout.py)
    tp_rank: int
    tp_size: int
    hash_algo: str
    chunk_tokens: int

    def prefix(self) -> bytes:
        """Short stable digest of the key space, first part of every key."""
        text = "|".join(str(x) for x in (
            KEY_FORMAT, self.namespace, self.model, self.model_hash, self.vllm_version,
            self.dtype, self.layout, f"tp{self.tp_rank}/{self.tp_size}", self.hash_algo,
            self.chunk_tokens))
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
