"""Scheduler-side half: lookups, load plans, save plans, delayed frees.

Process model. vLLM runs this half in the EngineCore process and the workers in their own
processes; the store's cpu tier lives in the worker (it is filled from, and copied into, the
worker's paged KV). So a lookup here consults (1) an in-memory index of chunks the workers
copied out for saving into a local first tier (cpu or disk), reported through the per-step
worker metadata and bounded by that tier's size, and (2) the shared lower tiers (disk,
Redis, S3) opened here without the cpu tier, which also hold what other engines of the pool
computed. A lookup is only a promise: if a chunk is gone by the time the worker loads it
(evicted, corrupt, backend down), the worker reports its blocks through
`get_block_ids_with_load_errors`, vLLM recomputes them (`kv_load_failure_policy:
recompute`) and the recomputed chunks are saved again.

Remote lookups never hold the scheduler up for long. When the lower tiers include Redis or
S3, the part of a lookup that needs them runs on a small thread pool; the scheduler waits
for it up to `lookup_wait_ms` (5 ms: a LAN round trip; the request is then admitted in the
step that asked) and otherwise `num_matched` answers None ("ask again next step", which
vLLM supports) until it is done. The wait is skipped while such jobs have recently taken
longer than the bound (S3), and one step waits twice the bound at most however many
requests arrive; the in-memory index and local disk are answered inline. The same job then asks for
the tail objects that could follow the chunks it found (tails.py), all candidates in one
batch (one pipeline on Redis), so an engine finds the tails another engine of the pool wrote.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..store.metrics import StoreSampler
from ..store.tiers import local_size, tier_class
from .adapters import AdapterDigests
from .block_groups import BlockIds, load_rows, save_ids
from .config import ConnectorConfig
from .events import KVEvents
from .handover_flow import HandoverFlow
from .keys import PREFIX_LEN, chunk_keys
from .lookups import LookupJobs, remote_prefix
from .metadata import ChunkLoad, KVPoolMetadata, KVPoolWorkerMetadata, LoadJob, SaveJob
from .ranks import PartReports
from .requests import KeyIndex, RemoteAnswer, RequestRecord
from .stats import STORE_STATS_EVERY_S, KVPoolConnectorStats
from .tail_plans import SavedObjects, TailPlans
from .tails import part_candidates, part_usable, request_options, tail_candidates
from .warm import ManifestWriter, manifest_key, prewarm_keys, prewarm_objects, read_manifest

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger("kvpool.connector")

LOOKUP_TTL_S = 1.0  # a waiting request asks every step; reuse a recent answer
ADAPTER_WAIT_S = 5.0  # a request waits this long for its LoRA adapter's digest, then goes without the pool
DECODE_KEYS = 16384  # keys of saved decode KV remembered for the hit counters' kind label


class SchedulerSide:
    """`block_ids`: a request id -> the ids of its blocks in each KV cache group (vLLM's KV
    cache manager knows them; block_groups.py), read when a save is planned. `world_size`: the workers
    (tensor x pipeline parallel), each of which saves and reports its part of every chunk;
    `lower_store`: the shared tiers as every rank's objects make them (ranks.py)."""

    def __init__(self, cfg: ConnectorConfig, prefix: bytes, block_size: int,
                 blocks_per_chunk: int, chunk_bytes: int, world_size: int,
                 lower_store, block_ids: Callable[[str], BlockIds], is_async: bool,
                 load: bool = True, save: bool = True, manifest_store=None,
                 keep: list[int | None] | None = None):
        self.cfg = cfg
        self._block_ids = block_ids
        self.prefix = prefix
        self.block_size = block_size
        self.blocks_per_chunk = blocks_per_chunk
        self.chunk_tokens = cfg.chunk_tokens
        self.world_size = world_size
        self.lower = lower_store
        self.is_async = is_async
        # a hit all in the workers' own memory loads inside the step (no step of waiting);
        # not with several KV cache groups, where vLLM takes no failed load of a step's own
        # (by block id) but only an async one's (by request; loads.py fail_by_request)
        self.keep = keep or [None]  # per KV cache group, what an object stores (layout.py)
        self.sync_local = (is_async and cfg.sync_local_loads and len(self.keep) == 1
                           and not tier_class(cfg.tiers[0].type).shared)
        self.load_enabled = load  # kv_role kv_consumer / kv_both
        self.save_enabled = save  # kv_role kv_producer / kv_both
        first_local = tier_class(cfg.tiers[0].type).local
        local_bytes = local_size(cfg.tiers[0])
        self.index = KeyIndex(local_bytes // max(1, chunk_bytes) if local_bytes else 1)
        # a chunk enters the index once every worker reported its part stored (ranks.py; one
        # rank's part alone is never a hit)
        self._parts = PartReports(world_size)
        self._adapters = AdapterDigests(
            on_changed=lambda: self.stats.inc("kvpool_lora_adapters_changed"))
        # The index holds what the workers copied out and hand to a local first tier (cpu or
        # disk; a lower tier's own index may lag behind). With a remote first tier the
        # scheduler asks the tier itself, so a failed write is never taken for a hit.
        self.track_stored = first_local
        # A partial block leaves the engine whole: its slots past the tokens it holds keep
        # what an earlier request left there (the attention kernel's own layout of a block,
        # packed per ISA on CPU, leaves no token's bytes to zero). A pool that keeps
        # requests without a tenant salt out of the shared tiers and does not encrypt them
        # saves no partial block, so no such request's KV reaches them that way.
        parts_saved = not (cfg.require_cache_salt and not cfg.security.encrypt
                           and any(tier_class(t.type).shared for t in cfg.tiers))
        self.reqs: dict[str, RequestRecord] = {}
        self.inflight: set[bytes] = set()   # planned saves not yet reported stored
        self.await_saves: set[str] = set()  # finished, blocks held for save copies
        self.delayed: dict[str, int] = {}   # finished req -> unconfirmed copies
        self.stats = KVPoolConnectorStats()
        # the lower store's series (lookups' latencies, its health) go out with the stats
        self._sampler = (StoreSampler(lower_store) if lower_store is not None and cfg.metrics
                         else None)
        self._sampled_at = 0.0
        remote = any(tier_class(t.type).remote for t in cfg.tiers)
        self.jobs = LookupJobs(remote and lower_store is not None, cfg.lookup_wait_ms)
        self.chunk_bytes = chunk_bytes  # one rank's part of a chunk: what each worker writes
        self.events: KVEvents | None = None  # set by the connector when vLLM's KV events are on
        self.finish_saves: list[SaveJob] = []  # tails of finished requests, for the next step
        # decode chunks, tails and partial blocks saved here (bounded): a later hit of one is
        # counted as such (the load plan's ChunkLoad.kind). Lower tiers outlast the first
        # tier's index, so it keeps at least DECODE_KEYS (~2.5 MB of keys)
        self.decode_keys = KeyIndex(max(self.index.capacity, DECODE_KEYS))
        self.saved = SavedObjects(self.index, self.inflight, self.decode_keys, world_size)
        # tails and partial blocks: a lower tier that is all local (disk) is asked inline
        self.tails = TailPlans(self.saved, block_size, blocks_per_chunk, cfg.chunk_tokens,
                               self._options, parts_saved,
                               None if lower_store is None or self.jobs.remote
                               else lower_store.first_present, keep=self.keep)
        # prefill/decode through the pool (handover_flow.py); handovers_out: those returned
        # this step whose write-through the workers report later in the same step
        self.handover = HandoverFlow(lower_store, self.jobs, block_size, blocks_per_chunk,
                                     chunk_bytes, count=lambda *a: self.stats.inc(*a))
        self.handover.new_step(cfg.handover_step_bytes)
        self.handovers_out = self.handover.out
        self.hotset: ManifestWriter | None = None
        self._hotset_writes = 0
        # the warm start manifest's tiers (connector._manifest_store_config), else lower's: one
        # object of no rank, so the connector hands the store before any rank wrapper
        self.manifests = manifest_store if manifest_store is not None else lower_store
        if cfg.warm_start.enabled and lower_store is not None:
            self._warm_start(local_bytes, chunk_bytes)

    def _warm_start(self, cpu_bytes: int, chunk_bytes: int) -> None:
        """Count reused chunks into the pool's hot set (warm.py), and put the hot set's
        objects the workers pre-warmed (those the shared tier holds, within the byte budget,
        as the workers chose them) into the KeyIndex: hits in the workers' own memory."""
        ws = self.cfg.warm_start
        key = manifest_key(self.prefix)
        self.hotset = ManifestWriter(self.manifests, key, self.cfg.namespace, ws.top_k,
                                     ws.refresh_seconds)
        keys = prewarm_keys(read_manifest(self.manifests, key), self.prefix,
                            prewarm_objects(ws.max_bytes, cpu_bytes, chunk_bytes))
        present = self.lower.contains_many(keys) if keys else []
        warm = [k for k, ok in zip(keys, present, strict=True) if ok]
        for k in reversed(warm):  # the most-hit last: the index's most recent
            self.index.add(k)
        if warm:
            log.info("kvpool: warm start: %d hot set chunks in the workers' cpu tier",
                     len(warm))

    def enable_events(self, chunk_bytes: int) -> None:
        """Publish the local tiers' contents as vLLM KV events (events.py); a pool whose
        first tier is remote has nothing local to announce."""
        types = [t.type for t in self.cfg.tiers]
        if not tier_class(types[0]).local:
            return
        local = sum(local_size(t) for t in self.cfg.tiers)
        self.events = KVEvents(types, self.block_size, self.blocks_per_chunk,
                               capacity_chunks=local // max(1, chunk_bytes) + 1024)
        self.tails.events = self.events

    def close(self) -> None:
        self._adapters.close()
        if self.hotset is not None:
            self.hotset.close()  # the hits counted since the last refresh
        self.jobs.close()

    # -- lookups -----------------------------------------------------------------------
    def request_record(self, request: Request) -> RequestRecord:
        record = self.reqs.get(request.request_id)
        if record is None:
            prefix = self._adapters.prefix(self.prefix, request)
            record = self.reqs[request.request_id] = RequestRecord(
                request, prefix if prefix is not None else b"",
                adapter_wait_since=time.monotonic() if prefix is None else None)
            self.handover.read(record, self.cfg, self.save_enabled, self.load_enabled)
        else:
            record.request = request
        return record

    def _count_hits(self, keys: list[bytes]) -> tuple[int, int]:
        """(leading chunks present anywhere, of which leading ones in the KeyIndex)."""
        local = self.index.prefix_len(keys)
        n = local
        while n < len(keys) and self.lower is not None:
            more = self.lower.contains_prefix(keys[n:])
            if not more:
                break
            n += more
            n += self.index.prefix_len(keys[n:])
        return n, local

    def _adapter_known(self, record: RequestRecord) -> bool:
        """False while the request's adapter is being digested (ask again next step); after
        ADAPTER_WAIT_S the request goes on without the pool. Until then it has no prefix: it
        is neither looked up nor saved."""
        if record.adapter_wait_since is None:
            return True
        prefix = self._adapters.prefix(self.prefix, record.request)
        if prefix is None and time.monotonic() - record.adapter_wait_since < ADAPTER_WAIT_S:
            return False
        if prefix is None:
            self.stats.inc("kvpool_lora_digest_late")
        record.prefix, record.adapter_wait_since = prefix or b"", None
        return True

    def _isolated(self, record: RequestRecord) -> bool:
        """A request that neither reads nor writes the pool: require_cache_salt and no
        tenant salt, or an adapter kvpool cannot identify."""
        return not record.prefix or (self.cfg.require_cache_salt
                                     and not getattr(record.request, "cache_salt", None))

    def num_matched(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        record = self.request_record(request)
        record.local_tokens = num_computed_tokens  # after_alloc counts what neither cache held
        if not self._adapter_known(record):
            return None, False  # its adapter's identity is being computed: ask again
        if not self.load_enabled or self._isolated(record):
            return 0, False
        hashes = request.block_hashes
        now = time.monotonic()
        if record.handover_state != "off":
            ready = self.handover.ready(record, now, self.cfg.handover_wait_seconds)
            if ready is None:
                return None, False  # its objects are not all visible yet: ask again
        last = record.lookup
        if record.handover_state == "ready":
            hit = record.hit_chunks  # the handover's objects, never a shorter lookup
        elif last and last[0] == len(hashes) and now - last[2] < LOOKUP_TTL_S:
            hit = last[1]
        else:
            found = self._lookup(record, hashes, now)
            if found is None:
                return None, False  # a remote lookup is in flight: ask again next step
            hit = found
            self.tails.lookup(record, hit)
        record.hit_chunks = hit
        hit_tokens = self.tails.hit_tokens(record)
        if hit_tokens <= num_computed_tokens:
            return 0, False
        record.load_async = self.is_async and not (self.sync_local and record.all_local())
        return hit_tokens - num_computed_tokens, record.load_async

    def _lookup(self, record: RequestRecord, hashes: list, now: float) -> int | None:
        """Leading chunks present; None while a remote part of the lookup is running."""
        t0 = time.perf_counter()
        if record.pending is not None:
            n_hashes, local, fut = record.pending
            if not fut.done():
                return None
            record.pending = None
            try:
                answer = fut.result()
            except Exception:  # the store never raises; a broken pool is a miss
                answer = RemoteAnswer(0)
            record.remote_tail = answer
            more = answer.more
            keys = chunk_keys(record.prefix, hashes[:n_hashes], self.blocks_per_chunk)
            hit = local + more
            if more:
                hit += self.index.prefix_len(keys[hit:])
            record.hit_local_index = local
        else:
            keys = chunk_keys(record.prefix, hashes, self.blocks_per_chunk)
            local = self.index.prefix_len(keys)
            if self.jobs.remote and local < len(keys):
                rest = keys[local:]
                tails = parts = None
                if self._options(record)[1]:  # the tails that could follow what is found
                    tails = functools.partial(
                        tail_candidates, record.prefix, list(hashes),
                        blocks_per_chunk=self.blocks_per_chunk,
                        max_blocks=self.tails.claimable_blocks(record.request))
                    if part_usable(record.request):
                        parts = functools.partial(
                            part_candidates, record.prefix, list(hashes),
                            list(record.request.all_token_ids), block_size=self.block_size,
                            max_tokens=record.request.num_tokens - 1)
                fut = self.jobs.submit(self._remote_lookup, rest, local, tails, parts)
                record.pending = (len(hashes), local, fut)
                answered = self.jobs.answered(fut)
                self.stats.inc("kvpool_lookup_seconds", time.perf_counter() - t0)
                if answered:
                    return self._lookup(record, hashes, now)
                self.stats.inc("kvpool_lookups_deferred")
                return None
            hit, record.hit_local_index = self._count_hits(keys)
            n_hashes = len(hashes)
            record.remote_tail = None
        self.stats.inc("kvpool_lookup_seconds", time.perf_counter() - t0)
        self.stats.inc("kvpool_lookups")
        record.lookup = (n_hashes, hit, now)
        return hit

    def _remote_lookup(self, keys: list[bytes], local: int,
                       tails: Callable[..., list[tuple[int, bytes]]] | None,
                       parts: Callable[..., list[tuple[int, bytes]]] | None = None
                       ) -> RemoteAnswer:
        """On the lookup pool: the leading chunks in the lower tiers, then the longest
        tail object after them, then the longest partial-block object after that (each
        set of candidates in one batch: one round trip on Redis)."""
        more = remote_prefix(self.lower, keys)
        answer = RemoteAnswer(more)
        if tails is not None:
            answer.tail_at = local + more
            cands = tails(full_chunks=answer.tail_at)
            i = self.lower.first_present([k for _, k in cands]) if cands else None
            blocks = answer.tail_at * self.blocks_per_chunk
            if i is not None:
                answer.tail_key = cands[i][1]
                blocks += cands[i][0]
            if parts is not None:
                answer.part_at = blocks
                pcands = parts(n_blocks=blocks)
                j = self.lower.first_present([k for _, k in pcands]) if pcands else None
                if j is not None:
                    answer.part_key = pcands[j][1]
        return answer

    def after_alloc(self, request: Request, blocks, num_external_tokens: int) -> None:
        record = self.request_record(request)
        # vLLM calls this once per admission (a new request, or one resumed after a preemption):
        # what the engine now prefills is what neither its prefix cache nor the pool held. The
        # autoscaling trigger on this counter credits pool hits, which queue depth does not.
        if request.num_computed_tokens > 0:
            # admitted again once its load between steps is done (WAITING_FOR_REMOTE_KVS),
            # with no external tokens and num_computed_tokens at what loaded (a preemption
            # resets it to 0): counted at its first admission, all but what a failed load
            # left to recompute (counting the prompt again doubled the decode side of P/D)
            computed = record.admitted_cached - request.num_computed_tokens
        else:
            computed = request.num_tokens - record.local_tokens - max(num_external_tokens, 0)
            record.admitted_cached = record.local_tokens + max(num_external_tokens, 0)
        if computed > 0:
            self.stats.inc("kvpool_prompt_tokens_computed", computed)
        # the hot set is the engine's own key space: an adapter's chunks are not counted
        if self.hotset is not None and not self._isolated(record) and record.prefix == self.prefix:
            self._count_reused(record, num_external_tokens)
        if num_external_tokens <= 0:
            return
        block_ids = blocks.get_block_ids()
        hit_tokens = self.tails.hit_tokens(record)
        first_block = (hit_tokens - num_external_tokens) // self.block_size
        last_block = hit_tokens // self.block_size  # exclusive
        keys = chunk_keys(record.prefix, request.block_hashes, self.blocks_per_chunk,
                          limit=record.hit_chunks)
        chunks: list[ChunkLoad] = []
        for c, key in enumerate(keys):
            lo = max(first_block, c * self.blocks_per_chunk)
            hi = min(last_block, (c + 1) * self.blocks_per_chunk)
            if lo >= hi:
                continue
            rows, dst = load_rows(block_ids, lo, hi, c * self.blocks_per_chunk,
                                  self.blocks_per_chunk)
            chunks.append(ChunkLoad(key, rows, dst,
                                    kind="decode" if key in self.decode_keys else "prompt"))
        self.tails.add_loads(record, chunks, first_block, last_block, block_ids)
        record.load = LoadJob(request.request_id, chunks, record.load_async)
        if self.events is not None:  # a lower-tier hit is promoted into the first tier
            for c, key in enumerate(keys):
                self.events.remember(request, c, key)
            if record.tail_key is not None:
                start = record.hit_chunks * self.blocks_per_chunk
                self.events.remember_blocks(request, start, start + record.tail_blocks,
                                            record.tail_key)
        self.stats.inc("kvpool_lookup_hit_tokens", num_external_tokens)
        # Chunks the store already holds need no save (a handover writes them through anyway:
        # a hit from the worker's memory says nothing of the shared tiers).
        if not record.handover_out:
            record.next_save = max(record.next_save, record.hit_chunks)

    def _count_reused(self, record: RequestRecord, num_external_tokens: int) -> None:
        """The full chunks of the prompt that vLLM's prefix cache or the pool held: hits of
        the hot set (warm.py)."""
        assert self.hotset is not None
        request = record.request
        reused = min(record.local_tokens + max(num_external_tokens, 0),
                     request.num_prompt_tokens) // self.chunk_tokens
        if reused > 0:
            keys = chunk_keys(record.prefix, request.block_hashes, self.blocks_per_chunk,
                              limit=reused)
            self.hotset.add([k[PREFIX_LEN:] for k in keys])
        writes = self.hotset.writes
        if writes > self._hotset_writes:
            self.stats.inc("kvpool_hotset_writes", writes - self._hotset_writes)
            self._hotset_writes = writes

    # -- per-step plan -----------------------------------------------------------------
    def build_meta(self, scheduler_output) -> KVPoolMetadata:
        meta = KVPoolMetadata()
        self.jobs.new_step()  # the next step's lookups may wait again
        self.handover.new_step(self.cfg.handover_step_bytes)  # its write-through budget
        for waiting in self.reqs.values():
            if waiting.load is not None:
                meta.loads.append(waiting.load)
                waiting.load = None
        for req_id, n_sched in scheduler_output.num_scheduled_tokens.items():
            record = self.reqs.get(req_id)
            if record is None:
                continue
            job = self._plan_save(record, n_sched)
            if job is not None:
                meta.saves.append(job)
                if job.durable and record.durable_capped:  # past the cap: the rest, behind
                    rest = self._plan_save(record, n_sched)
                    if rest is not None:
                        meta.saves.append(rest)
            meta.saves.extend(self._plan_prompt_tail(record, n_sched))
        meta.saves.extend(self.finish_saves)
        self.finish_saves = []
        meta.await_saves = set(self.await_saves)
        self.await_saves.clear()
        meta.preempted = set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        meta.idle = not scheduler_output.total_num_scheduled_tokens
        meta.handover_waiting = meta.idle and any(r.handover_state == "wait"
                                                  for r in self.reqs.values())
        return meta

    def _plan_save(self, record: RequestRecord, n_sched: int) -> SaveJob | None:
        if not self.save_enabled or self._isolated(record):
            return None
        req = record.request
        done_tokens = req.num_computed_tokens + n_sched
        if not self._options(record)[0]:
            done_tokens = min(done_tokens, req.num_prompt_tokens)
        n_chunks = min(done_tokens // self.chunk_tokens,
                       len(req.block_hashes) // self.blocks_per_chunk)
        if n_chunks <= record.next_save:
            return None
        durable = self.handover.durable(record)
        if durable:
            cut = self.handover.room(record, n_chunks, self.cfg.handover_max_bytes)
            durable = cut > record.next_save  # capped before its first chunk: all behind
            if durable:
                n_chunks = cut  # the rest of the step's chunks: build_meta plans them behind
        if record.next_save < record.hit_chunks and not durable:
            record.next_save = record.hit_chunks
        keys = chunk_keys(record.prefix, req.block_hashes, self.blocks_per_chunk,
                          start=record.next_save,
                          limit=n_chunks)
        first = record.next_save
        record.next_save = n_chunks
        block_ids = self._block_ids(req.request_id)
        out_keys, out_blocks, kinds = [], [], []
        for i, key in enumerate(keys):
            if self.saved.known(key) and not durable:
                continue  # another request already stores this chunk
            c = first + i
            ids = save_ids(block_ids, c * self.blocks_per_chunk, (c + 1) * self.blocks_per_chunk,
                           self.keep)
            if ids is None:  # not allocated, or out of a sliding window already
                continue
            out_keys.append(key)
            out_blocks.append(ids)
            decode = (c + 1) * self.chunk_tokens > req.num_prompt_tokens
            kinds.append("decode" if decode else "prompt")
            if decode:
                self.decode_keys.add(key)
            self.inflight.add(key)
            if self.events is not None:
                self.events.remember(req, c, key)
        if not out_keys:
            return None
        record.pending_copies += self.world_size
        if durable:
            record.durable_pending += self.world_size
            self.handover.wrote_through(record, len(out_keys) * self.chunk_bytes)
        return SaveJob(req.request_id, out_keys, out_blocks, kinds, durable=durable)

    # -- worker feedback ---------------------------------------------------------------
    def on_worker_meta(self, worker_meta: KVPoolWorkerMetadata | None) -> None:
        if worker_meta is None:
            return
        stored = self._parts.complete(worker_meta.stored_keys, worker_meta.dropped_keys,
                                      keep=self.index.capacity + len(self.inflight))
        for k in stored:
            if self.track_stored:
                self.index.add(k)
            self.inflight.discard(k)
        if stored and self.lower is not None:
            self.lower.forget_absent(stored)  # no stale "missing" for a new chunk
        for k in worker_meta.dropped_keys:
            self.inflight.discard(k)
        for req_id, keys in worker_meta.failed_loads.items():
            self._load_failed(req_id, keys)
        if self.events is not None:
            self.events.on_worker_meta(stored, worker_meta.dropped_keys,
                                       worker_meta.tier_events)
        self.handover.reports(worker_meta, self.reqs)
        for req_id, n in worker_meta.copied_saves.items():
            record = self.reqs.get(req_id)
            if record is not None:
                record.pending_copies -= n
            elif req_id in self.delayed:
                self.delayed[req_id] -= n
                if self.delayed[req_id] <= 0:
                    del self.delayed[req_id]

    def _load_failed(self, req_id: str, keys: list[bytes]) -> None:
        """Chunks that could not be loaded are recomputed: save them again afterwards."""
        for k in keys:
            self.index.discard(k)
        record = self.reqs.get(req_id)
        if record is None:
            return
        all_keys = chunk_keys(record.prefix, record.request.block_hashes, self.blocks_per_chunk,
                              limit=record.hit_chunks)
        bad = set(keys)
        tail_bad = record.tail_key is not None and record.tail_key in bad
        if tail_bad or (record.part_key is not None and record.part_key in bad):
            record.part_tokens, record.part_key = 0, None  # the part follows the tail
            record.lookup = None
        if tail_bad:
            record.tail_blocks, record.tail_key = 0, None
        first = next((i for i, k in enumerate(all_keys) if k in bad), None)
        if first is not None:
            record.hit_chunks = min(record.hit_chunks, first)
            record.next_save = min(record.next_save, first)
            record.lookup = None
        record.handover_state = "off"  # what is left of the handover is recomputed

    def finished(self, request: Request, block_ids: BlockIds | None = None) -> bool:
        """True: keep the blocks until the workers report their save copies done."""
        record = self.reqs.pop(request.request_id, None)
        if record is not None and block_ids is not None:
            self._plan_finish_tail(record, block_ids)
        if record is None or record.pending_copies <= 0:
            return False
        self.delayed[request.request_id] = record.pending_copies
        self.await_saves.add(request.request_id)
        return True

    def finish(self, request: Request, block_ids: BlockIds | None = None
               ) -> tuple[bool, dict[str, Any] | None]:
        """`finished` and, for a prefill asked for one, the handover (handover.py)."""
        record = self.reqs.get(request.request_id)
        params = self._handover_params(record) if record is not None else None
        return self.finished(request, block_ids), params

    # -- prefill/decode through the pool (handover_flow.py) --------------------------------
    def _handover_params(self, record: RequestRecord) -> dict[str, Any] | None:
        """The handover of a finished prefill asked for one: what its saves wrote through of
        the prompt but its last token (the decode engine computes that one)."""
        req = record.request
        status = getattr(getattr(req, "status", None), "name", "")
        if (not record.handover_out or self.lower is None or self._isolated(record)
                or status not in ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")):
            return None
        tokens = req.num_prompt_tokens - 1
        if not part_usable(req) or not self.tails.parts_saved:  # no partial block: whole blocks
            tokens -= tokens % self.block_size
        if not self._options(record)[1]:  # no tails: full chunks only
            tokens -= tokens % self.chunk_tokens
        return self.handover.params(record, tokens)

    def hit_sources(self, request: Request) -> tuple[int, int]:
        """(chunks from the workers' local first tier, chunks from lower tiers) of the last
        lookup."""
        record = self.reqs.get(request.request_id)
        if record is None:
            return 0, 0
        return record.hit_local_index, record.hit_chunks - record.hit_local_index

    def tail_hit_local(self, request: Request) -> bool:
        """Whether the last lookup found a tail or a partial block after its chunks, and each
        of them it found came from the workers' local first tier."""
        record = self.reqs.get(request.request_id)
        return (record is not None
                and (record.tail_key is not None or record.part_key is not None)
                and (record.tail_key is None or record.tail_local)
                and (record.part_key is None or record.part_local))

    def take_stats(self) -> KVPoolConnectorStats | None:
        now = time.monotonic()
        if self._sampler is not None and now - self._sampled_at >= STORE_STATS_EVERY_S:
            self._sampled_at = now
            self.stats.merge(self._sampler.sample())
        if self.stats.is_empty():
            return None
        out, self.stats = self.stats, KVPoolConnectorStats()
        return out

    # -- tail objects and decode KV (tail_plans.py) ----------------------------------------
    def _options(self, record: RequestRecord) -> tuple[bool, bool]:
        """(save decode KV, use tails) for this request (config + kv_transfer_params)."""
        return request_options(record.request, self.cfg.save_decode_tokens,
                               self.cfg.tail_objects)

    def _tails_saved(self, record: RequestRecord) -> bool:
        return (self.save_enabled and not self._isolated(record)
                and self._options(record)[1])

    def _plan_prompt_tail(self, record: RequestRecord, n_sched: int) -> list[SaveJob]:
        """At the step that ends the prompt's prefill, once: its tail (tail_plans.py)."""
        req = record.request
        if record.prompt_tail_done or req.num_computed_tokens + n_sched < req.num_prompt_tokens:
            return []
        record.prompt_tail_done = True
        if not self._tails_saved(record):
            return []
        return self.tails.prompt_tail_jobs(record, self._block_ids(req.request_id),
                                           self.handover.durable(record))

    def _plan_finish_tail(self, record: RequestRecord, block_ids: BlockIds) -> None:
        """A request that finished computing: its tail, saved in the next step."""
        status = getattr(getattr(record.request, "status", None), "name", "")
        if status not in ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED"):
            return  # aborted: what was computed is uncertain; preempted: nothing held
        if self._tails_saved(record):
            self.finish_saves.extend(self.tails.finish_jobs(record, block_ids))
