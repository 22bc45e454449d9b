"""Worker-side half: vLLM's worker hooks of the connector, on top of the saves and loads.

Saves (saves.py): after the forward pass each completed chunk is gathered out of the paged
KV cache and handed to the store off the step (in the step for a store of this process's
memory only); the forward never waits on disk, Redis or S3, and a full queue drops a save (a
future miss, counted). Loads (loads.py): read through the store, verified before a byte is
scattered into the paged cache, in the step when the chunks are in this process's memory,
else on the loader thread (layer by layer inside the forward when layerwise). Here: the
buffers both get at registration, warm start's loads into the cpu tier, the time the step
spends in the connector (`kvpool_step_seconds{phase}`), and the per-step reports to the
scheduler (worker metadata) and to vLLM's stats.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

import torch

from ..store.metrics import StoreSampler, tier_deltas
from .audit import KVAudit
from .buffers import BufferPool
from .layout import KVLayout
from .loads import LOAD_BATCH_CHUNKS, Loads
from .metadata import KVPoolMetadata, KVPoolWorkerMetadata
from .saves import PendingSaves, SaveReports, Saves
from .stats import STORE_STATS_EVERY_S, KVPoolConnectorStats
from .warm import Prewarmer, PrewarmResult

log = logging.getLogger("kvpool.connector")

SHUTDOWN_FLUSH_S = 10.0  # bound on waiting for lower-tier writes at shutdown


class WorkerSide:
    def __init__(self, store, blocks_per_chunk: int, layerwise: bool,
                 audit: KVAudit | None = None, staging_bytes: int = 1 << 30,
                 events: bool = False, store_metrics: bool = True, block_size: int = 0,
                 count_tokens: bool = True):
        self.store = store
        # labels of the per-tier object counters: saves land in the first tier (put_many's
        # answer), hits name the tier that served them (get_many_into's served_by)
        self._first_tier = store.tier_names()[0]
        # the store's series reach /metrics only through vLLM's stats (stats.py)
        self._sampler = StoreSampler(store) if store_metrics else None
        self.events = events  # vLLM KV events on: report the local tiers' stores/evictions
        if events:
            store.enable_events()
        self.staging_bytes = staging_bytes
        self.blocks_per_chunk = blocks_per_chunk
        self.layout: KVLayout | None = None
        self.cuda = False
        self.copy_stream: Any = None  # torch.cuda.Stream once registered on CUDA
        # saves (saves.py): what they report to the scheduler, the chunks on their way to
        # the store (loads read them from their save buffers meanwhile), the saving itself
        self.reports = SaveReports(self._inc, self._first_tier)
        self._pending = PendingSaves()
        self.saves = Saves(store, self.reports, self._pending, blocks_per_chunk, audit)
        self._stats = KVPoolConnectorStats()
        self._stats_lock = threading.Lock()
        self._store_stats_prev: dict = {}
        self._store_stats_at = 0.0
        self._prewarmed: set[bytes] = set()  # keys the warm start put in the cpu tier
        self._prewarmer: Prewarmer | None = None
        self.loads = Loads(store, self._pending, blocks_per_chunk, layerwise, audit,
                           block_size, count_tokens, self._prewarmed, self._inc,
                           self._in_step)

    @property
    def count_tokens(self) -> bool:
        """Tensor-parallel rank 0: hit tokens and the step's time are counted once, there."""
        return self.loads.count_tokens

    @count_tokens.setter
    def count_tokens(self, value: bool) -> None:
        self.loads.count_tokens = value

    def register(self, layout: KVLayout) -> None:
        self.layout = layout
        self.cuda = layout.device.type == "cuda"
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device=layout.device)
        chunk = layout.chunk_nbytes(self.blocks_per_chunk)
        # loads: one batch in flight on the loader thread and one in the step (in-memory
        # loads, submit_loads); saves: the rest of the budget
        self.loads.register(layout, BufferPool(chunk, 2 * LOAD_BATCH_CHUNKS, self.cuda),
                            self.copy_stream)
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

    # -- the step: its time here, the saves (saves.py) ---------------------------------
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

    # -- loads (loads.py) --------------------------------------------------------------
    def submit_loads(self, meta: KVPoolMetadata) -> None:
        self.loads.submit_loads(meta)

    def wait_layer(self, layer_name: str) -> None:
        self.loads.wait_layer(layer_name)

    def finish_sync_loads(self) -> None:
        self.loads.finish_sync_loads()

    def take_load_errors(self) -> set[int]:
        return self.loads.take_load_errors()

    # -- per-step reports --------------------------------------------------------------
    def get_finished(self, meta: KVPoolMetadata | None) -> tuple[set[str], set[str]]:
        if self.cuda:
            self.saves.poll_copies()
        recving = self.loads.finished_recving(meta)
        sending = self.reports.finished_sending(meta.await_saves if meta is not None else set())
        return sending, recving

    def worker_meta(self) -> KVPoolWorkerMetadata | None:
        stored, dropped, copied, done, dfailed = self.reports.take()
        failed = self.loads.take_failed_keys()
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
        if self.loads.sample_store or now_t - self._store_stats_at >= STORE_STATS_EVERY_S:
            self._store_stats_at, self.loads.sample_store = now_t, False
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
        if self._prewarmer is not None:
            self._prewarmer.stop()
        self.saves.close()
        self.loads.close()
        try:
            self.store.flush(timeout=SHUTDOWN_FLUSH_S)
        except Exception:  # shutting down: a failing backend only loses queued saves
            log.warning("kvpool: flush at shutdown failed", exc_info=True)

