"""Tail objects and partial blocks in the scheduler's plans: which one a lookup takes, what a
load copies from it, and which ones a request saves.

tails.py derives the keys and candidates (pure); this is the scheduler-side state that uses
them, kept apart from the chunk flow (scheduler.py) because it is the part of a request's
match past its full chunks, with its own rules: the longest candidate present wins, a hit
never covers the last prompt token, a partial block follows only a match of whole blocks.
It shares the scheduler's KeyIndex, its set of saves in flight and its decode-key index.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from .block_groups import BlockIds, allocated, load_rows, save_ids
from .events import KVEvents
from .metadata import ChunkLoad, SaveJob
from .requests import KeyIndex, RemoteAnswer, RequestRecord
from .tails import (
    part_candidates,
    part_key,
    part_usable,
    tail_candidates,
    tail_key,
)

log = logging.getLogger("kvpool.connector")


@dataclass
class SavedObjects:
    """What the scheduler knows of the pool's objects: `index`, those the workers hold in
    their local first tier; `inflight`, planned saves not yet reported stored;
    `decode_keys`, objects saved here that hold generated tokens (a later hit of one is
    counted as such); `world_size`, the workers, each of which copies its part of a save."""

    index: KeyIndex
    inflight: set[bytes]
    decode_keys: KeyIndex
    world_size: int

    def known(self, key: bytes) -> bool:
        """Stored in the first tier or being saved: no second save of it."""
        return key in self.index or key in self.inflight

    def planned(self, record: RequestRecord, key: bytes, decode: bool, durable: bool) -> None:
        """Count one save job of the request's that every worker copies and reports."""
        self.inflight.add(key)
        if decode:
            self.decode_keys.add(key)
        record.pending_copies += self.world_size
        if durable:
            record.durable_pending += self.world_size


class TailPlans:
    """`options(record)`: (save decode KV, use tails) for a request; `first_present(keys)`:
    the index of the first key the lower tiers hold, asked inline (None when there are no
    lower tiers, or they are remote and a lookup job answers instead); `parts_saved`:
    whether partial blocks are saved at all (scheduler.py says when not)."""

    def __init__(self, saved: SavedObjects, block_size: int, blocks_per_chunk: int,
                 chunk_tokens: int, options: Callable[[RequestRecord], tuple[bool, bool]],
                 parts_saved: bool, first_present: Callable[[list[bytes]], int | None] | None,
                 keep: list[int | None] | None = None):
        self.saved = saved
        self.keep = keep  # per KV cache group, what an object stores (layout.py)
        self.block_size = block_size
        self.blocks_per_chunk = blocks_per_chunk
        self.chunk_tokens = chunk_tokens
        self.options = options
        self.parts_saved = parts_saved
        self._first_present = first_present
        self.events: KVEvents | None = None  # set with the scheduler's (enable_events)

    def claimable_blocks(self, request) -> int:
        """Blocks a hit may cover: never the last prompt token (vLLM computes it to sample)."""
        return (request.num_tokens - 1) // self.block_size

    def hit_tokens(self, record: RequestRecord) -> int:
        """Tokens of the last lookup's match: the full chunks, the tail, then the
        partial-block object (found only right after a match of whole blocks that ends
        within what the request may claim)."""
        limit = self.claimable_blocks(record.request) * self.block_size
        whole = min(record.hit_chunks * self.chunk_tokens + record.tail_blocks * self.block_size,
                    limit)
        return whole + record.part_tokens

    # -- lookups ---------------------------------------------------------------------------
    def _longest_present(self, cands: list[tuple[int, bytes]], remote: bytes | None
                         ) -> tuple[int, bytes | None, bool]:
        """The longest candidate present, (size, key, in the KeyIndex), or (0, None, False):
        in the KeyIndex, or the remote job's answer (`remote`: the longest it found in Redis
        or S3, off the step loop), or, when the lower tiers are all local (disk), asked
        inline, every candidate longer than the index's longest in one call."""
        in_index = [k in self.saved.index for _, k in cands]
        lower_at = None
        if self._first_present is not None:
            first = next((i for i, x in enumerate(in_index) if x), len(cands))
            lower_at = self._first_present([k for _, k in cands[:first]]) if first else None
        for i, (n, key) in enumerate(cands):
            if in_index[i] or key == remote or i == lower_at:
                return n, key, in_index[i]
        return 0, None, False

    def lookup(self, record: RequestRecord, hit: int) -> None:
        """The longest tail object right after the `hit` leading full chunks, if any, then
        the longest partial-block object after that."""
        record.tail_blocks, record.tail_key, record.tail_local = 0, None, False
        record.part_tokens, record.part_key, record.part_local = 0, None, False
        answer, record.remote_tail = record.remote_tail, None
        # the remote job's tail, if it asked after the same chunks (the KeyIndex may have
        # extended the remote prefix: then only the index's tails count)
        remote = answer.tail_key if answer is not None and answer.tail_at == hit else None
        request = record.request
        if not self.options(record)[1]:
            return
        # (also when the request has more full chunks than were found: the previous turn
        # may have ended inside chunk `hit`, without the answer's KV)
        cands = tail_candidates(record.prefix, request.block_hashes, hit, self.blocks_per_chunk,
                                self.claimable_blocks(request))
        record.tail_blocks, record.tail_key, record.tail_local = self._longest_present(cands,
                                                                                   remote)
        self._lookup_part(record, hit * self.blocks_per_chunk + record.tail_blocks, answer)

    def _lookup_part(self, record: RequestRecord, n_blocks: int,
                     answer: RemoteAnswer | None) -> None:
        """The longest partial-block object right after the first `n_blocks` full blocks
        (the chunks and the tail found), if any."""
        request = record.request
        if not part_usable(request):
            return
        remote = answer.part_key if answer is not None and answer.part_at == n_blocks else None
        cands = part_candidates(record.prefix, request.block_hashes, request.all_token_ids,
                                n_blocks, self.block_size, request.num_tokens - 1)
        record.part_tokens, record.part_key, record.part_local = self._longest_present(cands,
                                                                                   remote)

    # -- loads -----------------------------------------------------------------------------
    def add_loads(self, record: RequestRecord, chunks: list[ChunkLoad], first_block: int,
                  last_block: int, block_ids: BlockIds) -> None:
        """Add the tail and the partial-block object to a load plan (blocks [first_block,
        last_block) are to be loaded). Hits are counted by the workers, with the tier that
        served them."""
        self._load_tail(record, chunks, first_block, last_block, block_ids)
        self._load_part(record, chunks, first_block, block_ids)

    def _load_tail(self, record: RequestRecord, chunks: list[ChunkLoad],
                   first_block: int, last_block: int, block_ids: BlockIds) -> None:
        if record.tail_key is None:
            return
        start = record.hit_chunks * self.blocks_per_chunk
        lo, hi = max(first_block, start), min(last_block, start + record.tail_blocks)
        if lo >= hi:
            return
        decode = record.tail_key in self.saved.decode_keys
        rows, dst = load_rows(block_ids, lo, hi, start, record.tail_blocks)
        chunks.append(ChunkLoad(record.tail_key, rows, dst, n_blocks=record.tail_blocks,
                                kind="decode_tail" if decode else "prompt_tail"))

    def _load_part(self, record: RequestRecord, chunks: list[ChunkLoad], first_block: int,
                   block_ids: BlockIds) -> None:
        """One block, of which its first `part_tokens` tokens are the match (vLLM computes
        over the rest, which holds whatever an earlier request left in that block)."""
        if record.part_key is None:
            return
        b = self.hit_tokens(record) // self.block_size
        if b < first_block or b >= allocated(block_ids):  # not reached: vLLM allocates it
            log.error("kvpool: request %s: partial block %d outside its blocks %d..%d",
                      record.request.request_id, b, first_block, allocated(block_ids))
            return
        decode = record.part_key in self.saved.decode_keys
        rows, dst = load_rows(block_ids, b, b + 1, b, 1)
        chunks.append(ChunkLoad(record.part_key, rows, dst, n_blocks=1,
                                kind="decode_tail" if decode else "prompt_tail",
                                tokens=record.part_tokens))

    # -- saves -----------------------------------------------------------------------------
    def part_job(self, record: RequestRecord, n_tokens: int, block_ids: BlockIds,
                 durable: bool = False) -> SaveJob | None:
        """A save of the block the first `n_tokens` tokens end inside (None when they end
        on a block boundary, the request's ids do not name its KV, or the pool has or is
        saving that object already)."""
        req = record.request
        n_tokens = min(n_tokens, len(req.all_token_ids))
        b, n = divmod(n_tokens, self.block_size)
        ids = save_ids(block_ids, b, b + 1, self.keep)
        if (not n or b == 0 or b > len(req.block_hashes) or ids is None
                or not part_usable(req) or not self.parts_saved):
            return None
        key = part_key(record.prefix, req.block_hashes[b - 1],
                       req.all_token_ids[b * self.block_size:n_tokens])
        if (self.saved.known(key) or key == record.part_key) and not durable:
            return None
        decode = n_tokens > req.num_prompt_tokens  # holds generated tokens
        self.saved.planned(record, key, decode, durable)
        return SaveJob(req.request_id, [key], [ids],
                       ["decode_tail" if decode else "prompt_tail"], durable=durable)

    def tail_job(self, record: RequestRecord, n_blocks: int, block_ids: BlockIds,
                 durable: bool = False) -> SaveJob | None:
        """A save of the blocks past the last full chunk among the first `n_blocks` blocks
        (None when there are none, or the pool has or is saving that tail already)."""
        req = record.request
        n_blocks = min(n_blocks, len(req.block_hashes), allocated(block_ids))
        start = n_blocks // self.blocks_per_chunk * self.blocks_per_chunk
        count = n_blocks - start
        ids = save_ids(block_ids, start, n_blocks, self.keep)  # None: out of the window
        if count <= 0 or ids is None:
            return None
        key = tail_key(record.prefix, req.block_hashes, start, count)
        if (self.saved.known(key) or key == record.tail_key) and not durable:
            return None
        if self.events is not None:
            self.events.remember_blocks(req, start, n_blocks, key)
        decode = n_blocks * self.block_size > req.num_prompt_tokens  # holds generated tokens
        self.saved.planned(record, key, decode, durable)
        return SaveJob(req.request_id, [key], [ids],
                       ["decode_tail" if decode else "prompt_tail"], durable=durable)

    def prompt_tail_jobs(self, record: RequestRecord, block_ids: BlockIds,
                         durable: bool) -> list[SaveJob]:
        """At the step that ends the prompt's prefill: the prompt's tail (a concurrent or
        aborted request, or one preempted later, finds the prompt's whole blocks) and, for a
        handover, the partial block of all but its last token (the decode engine computes
        only that token; a chat's partial block is the one saved at finish)."""
        req = record.request
        # a handover covers what a decode engine may claim, all but the last token; else the
        # whole blocks of the prompt (its last token's block included, for a longer prompt)
        claim = req.num_prompt_tokens - 1 if record.handover_out else req.num_prompt_tokens
        jobs = [self.tail_job(record, claim // self.block_size, block_ids, durable=durable),
                self.part_job(record, req.num_prompt_tokens - 1, block_ids, durable=durable)
                if record.handover_out else None]
        return [j for j in jobs if j is not None]

    def finish_jobs(self, record: RequestRecord, block_ids: BlockIds) -> list[SaveJob]:
        """A finished request: the tail of everything computed (the prompt and, with decode
        KV on, the answer but its last token, never computed), saved in the next step while
        its blocks stay allocated."""
        req = record.request
        # what the executed steps computed: with async scheduling (and speculative decoding)
        # num_computed_tokens also counts a step in flight, whose tokens (drafts) may not be
        # in all_token_ids yet (vLLM's own safe point for caching blocks)
        done = min(req.num_computed_tokens - getattr(req, "num_output_placeholders", 0),
                   len(req.all_token_ids))
        if not self.options(record)[0]:
            done = min(done, req.num_prompt_tokens)
        jobs = (self.tail_job(record, done // self.block_size, block_ids),
                self.part_job(record, done, block_ids))
        return [j for j in jobs if j is not None]
