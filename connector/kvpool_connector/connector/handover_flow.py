"""Prefill/decode through the pool, as the scheduler runs it: what a request's
kv_transfer_params ask, how far a prefill's saves are written through, the handover it
returns (amended by what the workers report), and a decode request's wait for its objects.

handover.py holds the pure parts (the params' grammar, the objects they name); this is the
state between the scheduler's hooks, kept out of scheduler.py because it is its own flow
with its own budget (write-through bytes per step and per request) and its own wait (a
decode request polls the shared tiers until the objects it was handed are visible).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from .config import ConnectorConfig
from .handover import (
    HandoverError,
    build_handover,
    handover_objects,
    parse_handover,
    wants_handover,
)
from .keys import chunk_keys
from .lookups import LookupJobs, remote_prefix
from .metadata import KVPoolWorkerMetadata
from .requests import RequestRecord
from .tails import part_usable

log = logging.getLogger("kvpool.connector")

HANDOVER_POLL_S = 0.02  # a decode request waiting for a handover asks the tiers this often


class HandoverFlow:
    """`lower`: the shared tiers (None: no handover either way); `jobs`: the scheduler's
    lookup threads; `count(metric, value)`: the scheduler's stats counter."""

    def __init__(self, lower, jobs: LookupJobs, block_size: int, blocks_per_chunk: int,
                 chunk_bytes: int, count: Callable[..., None]):
        self.lower = lower
        self.jobs = jobs
        self.block_size = block_size
        self.blocks_per_chunk = blocks_per_chunk
        self.chunk_bytes = chunk_bytes
        self._count = count
        # handovers returned this step whose write-through the workers report later in the
        # same update_from_output: req_id -> (the params returned, their objects, record)
        self.out: dict[str, tuple[dict, list[tuple[bytes, int]], RequestRecord]] = {}
        self.step_left = 0  # this step's write-through budget (handover_step_bytes)
        self._refusal_logged = False  # one warning per engine

    def new_step(self, step_bytes: int) -> None:
        self.step_left = step_bytes
        self.out.clear()  # their outputs are gone: nothing left to amend

    # -- a new request ---------------------------------------------------------------------
    def read(self, record: RequestRecord, cfg: ConnectorConfig, save: bool, load: bool) -> None:
        """What the request's kv_transfer_params ask of the pool (handover.py)."""
        params = getattr(record.request, "kv_transfer_params", None)
        asked = wants_handover(params)
        if asked and not (cfg.handover_requests or cfg.handover_always):
            # not a prefill engine: a client must not force write-through on it
            self._count("kvpool_handover_refused")
            if not self._refusal_logged:
                self._refusal_logged = True
                log.warning("kvpool: handover requests (kv_transfer_params do_remote_decode or "
                            "kvpool.handover) are ignored: this engine is not a prefill engine "
                            "(connector key handover_requests); counted in "
                            "kvpool_handover_refused_total")
            asked = False
        record.handover_out = save and (cfg.handover_always or asked)
        try:
            record.handover_in = parse_handover(params) if load else None
        except HandoverError as e:
            log.warning("kvpool: request %s: %s; ignored", record.request.request_id, e)
            self._count("kvpool_handover_rejected")
            return
        if record.handover_in is not None:
            record.handover_state = "wait"

    # -- a prefill's write-through ---------------------------------------------------------
    @staticmethod
    def durable(record: RequestRecord) -> bool:
        """Whether the request's saves are written through now: a handover not capped."""
        return record.handover_out and not record.durable_capped

    def room(self, record: RequestRecord, n_chunks: int, max_bytes: int) -> int:
        """How far (in chunks) a handover's saves may be written through: its caps are
        handover_max_bytes per request and handover_step_bytes per step (a write-through
        holds the whole step). Short of `n_chunks`, the request is capped: the chunks past the
        cap, and every later save, go behind the first tier, and its handover ends before the
        first chunk not written through (the decode engine computes the rest)."""
        room = min(max_bytes - record.durable_bytes, self.step_left) // max(1, self.chunk_bytes)
        if n_chunks - record.next_save <= room:
            return n_chunks
        cut = record.next_save + max(0, room)
        req = record.request
        record.durable_capped = True
        record.durable_failed = (record.durable_failed or set()) | set(
            chunk_keys(record.prefix, req.block_hashes, self.blocks_per_chunk, start=cut,
                       limit=cut + 1))
        self._count("kvpool_handover_capped")
        return cut

    def wrote_through(self, record: RequestRecord, nbytes: int) -> None:
        record.durable_bytes += nbytes
        self.step_left -= nbytes

    # -- the handover a finished prefill returns -------------------------------------------
    def params(self, record: RequestRecord, tokens: int) -> dict[str, Any] | None:
        """The handover of the prompt's first `tokens` tokens, as its saves wrote them
        through. The last step's write-through is reported by the workers after this call, in
        the same `update_from_output`: `reports` then shortens (or empties) the params
        returned here before vLLM sends them."""
        req = record.request
        objs = handover_objects(record.prefix, req.block_hashes, req.all_token_ids, tokens,
                                self.block_size, self.blocks_per_chunk)
        if objs is None:
            return None
        out = build_handover(tokens, self.lower.object_names([objs.last()])[0])
        self._count("kvpool_handovers")
        objects = objs.objects()
        if record.durable_pending > 0:
            self.out[req.request_id] = (out, objects, record)
        else:
            self._settle(out, objects, record)
        return out

    def _settle(self, out: dict, objects: list[tuple[bytes, int]],
                record: RequestRecord) -> None:
        """Promise only the leading objects every shared tier confirmed."""
        failed = record.durable_failed or set()
        good = next((i for i, (k, _) in enumerate(objects) if k in failed), len(objects))
        if good == len(objects):
            return
        self._count("kvpool_handover_write_failures", len(objects) - good)
        if good == 0:
            out.clear()  # nothing to hand over: the decode engine computes the prompt
            return
        inner = out["kvpool"]["handover"]
        key, tokens = objects[good - 1]  # e.g. a failed tail leaves the full chunks
        inner["tokens"] = tokens
        inner["name"] = self.lower.object_names([key])[0].hex()

    def reports(self, worker_meta: KVPoolWorkerMetadata,
                records: dict[str, RequestRecord]) -> None:
        """The workers' write-through results; a handover returned this step is settled
        once all of them are in."""
        for req_id, n in worker_meta.durable_done.items():
            pending = self.out.get(req_id)
            record = pending[2] if pending is not None else records.get(req_id)
            if record is None:
                continue
            record.durable_pending -= n
            failed = worker_meta.durable_failed.get(req_id)
            if failed:
                record.durable_failed = (record.durable_failed or set()) | set(failed)
            if pending is not None and record.durable_pending <= 0:
                del self.out[req_id]
                self._settle(pending[0], pending[1], record)

    # -- a decode request's wait -----------------------------------------------------------
    def claimable(self, tokens: int, request) -> bool:
        """Whether a handover of `tokens` fits the request: a partial block must end before
        its last token (whole blocks are capped by `TailPlans.hit_tokens`, as an earlier
        prefill engine's handover of a prompt ending on a block boundary needs)."""
        return tokens < request.num_tokens or tokens % self.block_size == 0

    def ready(self, record: RequestRecord, now: float, wait_seconds: float) -> bool | None:
        """A decode request's handover: True once all its objects are visible in the shared
        tiers (loaded then as a hit), None while waiting (the request asks again next step),
        False when it is not this prompt's or the wait timed out (an ordinary lookup,
        which may load a shorter prefix that is visible, authenticated like every hit)."""
        if record.handover_state == "ready":
            return True
        h = record.handover_in
        assert h is not None
        request = record.request
        if record.handover_keys is None:
            objs = (handover_objects(record.prefix, request.block_hashes, request.all_token_ids,
                                     h.tokens, self.block_size, self.blocks_per_chunk,
                                     part_ok=part_usable(request))
                    if self.lower is not None and self.claimable(h.tokens, request) else None)
            if objs is None or self.lower.object_names([objs.last()])[0] != h.name:
                log.warning("kvpool: request %s: its handover names objects this prompt does "
                            "not have (another prompt, model, salt or pool key); ignored",
                            request.request_id)
                self._count("kvpool_handover_rejected")
                record.handover_state = "off"
                return False
            record.handover_keys = objs
            record.handover_deadline = now + wait_seconds
        objs = record.handover_keys
        objects = [k for k, _ in objs.objects()]
        fut = record.handover_check
        if fut is None and now - record.handover_checked_at >= HANDOVER_POLL_S:
            record.handover_checked_at = now
            if self.jobs.remote:
                fut = record.handover_check = self.jobs.submit(self._visible, objects)
                self.jobs.answered(fut)  # waited for once, when asked; then polled
            else:  # every shared tier is local (disk): answered inline
                fut = Future()
                fut.set_result(self._visible(objects))
        if fut is None or not fut.done():
            return None
        record.handover_check = None
        try:
            visible = fut.result()
        except Exception:  # the store never raises; a broken pool is "not yet"
            visible = False
        if visible:
            record.handover_state = "ready"
            record.hit_chunks, record.hit_local_index = len(objs.keys), 0
            record.tail_blocks, record.tail_key, record.tail_local = (objs.tail_blocks,
                                                                     objs.tail, False)
            record.part_tokens, record.part_key, record.part_local = (objs.part_tokens,
                                                                      objs.part, False)
            record.lookup = (len(request.block_hashes), len(objs.keys), now)
            self._count("kvpool_handover_hits")
            return True
        if now < record.handover_deadline:
            return None
        log.warning("kvpool: request %s: its handover's objects were not all visible within "
                    "%.1f s; computing the prompt", request.request_id, wait_seconds)
        self._count("kvpool_handover_timeouts")
        record.handover_state = "off"
        return False

    def _visible(self, keys: list[bytes]) -> bool:
        """Every key in the shared tiers now (asked afresh: another engine just wrote them)."""
        self.lower.forget_absent(keys)
        return remote_prefix(self.lower, keys) == len(keys)
