"""Worker-side half: copies chunks between vLLM's paged KV cache and the tiered store.

Saves: after the forward pass (`wait_for_save`), each newly completed chunk is gathered (all
layers) into one pooled chunk buffer (buffers.py): a memcpy on CPU, an async copy into
pinned host memory on a dedicated CUDA stream. A saver thread then hands the buffers to
`store.put_many` (cpu tier synchronously, lower tiers through the store's bounded queues),
so the forward pass never waits on disk, Redis or S3. A store that is only this
process's memory (one cpu tier) takes the chunks in the step instead (`_save_now`), and
async loads from this process's memory run in the step too (`submit_loads`): no second
Python thread contends for the GIL with the forward. A full save queue or an exhausted
save pool drops the save (a future miss, counted): host memory stays within
`staging_bytes`.

Loads: `get_many_into` probes the tiers in order (a lower-tier hit is promoted into the cpu
tier), verifying each object before its load buffer is used (a failed one is zeroed), in
batches through a fixed set of load buffers; the chunks are then scattered into their blocks. Async loads run
on a loader thread while the request waits (`finished_recving` when done). Layerwise loads
run inside the forward: the loader scatters layer by layer and `wait_for_layer_load(i)`
waits only for layer i, so layer i+1 copies while layer i computes. A chunk that is
missing, of the wrong size, or fails its MAC in the store is reported through
`get_block_ids_with_load_errors`.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..store.metrics import tier_deltas
from .audit import KVAudit
from .buffers import BufferPool
from .layout import KVLayout
from .metadata import KVPoolMetadata, KVPoolWorkerMetadata, LoadJob, SaveJob
from .stats import STORE_STATS_EVERY_S, KVPoolConnectorStats, StoreSampler, kind_tier
from .warm import Prewarmer, PrewarmResult

log = logging.getLogger("kvpool.connector")

SAVE_QUEUE = 64  # save batches waiting for the store before new ones are dropped
SHUTDOWN_FLUSH_S = 10.0  # bound on waiting for lower-tier writes at shutdown
LOAD_BATCH_CHUNKS = 8  # chunks per store read, each read with its own time bound
# An idle step (nothing scheduled: the requests wait for their loads) waits this long for an
# in-flight load instead of returning to vLLM's engine loop, which would call it again at
# once: that loop holds the GIL between its calls, and the loader thread, reacquiring the GIL
# after every copy, then waited a switch interval (5 ms) per copy. Measured with a 16k-token
# hit on the tiny model: 45,000 empty steps and a 5 s load; a new request waits at most this.
IDLE_WAIT_S = 0.02


@dataclass
class _PendingSave:
    job: SaveJob
    bufs: list[torch.Tensor]  # one pooled buffer per chunk
    event: Any  # torch.cuda.Event of the gather, None on CPU (copy already done)
    queued: bool = True   # False: the save queue was full, the save is dropped
    sizes: list[int] | None = None  # bytes per object when some are tails (shorter)

    def chunks(self) -> list[torch.Tensor]:
        if self.sizes is None:
            return self.bufs
        return [b[:n] for b, n in zip(self.bufs, self.sizes, strict=True)]


@dataclass
class _Load:
    job: LoadJob
    done: threading.Event = field(default_factory=threading.Event)
    layer_done: list[threading.Event] = field(default_factory=list)
    failed_blocks: set[int] = field(default_factory=set)
    nbytes: int = 0
    chunks_ok: int = 0


class WorkerSide:
    def __init__(self, store, blocks_per_chunk: int, layerwise: bool,
                 audit: KVAudit | None = None, staging_bytes: int = 1 << 30,
                 events: bool = False, store_metrics: bool = True, block_size: int = 0,
                 count_tokens: bool = True):
        self.store = store
        # labels of the per-tier object counters: saves land in the first tier (put_many's
        # answer), hits name the tier that served them (get_many_into's served_by)
        self._first_tier = store.tier_names()[0]
        self.block_size = block_size  # tokens per vLLM block: the hit token counters
        self.count_tokens = count_tokens  # tensor-parallel rank 0: tokens counted once
        # the store's series reach /metrics only through vLLM's stats (stats.py)
        self._sampler = StoreSampler(store) if store_metrics else None
        self.events = events  # vLLM KV events on: report the local tiers' stores/evictions
        if events:
            store.enable_events()
        self.audit = audit
        self.staging_bytes = staging_bytes
        self._save_pool: BufferPool | None = None
        self._load_pool: BufferPool | None = None
        self.blocks_per_chunk = blocks_per_chunk
        self.layerwise = layerwise
        self.layout: KVLayout | None = None
        self.cuda = False
        self.copy_stream: Any = None  # torch.cuda.Stream once registered on CUDA
        self._lock = threading.Lock()
        self._save_q: queue.Queue = queue.Queue(SAVE_QUEUE)
        self._load_q: queue.Queue = queue.Queue()
        self._uncopied: list[_PendingSave] = []        # CUDA gathers in flight
        self._copies_by_req: dict[str, int] = defaultdict(int)  # save jobs not yet copied
        self._copied: dict[str, int] = defaultdict(int)          # to report to scheduler
        self._await: set[str] = set()                  # finished reqs awaiting copies
        self._stored: list[bytes] = []
        # chunk key -> (its save, index): copied out of the paged cache, not yet in the store
        self._pending: dict[bytes, tuple[_PendingSave, int]] = {}
        self._dropped: list[bytes] = []
        self._async_loads: dict[str, _Load] = {}
        self._sync_loads: list[_Load] = []
        self._load_errors: set[int] = set()
        self._failed_keys: dict[str, list[bytes]] = {}
        self._durable_done: dict[str, int] = {}  # handover save jobs written through
        self._durable_failed: dict[str, list[bytes]] = {}  # and their keys that were not
        self._stats = KVPoolConnectorStats()
        self._stats_lock = threading.Lock()
        self._store_stats_prev: dict = {}
        self._store_stats_at = 0.0
        self._sample_store = False
        self._save_in_step = False  # set in register: a memory-only store saves in the step
        self._stop = False
        self._prewarmed: set[bytes] = set()  # keys the warm start put in the cpu tier
        self._prewarmer: Prewarmer | None = None
        self._threads = [threading.Thread(target=self._saver, name="kvpool-saver", daemon=True),
                         threading.Thread(target=self._loader, name="kvpool-loader", daemon=True)]
        for t in self._threads:
            t.start()

    def register(self, layout: KVLayout) -> None:
        self.layout = layout
        self.cuda = layout.device.type == "cuda"
        memory_only = getattr(self.store, "memory_only", None)
        self._save_in_step = not self.cuda and bool(memory_only and memory_only())
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device=layout.device)
        chunk = layout.chunk_nbytes(self.blocks_per_chunk)
        # loads: one batch in flight on the loader thread and one in the step (in-memory
        # loads, submit_loads); saves: the rest of the budget
        self._load_pool = BufferPool(chunk, 2 * LOAD_BATCH_CHUNKS, self.cuda)
        self._save_pool = BufferPool(chunk, max(1, self.staging_bytes // chunk
                                                - 2 * LOAD_BATCH_CHUNKS), self.cuda)

    # -- warm start (warm.py) ----------------------------------------------------------
    def prewarm(self, keys: list[bytes], max_bytes: int, max_seconds: float) -> PrewarmResult:
        """Load the hot set's `keys` into the cpu tier: here for at most `max_seconds`
        (engine start waits), the rest in the background. Loaded keys are reported to the
        scheduler like saved ones (its KeyIndex) and their later hits counted."""
        def loaded(batch: list[bytes], nbytes: int) -> None:
            self._prewarmed.update(batch)
            with self._lock:
                self._stored.extend(batch)
            self._inc("kvpool_prewarm_objects", len(batch))
            self._inc("kvpool_prewarm_bytes", nbytes)

        self._prewarmer = Prewarmer(self.store, keys, max_bytes, on_loaded=loaded)
        result = self._prewarmer.run(max_seconds)
        if result.done:
            self._prewarm_done(result)
        else:
            threading.Thread(target=self._prewarm_wait, name="kvpool-prewarm-wait",
                             daemon=True).start()
        return result

    def _prewarm_wait(self) -> None:
        p = self._prewarmer
        if p is not None and p.thread is not None:
            p.thread.join()
            self._prewarm_done(p.result)

    def _prewarm_done(self, r: PrewarmResult) -> None:
        self._inc("kvpool_prewarm_seconds", r.seconds)
        self._inc("kvpool_prewarm_misses", r.misses)
        log.info("kvpool: warm start loaded %d objects (%d bytes, %d misses) in %.2f s",
                 r.objects, r.nbytes, r.misses, r.seconds)

    # -- saves -------------------------------------------------------------------------
    @contextlib.contextmanager
    def _in_step(self, phase: str):
        """Count the time the engine's step spends here (`kvpool_step_seconds{phase}`): the
        connector's share of every request's TTFT and inter-token latency. Tensor-parallel
        rank 0 only: the ranks copy side by side, and a sum over them would read as twice
        the engine's time."""
        if not self.count_tokens:
            yield
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._inc("kvpool_step_seconds", time.perf_counter() - t0, phase)

    def submit_saves(self, meta: KVPoolMetadata) -> None:
        with self._in_step("save"):
            self._submit_saves(meta)

    def _submit_saves(self, meta: KVPoolMetadata) -> None:
        assert self.layout is not None and self._save_pool is not None
        layout = self.layout
        for job in meta.saves:
            n = len(job.keys)
            with self._lock:
                self._copies_by_req[job.req_id] += 1
            if self._save_in_step and not job.durable and self._save_in_place(job):
                continue
            bufs = self._save_pool.take(n)
            if bufs is None:  # the staging budget is in use by saves still on their way
                self._drop(job.keys)
                self._mark_copied(_PendingSave(job, [], None, queued=False))
                if job.durable:
                    self._durable_result(job, [False] * n)
                continue
            event = None
            if self.cuda:
                # Order after this step's forward, copy on our own stream, never sync here.
                self.copy_stream.wait_stream(torch.cuda.current_stream(layout.device))
                with torch.cuda.stream(self.copy_stream):
                    for buf, ids in zip(bufs, job.block_ids, strict=True):
                        layout.gather(torch.tensor(ids, dtype=torch.long), buf)
                    event = torch.cuda.Event()
                    event.record(self.copy_stream)
            else:
                for buf, ids in zip(bufs, job.block_ids, strict=True):
                    layout.gather(torch.tensor(ids, dtype=torch.long), buf)
            pending = _PendingSave(job, bufs, event)
            if any(len(ids) != self.blocks_per_chunk for ids in job.block_ids):
                pending.sizes = [layout.chunk_nbytes(len(ids)) for ids in job.block_ids]
            if job.durable:  # a handover: in the shared tiers before the step's output
                if event is not None:
                    event.synchronize()
                self._save_now(pending)
                continue
            if event is None and self._save_in_step:
                self._save_now(pending)
                continue
            # Loads find the chunk in its save buffer until the store holds it; registered
            # before the saver can see the job, so it can never outlive the saver's put.
            with self._lock:
                for i, key in enumerate(job.keys):
                    self._pending[key] = (pending, i)
            try:
                self._save_q.put_nowait(pending)
            except queue.Full:
                pending.queued = False
                self._unregister(pending)
                self._drop(job.keys)
            if event is None:
                self._mark_copied(pending)
            else:
                self._uncopied.append(pending)

    def _save_now(self, p: _PendingSave) -> None:
        """A store that is only this process's memory takes the chunks here, in the step:
        a memcpy each. Handing them to the saver thread instead cost the forward far more
        than the copies: the saver holds the GIL while the forward's OpenMP threads spin
        on both cores, so each GIL handoff waited for the OS to preempt a spinning thread
        (see docs/connector.md, Hot path)."""
        job, objects = p.job, p.chunks()  # tails are shorter than a chunk
        assert self.layout is not None and self._save_pool is not None  # set by register()
        durable = [False] * len(job.keys)
        try:
            if job.durable:
                landed, durable = self.store.put_many_through(job.keys, objects)
            else:
                landed = self.store.put_many(job.keys, objects)
        except Exception:  # a failing store degrades service, never the engine
            log.exception("kvpool: save of %d chunks failed", len(job.keys))
            landed = [False] * len(job.keys)
        if job.durable:
            self._durable_result(job, durable)
        ok = [bool(x) for x in landed]
        if self.audit is not None and any(ok):
            self.audit.saved(self.layout, [k for k, good in zip(job.keys, ok, strict=True) if good],
                             [o for o, good in zip(objects, ok, strict=True) if good],
                             [len(ids) for ids, good in zip(job.block_ids, ok, strict=True)
                              if good])
        self._saved(job, ok, [o.numel() for o in objects])
        self._save_pool.give(p.bufs)

    def _save_in_place(self, job: SaveJob) -> bool:
        """A store that is only this process's memory: each chunk gathered out of the paged
        cache straight into its slot in the cpu tier (store.write_in_place), one copy where
        a gather into a staging buffer and put_many's copy of it made two. False: the store
        cannot take this job so (a chunk larger than its slots): the staging path saves it."""
        layout = self.layout
        write = getattr(self.store, "write_in_place", None)
        if write is None or layout is None or not layout.host_flat:
            return False
        sizes = [layout.chunk_nbytes(len(ids)) for ids in job.block_ids]
        audit = self.audit

        def fill(i: int, view: memoryview) -> bool:
            out = torch.frombuffer(view, dtype=torch.uint8)
            layout.gather(torch.tensor(job.block_ids[i], dtype=torch.long), out)
            if audit is not None:  # the bytes the tier now holds, as a load will read them
                audit.saved(layout, [job.keys[i]], [out], [len(job.block_ids[i])])
            return True

        try:
            landed = write(job.keys, sizes, fill)
        except Exception:  # a failing store degrades service, never the engine
            log.exception("kvpool: save of %d chunks failed", len(job.keys))
            landed = [False] * len(job.keys)
        if landed is None:
            return False
        self._saved(job, [bool(x) for x in landed], sizes)
        return True

    def _saved(self, job: SaveJob, ok: list[bool], sizes: list[int]) -> None:
        """A save done in the step: report the job copied, its landed keys stored (the
        rest dropped), and count them."""
        stored = [k for k, good in zip(job.keys, ok, strict=True) if good]
        with self._lock:
            self._copies_by_req[job.req_id] -= 1
            if self._copies_by_req[job.req_id] <= 0:
                del self._copies_by_req[job.req_id]
            self._copied[job.req_id] += 1
            self._stored.extend(stored)
        if len(stored) < len(job.keys):
            self._drop([k for k, good in zip(job.keys, ok, strict=True) if not good])
        if stored:
            self._inc("kvpool_saved_chunks", len(stored))
            self._inc("kvpool_saved_bytes",
                      sum(n for n, good in zip(sizes, ok, strict=True) if good))
            for kind, good in zip(job.kinds, ok, strict=False):  # kinds may be unset
                if good:
                    self._inc("kvpool_saved_objects", 1, kind_tier(kind, self._first_tier))

    def _durable_result(self, job: SaveJob, durable: list[bool]) -> None:
        """Report a handover's write-through to the scheduler (worker metadata)."""
        with self._lock:
            self._durable_done[job.req_id] = self._durable_done.get(job.req_id, 0) + 1
            bad = [k for k, ok in zip(job.keys, durable, strict=True) if not ok]
            if bad:
                self._durable_failed.setdefault(job.req_id, []).extend(bad)

    def _unregister(self, p: _PendingSave) -> None:
        """Forget p's save buffers as a source for loads (only entries that are still p's)."""
        with self._lock:
            for key in p.job.keys:
                entry = self._pending.get(key)
                if entry is not None and entry[0] is p:
                    del self._pending[key]

    def _drop(self, keys: list[bytes]) -> None:
        with self._lock:
            self._dropped.extend(keys)
        self._inc("kvpool_save_dropped_chunks", len(keys))

    def _mark_copied(self, p: _PendingSave) -> None:
        """The chunk left the paged KV cache: its blocks may be reused, and (served from its
        save buffer until the store holds it) it counts as stored right away."""
        assert self.layout is not None and self._save_pool is not None  # saves follow register()
        if self.audit is not None and p.queued:
            self.audit.saved(self.layout, p.job.keys, p.chunks(),
                             [len(ids) for ids in p.job.block_ids])
        with self._lock:
            self._copies_by_req[p.job.req_id] -= 1
            if self._copies_by_req[p.job.req_id] <= 0:
                del self._copies_by_req[p.job.req_id]
            self._copied[p.job.req_id] += 1
            if p.queued:
                self._stored.extend(p.job.keys)
        if p.queued:
            self._inc("kvpool_saved_chunks", len(p.job.keys))
            self._inc("kvpool_saved_bytes", sum(b.numel() for b in p.chunks()))
            for kind in p.job.kinds:
                self._inc("kvpool_saved_objects", 1, kind_tier(kind, self._first_tier))
        elif p.bufs:  # copied, but not going anywhere
            self._save_pool.give(p.bufs)

    def _poll_copies(self, wait: bool = False) -> None:
        still = []
        for p in self._uncopied:
            if wait:
                p.event.synchronize()
            if p.event.query():
                self._mark_copied(p)
            else:
                still.append(p)
        self._uncopied = still

    def _saver(self) -> None:
        while not self._stop:
            p = self._save_q.get()
            if p is None:
                return
            try:
                if p.event is not None:
                    p.event.synchronize()  # background thread: the hot path never waits
                self.store.put_many(p.job.keys, p.chunks())
            except Exception:  # a failing backend degrades service, never the engine
                log.exception("kvpool: save of %d chunks failed", len(p.job.keys))
                with self._lock:
                    self._dropped.extend(p.job.keys)
                self._inc("kvpool_save_dropped_chunks", len(p.job.keys))
            finally:
                self._unregister(p)  # loads copy from _pending under the lock: safe to reuse
                assert self._save_pool is not None  # saves follow register()
                self._save_pool.give(p.bufs)

    def preempted(self, req_ids: set[str]) -> None:
        """Blocks of preempted requests are reused next: finish their copies now."""
        if self.cuda and self._uncopied and any(p.job.req_id in req_ids for p in self._uncopied):
            self._poll_copies(wait=True)

    # -- loads -------------------------------------------------------------------------
    def submit_loads(self, meta: KVPoolMetadata) -> None:
        """Loads whose chunks are all in the process's own memory (the cpu tier, or save
        buffers on their way there) run here, before the forward, as vLLM's native
        offloading does: a few memcpys. An async one is done when this step's get_finished
        reports, so the request always resumes next step (on the loader thread it competed
        with the forward for the GIL and cores and missed that report whenever the forward
        was the shorter); a sync one (the scheduler's sync_local_loads) is in its blocks
        before the forward computes the rest of the prompt in this very step. Everything
        else (lower tiers, layerwise loads) runs on the loader thread."""
        with self._in_step("load"):
            self._submit_loads(meta)

    def _submit_loads(self, meta: KVPoolMetadata) -> None:
        n_layers = len(self.layout.layers) if self.layout else 0
        for job in meta.loads:
            load = _Load(job, layer_done=[threading.Event() for _ in range(n_layers)])
            if job.is_async:
                self._async_loads[job.req_id] = load
            else:
                self._sync_loads.append(load)
            # a sync load of the worker's own memory (sync_local_loads) is a few memcpys:
            # done here, before the forward that reads its blocks; a layerwise one is
            # pipelined with the forward's layers on the loader thread
            if (job.is_async or not self.layerwise) and self._in_memory(job):
                self._inc("kvpool_inline_loads")
                self._load_now(load)
                continue
            self._load_q.put(load)

    def _in_memory(self, job: LoadJob) -> bool:
        keys = [c.key for c in job.chunks]
        if not keys:
            return True
        with self._lock:
            rest = [k for k in keys if k not in self._pending]
        try:
            return not rest or bool(self.store.in_memory(rest))
        except Exception:  # a hint only: the loader thread reads it the usual way
            return False

    def _load_now(self, load: _Load) -> None:
        try:
            self._run_load(load)
        except Exception:
            log.exception("kvpool: load for %s failed", load.job.req_id)
            load.failed_blocks.update(b for c in load.job.chunks for b in c.block_ids)
        finally:
            for e in load.layer_done:
                e.set()
            load.done.set()

    def _loader(self) -> None:
        while not self._stop:
            load = self._load_q.get()
            if load is None:
                return
            self._load_now(load)

    def _run_load(self, load: _Load) -> None:
        """Batches of LOAD_BATCH_CHUNKS chunks through the load buffers, each batch read
        with the store's own time bound (a long prompt from a slow tier loads as long as it
        makes progress) and scattered before the next is read; after a missing chunk vLLM
        recomputes from there, so the rest is not read. Chunks the cpu tier holds are
        scattered straight from its memory (_scatter_in_place). Layerwise loads scatter the
        last batch layer by layer, so its copies overlap the forward's first layers."""
        layout = self.layout
        assert layout is not None and self._load_pool is not None
        chunks = load.job.chunks
        if not chunks:
            return
        bufs = self._load_pool.take(LOAD_BATCH_CHUNKS)
        assert bufs is not None, "the loader thread and the step own one batch each"
        try:
            for start in range(0, len(chunks), LOAD_BATCH_CHUNKS):
                part = chunks[start:start + LOAD_BATCH_CHUNKS]
                last = start + LOAD_BATCH_CHUNKS >= len(chunks)
                layered = last and not load.job.is_async and self.layerwise
                placed = [] if layered else self._scatter_in_place(part)
                done = {id(c) for c in placed}
                good = self._read_batch([c for c in part if id(c) not in done], bufs)
                self._scatter(good, load if layered else None)
                good += [(c, None) for c in placed]
                load.nbytes += sum(self._nbytes(c) for c, _ in good)
                load.chunks_ok += len(good)
                if self.audit is not None:
                    self._audit_loads(good)
                if len(good) < len(part):
                    ok = {id(c) for c, _ in good}
                    failed = [c for c in part if id(c) not in ok] + chunks[start + len(part):]
                    load.failed_blocks.update(b for c in failed for b in c.block_ids)
                    break
        finally:
            self._load_pool.give(bufs)

    def _scatter_in_place(self, part: list) -> list:
        """The chunks of `part` the first tier holds in this process's memory, scattered
        into their blocks straight from the tier's bytes (store.read_in_place): one copy per
        chunk where a read into a load buffer and a scatter out of it made two, which halved
        a hit's load (16 MiB: 2.5 -> 1.25 ms idle). Host caches of whole-block rows only (a
        device copy is asynchronous: the bytes must outlive the call); chunks still in a
        save buffer are read from there (_read_batch)."""
        layout = self.layout
        read_in_place = getattr(self.store, "read_in_place", None)
        if self.cuda or layout is None or not layout.host_flat or read_in_place is None:
            return []
        with self._lock:
            todo = [c for c in part if c.key not in self._pending]
        if not todo:
            return []

        def scatter(i: int, view: memoryview) -> bool:
            c = todo[i]
            if len(view) != self._nbytes(c):  # not this layout's object: read as usual
                return False
            layout.scatter_bytes(np.frombuffer(view, dtype=np.uint8),
                                 c.n_blocks or self.blocks_per_chunk, c.rows, c.block_ids)
            return True

        try:
            taken = read_in_place([c.key for c in todo], scatter)
        except Exception:  # a hint only: the chunks are read the usual way
            log.warning("kvpool: in-place read failed", exc_info=True)
            return []
        placed = [c for c, ok in zip(todo, taken, strict=True) if ok]
        for c in placed:
            self._count_hit(c, self._first_tier)
        return placed

    def _nbytes(self, c) -> int:
        """Bytes of the stored object a ChunkLoad reads (a tail holds fewer blocks)."""
        assert self.layout is not None
        return self.layout.chunk_nbytes(c.n_blocks or self.blocks_per_chunk)

    def _read_batch(self, part: list, bufs: list[torch.Tensor]) -> list:
        """(chunk, buffer) of the chunks of `part` that arrived whole and verified, each
        counted as a hit of its kind and of the tier that served it (a chunk still in its
        save buffer: the first tier, where it counts as stored already)."""
        got: list[int | None] = [None] * len(part)
        tiers: list[str | None] = [None] * len(part)
        with self._lock:  # chunks still on their way to the store: copy the save buffer
            for i, c in enumerate(part):
                entry = self._pending.get(c.key)
                if entry is None:
                    continue
                p, j = entry
                if p.event is not None:
                    p.event.synchronize()  # its gather may still be on the copy stream
                src = p.chunks()[j]
                if src.numel() == self._nbytes(c):
                    bufs[i][:src.numel()].copy_(src)
                    got[i], tiers[i] = src.numel(), self._first_tier
        rest = [i for i, n in enumerate(got) if n is None]
        if rest:
            served_by: list[str | None] = [None] * len(rest)
            fetched = self.store.get_many_into([part[i].key for i in rest],
                                               [bufs[i] for i in rest], served_by=served_by)
            for i, n, tier in zip(rest, fetched, served_by, strict=True):
                got[i], tiers[i] = n, tier
        good = [i for i, c in enumerate(part) if got[i] == self._nbytes(c)]
        for i in good:
            self._count_hit(part[i], tiers[i] or self._first_tier)
        return [(part[i], bufs[i]) for i in good]

    def _count_hit(self, c, tier: str) -> None:
        kind = c.kind or ("prompt_tail" if c.n_blocks else "prompt")
        if c.key in self._prewarmed:
            self._inc("kvpool_prewarm_hit_objects")
        self._inc("kvpool_hit_objects", 1, kind_tier(kind, tier))
        if self.count_tokens and self.block_size:
            self._inc("kvpool_hit_tokens", c.tokens or len(c.rows) * self.block_size,
                      kind_tier(kind, tier))

    def _scatter(self, good: list, layered: _Load | None) -> None:
        """Copy verified chunks into their blocks: all layers at once, or layer by layer
        setting `layered`'s per-layer events (layerwise loads inside the forward)."""
        layout = self.layout
        assert layout is not None  # loads follow register()
        layers: Sequence[int | None] = range(len(layout.layers)) if layered is not None else [None]
        if self.cuda:  # after what the compute stream has queued (a reused block's readers)
            self.copy_stream.wait_stream(torch.cuda.current_stream(layout.device))
        with self._on_copy_stream():
            for layer in layers:
                for c, src in good:
                    layout.scatter(src, c.n_blocks or self.blocks_per_chunk, c.rows,
                                   c.block_ids, layer=layer)
                if self.cuda:
                    self.copy_stream.synchronize()  # loader thread only; frees the buffers
                if layer is not None and layered is not None:  # one implies the other
                    layered.layer_done[layer].set()

    def _on_copy_stream(self):
        """The worker's own CUDA stream for its copies; nothing to switch on the CPU."""
        return torch.cuda.stream(self.copy_stream) if self.cuda else contextlib.nullcontext()

    def _audit_loads(self, good: list) -> None:
        """Read the loaded blocks back out of the paged cache for the KV audit."""
        layout, audit = self.layout, self.audit
        assert layout is not None and audit is not None  # called with an audit, after register()
        for c, _ in good:
            back = torch.empty(layout.chunk_nbytes(len(c.block_ids)), dtype=torch.uint8,
                               pin_memory=self.cuda)
            # on the stream the scatter ran on, then waited for: what the blocks hold now
            with self._on_copy_stream():
                layout.gather(torch.tensor(c.block_ids, dtype=torch.long), back)
            if self.cuda:
                self.copy_stream.synchronize()
            audit.loaded(layout, c.key, c.rows, back)

    def wait_layer(self, layer_name: str) -> None:
        if not self._sync_loads or self.layout is None:
            return
        i = self.layout.layer_index(layer_name)
        with self._in_step("load"):
            for load in self._sync_loads:
                if i is None or not load.layer_done:
                    load.done.wait()
                else:
                    load.layer_done[i].wait()

    def finish_sync_loads(self) -> None:
        """End of the forward: sync loads are complete; collect their failures."""
        if not self._sync_loads:
            return
        with self._in_step("load"):
            for load in self._sync_loads:
                load.done.wait()
                self._account(load)
            self._sync_loads = []

    def _account(self, load: _Load) -> None:
        self._load_errors.update(load.failed_blocks)
        failed = [c.key for c in load.job.chunks if set(c.block_ids) & load.failed_blocks]
        if failed:
            self._failed_keys[load.job.req_id] = failed
        self._inc("kvpool_load_error_chunks", len(failed))
        self._inc("kvpool_loaded_chunks", load.chunks_ok)
        self._sample_store = True  # tier hits of this load go out with this step's stats
        self._inc("kvpool_loaded_bytes", load.nbytes)

    # -- per-step reports --------------------------------------------------------------
    def get_finished(self, meta: KVPoolMetadata | None) -> tuple[set[str], set[str]]:
        if self.cuda:
            self._poll_copies()
        if meta is not None:
            self._await.update(meta.await_saves)
            if meta.idle:
                if meta.handover_waiting and not self._async_loads:
                    time.sleep(IDLE_WAIT_S)  # nothing to compute until a handover lands
                self._wait_for_a_load(IDLE_WAIT_S)
        recving = set()
        for req_id, load in list(self._async_loads.items()):
            if load.done.is_set():
                del self._async_loads[req_id]
                self._account(load)
                recving.add(req_id)
        sending = set()
        with self._lock:
            for req_id in list(self._await):
                if self._copies_by_req.get(req_id, 0) <= 0:
                    sending.add(req_id)
                    self._await.discard(req_id)
        return sending, recving

    def _wait_for_a_load(self, timeout: float) -> None:
        """Until any in-flight async load is done, at most `timeout` (the GIL is free
        meanwhile)."""
        pending = [load for load in self._async_loads.values() if not load.done.is_set()]
        if pending:
            pending[0].done.wait(timeout)

    def take_load_errors(self) -> set[int]:
        errs, self._load_errors = self._load_errors, set()
        return errs

    def worker_meta(self) -> KVPoolWorkerMetadata | None:
        with self._lock:
            stored, self._stored = self._stored, []
            dropped, self._dropped = self._dropped, []
            copied, self._copied = dict(self._copied), defaultdict(int)
            done, self._durable_done = self._durable_done, {}
            dfailed, self._durable_failed = self._durable_failed, {}
        failed, self._failed_keys = self._failed_keys, {}
        tier_events = self.store.take_events() if self.events else []
        if not (stored or dropped or copied or failed or tier_events or done):
            return None
        return KVPoolWorkerMetadata(stored_keys=stored, dropped_keys=dropped, copied_saves=copied,
                                    failed_loads=failed, tier_events=tier_events,
                                    durable_done=done, durable_failed=dfailed)

    def _inc(self, metric: str, value: float = 1, label: str = "") -> None:
        with self._stats_lock:
            self._stats.inc(metric, value, label)

    def take_stats(self) -> KVPoolConnectorStats | None:
        now_t = time.monotonic()
        if self._sample_store or now_t - self._store_stats_at >= STORE_STATS_EVERY_S:
            self._store_stats_at, self._sample_store = now_t, False
            try:
                now = self.store.stats()
            except Exception:
                now = self._store_stats_prev
            for metric, by_tier in tier_deltas(self._store_stats_prev, now).items():
                for tier, v in by_tier.items():
                    self._inc(metric, v, tier)
            self._store_stats_prev = now
            if self._sampler is not None:
                sample = self._sampler.sample()
                with self._stats_lock:
                    self._stats.merge(sample)
        with self._stats_lock:
            if self._stats.is_empty():
                return None
            out, self._stats = self._stats, KVPoolConnectorStats()
        return out

    def shutdown(self) -> None:
        self._stop = True
        if self._prewarmer is not None:
            self._prewarmer.stop()
        for q in (self._save_q, self._load_q):
            with contextlib.suppress(queue.Full):
                q.put(None, timeout=1)
        for t in self._threads:
            t.join(timeout=5)
        try:
            self.store.flush(timeout=SHUTDOWN_FLUSH_S)
        except Exception:  # shutting down: a failing backend only loses queued saves
            log.warning("kvpool: flush at shutdown failed", exc_info=True)

