"""The worker's loads: chunks read from the tiered store (or from a save still on its way
there) and scattered into vLLM's paged KV cache.

Kept apart from the saves (saves.py) and the per-step hooks (worker.py): a load has its own
life and rules. One whose chunks are all in the process's own memory runs in the step; the
rest run on the loader thread in batches through a fixed set of load buffers, each chunk
verified by the store before its buffer is used; a layerwise one scatters its last batch
layer by layer while the forward computes; what failed is reported by block (vLLM
recomputes it) and by key (the scheduler forgets it).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .audit import KVAudit
from .buffers import BufferPool
from .layout import KVLayout
from .metadata import KVPoolMetadata, LoadJob
from .saves import PendingSaves
from .stats import kind_tier

log = logging.getLogger("kvpool.connector")

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


class Loads:
    """`pending`: the saves on their way to the store (read from their buffers); `prewarmed`:
    the keys warm start put in the cpu tier (their hits are counted as such); `count`: the
    worker's stats counter; `in_step`: its timer of the step's phases."""

    def __init__(self, store, pending: PendingSaves, blocks_per_chunk: int, layerwise: bool,
                 audit: KVAudit | None, block_size: int, count_tokens: bool,
                 prewarmed: set[bytes], count: Callable[..., None],
                 in_step: Callable[[str], Any]):
        self.store = store
        self._pending = pending
        self.blocks_per_chunk = blocks_per_chunk
        self.layerwise = layerwise
        self.audit = audit
        self.block_size = block_size  # tokens per vLLM block: the hit token counters
        self.count_tokens = count_tokens  # tensor-parallel rank 0: tokens counted once
        self._prewarmed = prewarmed
        self._inc = count
        self._in_step = in_step
        # hits name the tier that served them (get_many_into's served_by); a chunk still in
        # its save buffer counts as the first tier's
        self._first_tier = store.tier_names()[0]
        self.layout: KVLayout | None = None
        self.cuda = False
        self.copy_stream: Any = None
        self._load_pool: BufferPool | None = None
        self._load_q: queue.Queue = queue.Queue()
        self.async_loads: dict[str, _Load] = {}
        self.sync_loads: list[_Load] = []
        self._load_errors: set[int] = set()
        # several KV cache groups: block ids repeat across groups, so vLLM takes a failed
        # load by request (failed_recving, the whole prompt recomputed), never by block
        self.fail_by_request = False
        self._failed_reqs: set[str] = set()
        self._failed_keys: dict[str, list[bytes]] = {}
        self.sample_store = False  # a load finished: the store's tier hits go out now
        self._stop = False
        self._thread = threading.Thread(target=self._loader, name="kvpool-loader", daemon=True)
        self._thread.start()

    def register(self, layout: KVLayout, pool: BufferPool, copy_stream: Any) -> None:
        self.layout = layout
        self.cuda = layout.device.type == "cuda"
        self.copy_stream = copy_stream
        self._load_pool = pool
        self.fail_by_request = len(layout.groups) > 1

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
            self._submit(meta)

    def _submit(self, meta: KVPoolMetadata) -> None:
        n_layers = len(self.layout.layers) if self.layout else 0
        for job in meta.loads:
            load = _Load(job, layer_done=[threading.Event() for _ in range(n_layers)])
            if job.is_async:
                self.async_loads[job.req_id] = load
            else:
                self.sync_loads.append(load)
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
            positions = len({r % (c.n_blocks or self.blocks_per_chunk) for r in c.rows})
            self._inc("kvpool_hit_tokens", c.tokens or positions * self.block_size,
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
        if self.cuda:  # what the blocks hold once the scatter's stream is done
            self.copy_stream.synchronize()
        for c, _ in good:
            audit.loaded(layout, c.key, c.rows, c.block_ids, c.n_blocks or self.blocks_per_chunk)

    def wait_layer(self, layer_name: str) -> None:
        if not self.sync_loads or self.layout is None:
            return
        i = self.layout.layer_index(layer_name)
        with self._in_step("load"):
            for load in self.sync_loads:
                if i is None or not load.layer_done:
                    load.done.wait()
                else:
                    load.layer_done[i].wait()

    def finish_sync_loads(self) -> None:
        """End of the forward: sync loads are complete; collect their failures."""
        if not self.sync_loads:
            return
        with self._in_step("load"):
            for load in self.sync_loads:
                load.done.wait()
                self._account(load)
            self.sync_loads = []

    def _account(self, load: _Load) -> None:
        if self.fail_by_request and load.failed_blocks:
            self._failed_reqs.add(load.job.req_id)
        else:
            self._load_errors.update(load.failed_blocks)
        failed = [c.key for c in load.job.chunks if set(c.block_ids) & load.failed_blocks]
        if failed:
            self._failed_keys[load.job.req_id] = failed
        self._inc("kvpool_load_error_chunks", len(failed))
        self._inc("kvpool_loaded_chunks", load.chunks_ok)
        self.sample_store = True  # tier hits of this load go out with this step's stats
        self._inc("kvpool_loaded_bytes", load.nbytes)

    def _wait_for_a_load(self, timeout: float) -> None:
        """Until any in-flight async load is done, at most `timeout` (the GIL is free
        meanwhile)."""
        pending = [load for load in self.async_loads.values() if not load.done.is_set()]
        if pending:
            pending[0].done.wait(timeout)

    def take_load_errors(self) -> set[int]:
        errs, self._load_errors = self._load_errors, set()
        return errs

    def take_failed_requests(self) -> set[str]:
        """Requests whose load failed (several KV cache groups: see fail_by_request)."""
        failed, self._failed_reqs = self._failed_reqs, set()
        return failed


    def finished_recving(self, meta: KVPoolMetadata | None) -> set[str]:
        """The async loads done by now (an idle step waits a little for one first)."""
        if meta is not None and meta.idle:
            if meta.handover_waiting and not self.async_loads:
                time.sleep(IDLE_WAIT_S)  # nothing to compute until a handover lands
            self._wait_for_a_load(IDLE_WAIT_S)
        recving = set()
        for req_id, load in list(self.async_loads.items()):
            if load.done.is_set():
                del self.async_loads[req_id]
                self._account(load)
                recving.add(req_id)
        return recving

    def take_failed_keys(self) -> dict[str, list[bytes]]:
        failed, self._failed_keys = self._failed_keys, {}
        return failed

    def close(self) -> None:
        self._stop = True
        with contextlib.suppress(queue.Full):
            self._load_q.put(None, timeout=1)
        self._thread.join(timeout=5)
