"""Worker-side half: copies chunks between vLLM's paged KV cache and the tiered store.

Saves: after the forward pass (`wait_for_save`), each newly completed chunk is gathered (all
layers) into one pooled chunk buffer (buffers.py): a memcpy on CPU, an async copy into
pinned host memory on a dedicated CUDA stream. A saver thread then hands the buffers to
`store.put_many` (cpu tier synchronously, lower tiers through the store's bounded queues),
so the forward pass never waits on disk, Redis or S3. A store that is only this
process's memory (one cpu tier) takes the chunks in the step instead (saves.py), and
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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..store.metrics import StoreSampler, tier_deltas
from .audit import KVAudit
from .buffers import BufferPool
from .layout import KVLayout
from .metadata import KVPoolMetadata, KVPoolWorkerMetadata, LoadJob
from .saves import PendingSaves, SaveReports, Saves
from .stats import STORE_STATS_EVERY_S, KVPoolConnectorStats, kind_tier
from .warm import Prewarmer, PrewarmResult

log = logging.getLogger("kvpool.connector")

SHUTDOWN_FLUSH_S = 10.0  # bound on waiting for lower-tier writes at shutdown
LOAD_BATCH_CHUNKS = 8  # chunks per store read, each read with its own time bound
# An idle step (nothing scheduled: the requests wait for their loads) waits this long for an
# in-flight load instead of returning to vLLM's engine loop, which would call it again at
# once: that loop holds the GIL between its calls, and the loader thread, reacquiring the GIL
# after every copy, then waited a switch interval (5 ms) per copy. Measured with a 16k-token
# hit on the tiny model: 45,000 empty steps and a 5 s load; a new request waits at most this.
IDLE_WAIT_S = 0.02


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
        self._load_pool: BufferPool | None = None
        self.blocks_per_chunk = blocks_per_chunk
        self.layerwise = layerwise
        self.layout: KVLayout | None = None
        self.cuda = False
        self.copy_stream: Any = None  # torch.cuda.Stream once registered on CUDA
        self._load_q: queue.Queue = queue.Queue()
        # saves (saves.py): what they report to the scheduler, the chunks on their way to
        # the store (loads read them from their save buffers meanwhile), the saving itself
        self.reports = SaveReports(self._inc, self._first_tier)
        self._pending = PendingSaves()
        self.saves = Saves(store, self.reports, self._pending, blocks_per_chunk, audit)
        self._async_loads: dict[str, _Load] = {}
        self._sync_loads: list[_Load] = []
        self._load_errors: set[int] = set()
        self._failed_keys: dict[str, list[bytes]] = {}
        self._stats = KVPoolConnectorStats()
        self._stats_lock = threading.Lock()
        self._store_stats_prev: dict = {}
        self._store_stats_at = 0.0
        self._sample_store = False
        self._stop = False
        self._prewarmed: set[bytes] = set()  # keys the warm start put in the cpu tier
        self._prewarmer: Prewarmer | None = None
        self._loader_thread = threading.Thread(target=self._loader, name="kvpool-loader",
                                               daemon=True)
        self._loader_thread.start()

    def register(self, layout: KVLayout) -> None:
        self.layout = layout
        self.cuda = layout.device.type == "cuda"
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device=layout.device)
        chunk = layout.chunk_nbytes(self.blocks_per_chunk)
        # loads: one batch in flight on the loader thread and one in the step (in-memory
        # loads, submit_loads); saves: the rest of the budget
        self._load_pool = BufferPool(chunk, 2 * LOAD_BATCH_CHUNKS, self.cuda)
        self.saves.register(layout, BufferPool(chunk, max(1, self.staging_bytes // chunk
                                                          - 2 * LOAD_BATCH_CHUNKS), self.cuda),
                            self.copy_stream)

    # -- warm start (warm.py) ----------------------------------------------------------
    def prewarm(self, keys: list[bytes], max_bytes: int, max_seconds: float) -> PrewarmResult:
        """Load the hot set's `keys` into the cpu tier: here for at most `max_seconds`
        (engine start waits), the rest in the background. Loaded keys are reported to the
        scheduler like saved ones (its KeyIndex) and their later hits counted."""
        def loaded(batch: list[bytes], nbytes: int) -> None:
            self._prewarmed.update(batch)
            self.reports.stored(batch)
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
            self.saves.submit(meta)

    def preempted(self, req_ids: set[str]) -> None:
        """Blocks of preempted requests are reused next: finish their copies now."""
        self.saves.preempted(req_ids)

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
        rest = self._pending.absent(keys)
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
        absent = set(self._pending.absent([c.key for c in part]))
        todo = [c for c in part if c.key in absent]
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
        # chunks still on their way to the store: copied from their save buffers
        got = self._pending.copy_into([c.key for c in part], bufs,
                                      [self._nbytes(c) for c in part])
        tiers: list[str | None] = [None if n is None else self._first_tier for n in got]
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
            self.saves.poll_copies()
        if meta is not None and meta.idle:
            if meta.handover_waiting and not self._async_loads:
                time.sleep(IDLE_WAIT_S)  # nothing to compute until a handover lands
            self._wait_for_a_load(IDLE_WAIT_S)
        recving = set()
        for req_id, load in list(self._async_loads.items()):
            if load.done.is_set():
                del self._async_loads[req_id]
                self._account(load)
                recving.add(req_id)
        sending = self.reports.finished_sending(meta.await_saves if meta is not None else set())
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
        stored, dropped, copied, done, dfailed = self.reports.take()
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
        self.saves.close()
        with contextlib.suppress(queue.Full):
            self._load_q.put(None, timeout=1)
        self._loader_thread.join(timeout=5)
        try:
            self.store.flush(timeout=SHUTDOWN_FLUSH_S)
        except Exception:  # shutting down: a failing backend only loses queued saves
            log.warning("kvpool: flush at shutdown failed", exc_info=True)

