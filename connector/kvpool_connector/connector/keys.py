"""Chunk keys: content addresses that every engine of a pool computes identically.

A chunk is `blocks_per_chunk` consecutive vLLM blocks. vLLM already hashes each full block
as a chain (sha256 of parent hash, token ids and extra keys such as LoRA, multimodal hashes
or the request's cache_salt), so the hash of a chunk's *last* block identifies the whole
token prefix up to the end of that chunk. The key adds everything that changes the bytes of
the KV for the same tokens: the model and its configuration (vLLM's model config hash, which
covers revision and quantization, plus hf_overrides, which that hash leaves out), dtype and
KV cache dtype, KV layout fingerprint, the parallel layout (tensor- and pipeline-parallel
sizes and the pipeline's layer partition), the hash algorithm, the vLLM version and
kvpool's own format version. A rolling update that changes any of them starts a new key
space instead of loading KV computed under the old one. No Python `hash()` anywhere: keys
are equal across processes and hosts. (The store then derives object names from these keys
with the pool key, so they never appear in a shared tier.)

Ranks. The scheduler plans with the engine's *logical* keys (`KeySpace.prefix()`); each
worker holds a different part of a chunk's KV (its tensor-parallel heads, its pipeline
stage's layers) and stores it under its own *rank key* (`rank_key`): the logical key with
its 16-byte prefix re-derived from the rank's tag. The tag of tensor rank 0 of stage 0 is
empty (its rank key is the logical key); a layout whose KV is the same on every tensor rank
(MLA's one latent per token) has one tag per stage, so one copy is stored, not one per rank.
A hit needs every tag's object (`KeySpace.rank_tags`).

Adapters. vLLM's block hashes name a LoRA adapter by name and path, not by its weights: a
new version written over the old one's path hashes alike. A request with an adapter gets its
own prefix (`adapter_prefix`), derived from a digest of the adapter's files (adapters.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

KEY_FORMAT = "kvpool-chunk-v3"  # bump when the key derivation or the payload layout changes
PREFIX_LEN = 16  # bytes of the key space prefix at the front of every key


@dataclass(frozen=True)
class KeySpace:
    """What, besides the tokens, makes two engines' chunks interchangeable. The same in the
    scheduler and in every worker of an engine: nothing here is one rank's or one stage's."""

    namespace: str
    model: str
    model_hash: str  # identity.model_config_hash(): revision, quantization, overrides, ...
    vllm_version: str
    dtype: str  # the model's dtype / the KV cache dtype (auto, fp8, ...)
    layout: str  # fingerprint of the paged KV layout (see layout.py)
    tp_size: int
    hash_algo: str
    chunk_tokens: int
    pp_size: int = 1
    pp_layers: str = ""  # the pipeline's layer partition ("0-16,16-32"), "" without one
    # consecutive tensor ranks holding identical KV (vLLM's kv_cache_config.kv_tp_replicas:
    # MLA's latent cache on every rank, a cache with fewer shards than ranks): one copy a group
    tp_replicas: int = 1

    def __post_init__(self) -> None:
        if self.tp_replicas < 1 or self.tp_size % self.tp_replicas:
            raise ValueError(f"kv_tp_replicas {self.tp_replicas} does not divide the tensor "
                             f"parallel size {self.tp_size}")

    def prefix(self) -> bytes:
        """Short stable digest of the key space: the first part of every logical key."""
        text = "|".join(str(x) for x in (
            KEY_FORMAT, self.namespace, self.model, self.model_hash, self.vllm_version,
            self.dtype, self.layout, f"tp{self.tp_size}", f"pp{self.pp_size}:{self.pp_layers}",
            "sharded" if self.tp_replicas == 1 else f"replicas{self.tp_replicas}", self.hash_algo,
            self.chunk_tokens))
        return xxhash.xxh3_128_digest(text.encode())

    def rank_tag(self, tp_rank: int, pp_rank: int) -> bytes:
        """The tag of the worker at (tp_rank, pp_rank): b"" for the one whose rank keys are
        the logical keys; the tensor ranks of one replica group share its tag (the group's
        index: tp_rank // tp_replicas)."""
        if not 0 <= tp_rank < self.tp_size or not 0 <= pp_rank < self.pp_size:
            raise ValueError(f"rank tp{tp_rank}/pp{pp_rank} outside tp{self.tp_size}/"
                             f"pp{self.pp_size}")
        group = tp_rank // self.tp_replicas
        return b"" if group == pp_rank == 0 else f"tp{group}/pp{pp_rank}".encode()

    def rank_tags(self) -> list[bytes]:
        """Every distinct tag of the engine's workers: the objects one chunk is made of."""
        tps = range(0, self.tp_size, self.tp_replicas)  # the first rank of each replica group
        return [self.rank_tag(t, p) for p in range(self.pp_size) for t in tps]

    def stores_shared(self, tp_rank: int) -> bool:
        """Whether this tensor rank writes the tiers other processes read: with replicated
        KV only the first rank of each replica group does (the others keep their copy in
        their own memory)."""
        return tp_rank % self.tp_replicas == 0


def rank_key(key: bytes, tag: bytes) -> bytes:
    """The key a worker with `tag` stores a logical key's part under: its prefix re-derived
    from the logical prefix (whatever made it: the engine's, an adapter's) and the tag."""
    if not tag:
        return key
    return xxhash.xxh3_128_digest(key[:PREFIX_LEN] + b"|rank|" + tag) + key[PREFIX_LEN:]


def adapter_prefix(prefix: bytes, adapter_digest: bytes) -> bytes:
    """The key space prefix of requests served with one adapter's weights."""
    return xxhash.xxh3_128_digest(prefix + b"|adapter|" + adapter_digest)


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
