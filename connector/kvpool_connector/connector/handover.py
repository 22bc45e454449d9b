"""Prefill/decode through the pool: the handover a prefill engine returns and a decode
engine is given (`kv_transfer_params`), as pure functions.

A prefill engine is asked for a handover by the router: `{"do_remote_decode": true}` (what
vllm-router's P/D mode and llm-d's nixlv2 sidecar send with the `max_tokens=1` prefill
request) or `{"kvpool": {"handover": true}}`. It writes the prompt's chunks and tail object
through to the shared tiers within the step and returns, in `request_finished`,

    {"kvpool": {"handover": {"v": 1, "tokens": N, "name": "<64 hex>"}}}

which the router forwards verbatim to the decode engine. `tokens` is the prompt prefix the
pool holds (all but the last prompt token: full chunks, a tail of whole vLLM blocks and a
partial-block object, tails.py; whole blocks from a prefill engine that saves no partial
block), `name` the pool's keyed object name (BLAKE3 under the pool
key, store/sealing.py) of the prefix's last object. The decode engine derives the keys from
its own block hashes, so the params name no key a client could choose: a `name` that is
not the one it derives (another prompt, model, tenant salt or pool key) makes the handover
ignored. The params come from the client or router and are untrusted: bounded sizes, and
a malformed value is a `HandoverError` whose one-line message names the field.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .keys import chunk_keys
from .tails import part_key, tail_key

VERSION = 1
MAX_TOKENS = 1 << 24  # no prompt is longer; bounds the keys a handover makes us derive
_NAME = re.compile(r"[0-9a-f]{64}")


class HandoverError(ValueError):
    """A malformed handover; the message names the field (`kv_transfer_params.kvpool...`)."""


@dataclass(frozen=True)
class Handover:
    tokens: int  # prompt tokens the pool holds for this prompt
    name: bytes  # keyed object name of the last object of that prefix


def _kvpool(params: Any) -> Any:
    return params.get("kvpool") if isinstance(params, dict) else None


def wants_handover(params: Any) -> bool:
    """A prefill request whose KV a decode engine will load through the pool."""
    if not isinstance(params, dict):
        return False
    opts = _kvpool(params)
    return params.get("do_remote_decode") is True or (
        isinstance(opts, dict) and opts.get("handover") is True)


def build_handover(tokens: int, name: bytes) -> dict[str, Any]:
    """The `kv_transfer_params` a prefill engine returns."""
    return {"kvpool": {"handover": {"v": VERSION, "tokens": tokens, "name": name.hex()}}}


def parse_handover(params: Any) -> Handover | None:
    """The handover a decode request carries; None when it carries none (a prefill request's
    `handover: true` included). Raises HandoverError on a malformed one."""
    opts = _kvpool(params)
    if not isinstance(opts, dict) or "handover" not in opts or opts["handover"] is True:
        return None
    field = "kv_transfer_params.kvpool.handover"
    h = opts["handover"]
    if not isinstance(h, dict):
        raise HandoverError(f"{field}: expected an object or true, got {type(h).__name__}")
    extra = set(h) - {"v", "tokens", "name"}
    if extra:
        raise HandoverError(f"{field}: unknown field {sorted(map(str, extra))[0][:32]!r}")
    if h.get("v") != VERSION or isinstance(h.get("v"), bool):
        raise HandoverError(f"{field}.v: expected {VERSION}, got {str(h.get('v'))[:32]!r}")
    tokens = h.get("tokens")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or not 0 < tokens <= MAX_TOKENS:
        raise HandoverError(f"{field}.tokens: expected an integer in 1..{MAX_TOKENS}, got "
                            f"{str(tokens)[:32]!r}")
    name = h.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise HandoverError(f"{field}.name: expected 64 lowercase hex digits, got "
                            f"{str(name)[:80]!r}")
    return Handover(tokens, bytes.fromhex(name))


@dataclass(frozen=True)
class HandoverObjects:
    """The objects holding a prompt's first `tokens` tokens, in order: full chunks, then a
    tail of whole blocks, then a partial-block object."""

    keys: list[bytes]          # full chunks
    tail_blocks: int
    tail: bytes | None
    part_tokens: int
    part: bytes | None
    chunk_tokens: int
    block_size: int

    def objects(self) -> list[tuple[bytes, int]]:
        """(key, the prompt tokens held up to and including it), in order."""
        out = [(k, (i + 1) * self.chunk_tokens) for i, k in enumerate(self.keys)]
        whole = len(self.keys) * self.chunk_tokens
        if self.tail is not None:
            whole += self.tail_blocks * self.block_size
            out.append((self.tail, whole))
        if self.part is not None:
            out.append((self.part, whole + self.part_tokens))
        return out

    def last(self) -> bytes:
        return self.objects()[-1][0]


def handover_objects(prefix: bytes, block_hashes: Sequence, token_ids: Sequence[int],
                     tokens: int, block_size: int, blocks_per_chunk: int,
                     part_ok: bool = True) -> HandoverObjects | None:
    """The objects holding the first `tokens` tokens. None when the request cannot hold
    them (fewer tokens or block hashes than that, or a partial block where its ids do not
    name its KV, `part_ok` false): the handover is not this prompt's."""
    n_blocks, n = divmod(tokens, block_size)
    if (n_blocks == 0 or n_blocks > len(block_hashes) or tokens > len(token_ids)
            or (n and not part_ok)):
        return None
    full = n_blocks // blocks_per_chunk
    keys = chunk_keys(prefix, block_hashes, blocks_per_chunk, limit=full)
    rest = n_blocks - full * blocks_per_chunk
    tail = tail_key(prefix, block_hashes, full * blocks_per_chunk, rest) if rest else None
    part = (part_key(prefix, block_hashes[n_blocks - 1],
                     token_ids[n_blocks * block_size:tokens]) if n else None)
    return HandoverObjects(keys, rest, tail, n, part, blocks_per_chunk * block_size,
                           block_size)
