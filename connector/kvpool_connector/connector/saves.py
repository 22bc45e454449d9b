"""The worker's saves: chunks copied out of vLLM's paged KV cache into the tiered store, and
what the scheduler is told of them.

Kept apart from the loads (worker.py) because a save has its own life: gathered in the step
into a pooled buffer (or straight into the cpu tier's slot), handed to the saver thread or
put in the step, reported copied (its blocks may be freed) and stored or dropped. Three
objects hold it: `PendingSaves`, the chunks copied out whose save has not reached the store
(loads read them from their save buffer meanwhile); `SaveReports`, the per-step report to
the scheduler, with the one count every finished save goes through; and `Saves`, the saving.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .audit import KVAudit
from .buffers import BufferPool
from .layout import KVLayout
from .metadata import KVPoolMetadata, SaveJob
from .stats import kind_tier

log = logging.getLogger("kvpool.connector")

SAVE_QUEUE = 64  # save batches waiting for the store before new ones are dropped


@dataclass
class PendingSave:
    job: SaveJob
    bufs: list[torch.Tensor]  # one pooled buffer per chunk
    event: Any  # torch.cuda.Event of the gather, None on CPU (copy already done)
    queued: bool = True   # False: the save queue was full, the save is dropped
    sizes: list[int] | None = None  # bytes per object when some are tails (shorter)

    def chunks(self) -> list[torch.Tensor]:
        if self.sizes is None:
            return self.bufs
        return [b[:n] for b, n in zip(self.bufs, self.sizes, strict=True)]


class PendingSaves:
    """Chunk key -> (its save, index): copied out of the paged cache, not yet in the store.
    A load copies such a chunk from its save buffer; `remove` waits for a copy in progress,
    so the buffer may be reused once it returns."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[bytes, tuple[PendingSave, int]] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_key)

    def add(self, p: PendingSave) -> None:
        with self._lock:
            for i, key in enumerate(p.job.keys):
                self._by_key[key] = (p, i)

    def remove(self, p: PendingSave) -> None:
        """Forget p's buffers as a source for loads (only entries that are still p's)."""
        with self._lock:
            for key in p.job.keys:
                entry = self._by_key.get(key)
                if entry is not None and entry[0] is p:
                    del self._by_key[key]

    def absent(self, keys: list[bytes]) -> list[bytes]:
        with self._lock:
            return [k for k in keys if k not in self._by_key]

    def copy_into(self, keys: list[bytes], bufs: list[torch.Tensor],
                  sizes: list[int]) -> list[int | None]:
        """Copy each pending chunk of `keys` of the expected size into its buffer: the bytes
        copied per key, None for one not pending (or of another size)."""
        got: list[int | None] = [None] * len(keys)
        with self._lock:
            for i, key in enumerate(keys):
                entry = self._by_key.get(key)
                if entry is None:
                    continue
                p, j = entry
                if p.event is not None:
                    p.event.synchronize()  # its gather may still be on the copy stream
                src = p.chunks()[j]
                if src.numel() == sizes[i]:
                    bufs[i][:src.numel()].copy_(src)
                    got[i] = src.numel()
        return got


class SaveReports:
    """What the scheduler is told of the saves each step (worker metadata): keys stored or
    dropped, save jobs copied out, handovers' write-through; and which finished requests'
    blocks may be freed. The saver thread reports too: one lock."""

    def __init__(self, count: Callable[..., None], first_tier: str) -> None:
        self._count = count
        self._first_tier = first_tier  # saves land in the first tier: the objects' label
        self._lock = threading.Lock()
        self._copies_by_req: dict[str, int] = defaultdict(int)  # save jobs not yet copied
        self._copied: dict[str, int] = defaultdict(int)          # to report to scheduler
        self._await: set[str] = set()                  # finished reqs awaiting copies
        self._stored: list[bytes] = []
        self._dropped: list[bytes] = []
        self._durable_done: dict[str, int] = {}  # handover save jobs written through
        self._durable_failed: dict[str, list[bytes]] = {}  # and their keys that were not

    def started(self, req_id: str) -> None:
        with self._lock:
            self._copies_by_req[req_id] += 1

    def copied(self, job: SaveJob, ok: list[bool], sizes: list[int]) -> None:
        """A save job left the paged cache (its blocks may be reused): its `ok` keys count
        as stored (a chunk still on its way is served from its save buffer), and are
        counted with their bytes and kinds."""
        stored = [k for k, good in zip(job.keys, ok, strict=True) if good]
        with self._lock:
            self._copies_by_req[job.req_id] -= 1
            if self._copies_by_req[job.req_id] <= 0:
                del self._copies_by_req[job.req_id]
            self._copied[job.req_id] += 1
            self._stored.extend(stored)
        if stored:
            self._count("kvpool_saved_chunks", len(stored))
            self._count("kvpool_saved_bytes",
                        sum(n for n, good in zip(sizes, ok, strict=True) if good))
            for kind, good in zip(job.kinds, ok, strict=False):  # kinds may be unset
                if good:
                    self._count("kvpool_saved_objects", 1, kind_tier(kind, self._first_tier))

    def stored(self, keys: list[bytes]) -> None:
        """Objects in the first tier that no save job put there (warm start)."""
        with self._lock:
            self._stored.extend(keys)

    def drop(self, keys: list[bytes]) -> None:
        with self._lock:
            self._dropped.extend(keys)
        self._count("kvpool_save_dropped_chunks", len(keys))

    def durable(self, job: SaveJob, durable: list[bool]) -> None:
        """A handover's write-through, for the scheduler to settle its params."""
        with self._lock:
            self._durable_done[job.req_id] = self._durable_done.get(job.req_id, 0) + 1
            bad = [k for k, ok in zip(job.keys, durable, strict=True) if not ok]
            if bad:
                self._durable_failed.setdefault(job.req_id, []).extend(bad)

    def finished_sending(self, await_saves: set[str]) -> set[str]:
        """Of the finished requests (these and earlier ones), those whose save copies are
        all done: vLLM may free their blocks."""
        sending = set()
        with self._lock:
            self._await.update(await_saves)
            for req_id in list(self._await):
                if self._copies_by_req.get(req_id, 0) <= 0:
                    sending.add(req_id)
                    self._await.discard(req_id)
        return sending

    def take(self) -> tuple[list[bytes], list[bytes], dict[str, int], dict[str, int],
                            dict[str, list[bytes]]]:
        """(stored, dropped, copied, durable done, durable failed) since the last call."""
        with self._lock:
            stored, self._stored = self._stored, []
            dropped, self._dropped = self._dropped, []
            copied, self._copied = dict(self._copied), defaultdict(int)
            done, self._durable_done = self._durable_done, {}
            failed, self._durable_failed = self._durable_failed, {}
        return stored, dropped, copied, done, failed


class Saves:
    """Saving the step's save jobs: the buffers, the saver thread, the copies in flight on
    CUDA. `store`: the worker's tiered store; `audit`: the KV audit, if on."""

    def __init__(self, store, reports: SaveReports, pending: PendingSaves,
                 blocks_per_chunk: int, audit: KVAudit | None):
        self.store = store
        self.reports = reports
        self.pending = pending
        self.blocks_per_chunk = blocks_per_chunk
        self.audit = audit
        self.layout: KVLayout | None = None
        self.cuda = False
        self.copy_stream: Any = None
        self.in_step = False  # set in register: a memory-only store saves in the step
        self._pool: BufferPool | None = None
        self._q: queue.Queue = queue.Queue(SAVE_QUEUE)
        self._uncopied: list[PendingSave] = []  # CUDA gathers in flight
        self._stop = False
        self._thread = threading.Thread(target=self._saver, name="kvpool-saver", daemon=True)
        self._thread.start()

    def register(self, layout: KVLayout, pool: BufferPool, copy_stream: Any) -> None:
        self.layout = layout
        self.cuda = layout.device.type == "cuda"
        self.copy_stream = copy_stream
        memory_only = getattr(self.store, "memory_only", None)
        self.in_step = not self.cuda and bool(memory_only and memory_only())
        self._pool = pool

    def submit(self, meta: KVPoolMetadata) -> None:
        assert self.layout is not None and self._pool is not None
        layout = self.layout
        for job in meta.saves:
            n = len(job.keys)
            self.reports.started(job.req_id)
            if self.in_step and not job.durable and self._save_in_place(job):
                continue
            bufs = self._pool.take(n)
            if bufs is None:  # the staging budget is in use by saves still on their way
                self.reports.drop(job.keys)
                self._mark_copied(PendingSave(job, [], None, queued=False))
                if job.durable:
                    self.reports.durable(job, [False] * n)
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
                if len(layout.groups) > 1:
                    # a sliding-window group frees blocks of running requests (vLLM's
                    # remove_skipped_blocks): the next forward may write one of them
                    torch.cuda.current_stream(layout.device).wait_event(event)
            else:
                for buf, ids in zip(bufs, job.block_ids, strict=True):
                    layout.gather(torch.tensor(ids, dtype=torch.long), buf)
            pending = PendingSave(job, bufs, event)
            counts = [layout.positions(len(ids)) for ids in job.block_ids]
            if any(n != self.blocks_per_chunk for n in counts):
                pending.sizes = [layout.chunk_nbytes(n) for n in counts]
            if job.durable:  # a handover: in the shared tiers before the step's output
                if event is not None:
                    event.synchronize()
                self._save_now(pending)
                continue
            if event is None and self.in_step:
                self._save_now(pending)
                continue
            # Loads find the chunk in its save buffer until the store holds it; registered
            # before the saver can see the job, so it can never outlive the saver's put.
            self.pending.add(pending)
            try:
                self._q.put_nowait(pending)
            except queue.Full:
                pending.queued = False
                self.pending.remove(pending)
                self.reports.drop(job.keys)
            if event is None:
                self._mark_copied(pending)
            else:
                self._uncopied.append(pending)

    def _save_now(self, p: PendingSave) -> None:
        """A store that is only this process's memory takes the chunks here, in the step:
        a memcpy each. Handing them to the saver thread instead cost the forward far more
        than the copies: the saver holds the GIL while the forward's OpenMP threads spin
        on both cores, so each GIL handoff waited for the OS to preempt a spinning thread
        (see docs/connector.md, Hot path)."""
        job, objects = p.job, p.chunks()  # tails are shorter than a chunk
        assert self.layout is not None and self._pool is not None  # set by register()
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
            self.reports.durable(job, durable)
        ok = [bool(x) for x in landed]
        if self.audit is not None and any(ok):
            self.audit.saved(self.layout, [k for k, good in zip(job.keys, ok, strict=True) if good],
                             [o for o, good in zip(objects, ok, strict=True) if good],
                             [self.layout.positions(len(ids))
                              for ids, good in zip(job.block_ids, ok, strict=True) if good])
        self._saved(job, ok, [o.numel() for o in objects])
        self._pool.give(p.bufs)

    def _save_in_place(self, job: SaveJob) -> bool:
        """A store that is only this process's memory: each chunk gathered out of the paged
        cache straight into its slot in the cpu tier (store.write_in_place), one copy where
        a gather into a staging buffer and put_many's copy of it made two. False: the store
        cannot take this job so (a chunk larger than its slots): the staging path saves it."""
        layout = self.layout
        write = getattr(self.store, "write_in_place", None)
        if write is None or layout is None or not layout.host_flat:
            return False
        sizes = [layout.chunk_nbytes(layout.positions(len(ids))) for ids in job.block_ids]
        audit = self.audit

        def fill(i: int, view: memoryview) -> bool:
            out = torch.frombuffer(view, dtype=torch.uint8)
            layout.gather(torch.tensor(job.block_ids[i], dtype=torch.long), out)
            if audit is not None:  # the bytes the tier now holds, as a load will read them
                audit.saved(layout, [job.keys[i]], [out],
                            [layout.positions(len(job.block_ids[i]))])
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
        """A save done in the step: its landed keys stored, the rest dropped."""
        self.reports.copied(job, ok, sizes)
        if not all(ok):
            self.reports.drop([k for k, good in zip(job.keys, ok, strict=True) if not good])

    def _mark_copied(self, p: PendingSave) -> None:
        """The chunk left the paged KV cache: its blocks may be reused, and (served from its
        save buffer until the store holds it) it counts as stored right away."""
        assert self.layout is not None and self._pool is not None  # saves follow register()
        if self.audit is not None and p.queued:
            self.audit.saved(self.layout, p.job.keys, p.chunks(),
                             [self.layout.positions(len(ids)) for ids in p.job.block_ids])
        self.reports.copied(p.job, [p.queued] * len(p.job.keys),
                            [b.numel() for b in p.chunks()] if p.queued
                            else [0] * len(p.job.keys))
        if not p.queued and p.bufs:  # copied, but not going anywhere
            self._pool.give(p.bufs)

    def poll_copies(self, wait: bool = False) -> None:
        """CUDA: the gathers that are done are copied out (wait: all of them)."""
        still = []
        for p in self._uncopied:
            if wait:
                p.event.synchronize()
            if p.event.query():
                self._mark_copied(p)
            else:
                still.append(p)
        self._uncopied = still

    def preempted(self, req_ids: set[str]) -> None:
        """Blocks of preempted requests are reused next: finish their copies now."""
        if self.cuda and self._uncopied and any(p.job.req_id in req_ids for p in self._uncopied):
            self.poll_copies(wait=True)

    def _saver(self) -> None:
        while not self._stop:
            p = self._q.get()
            if p is None:
                return
            try:
                if p.event is not None:
                    p.event.synchronize()  # background thread: the hot path never waits
                self.store.put_many(p.job.keys, p.chunks())
            except Exception:  # a failing backend degrades service, never the engine
                log.exception("kvpool: save of %d chunks failed", len(p.job.keys))
                self.reports.drop(p.job.keys)
            finally:
                self.pending.remove(p)  # loads copy from it under its lock: safe to reuse
                assert self._pool is not None  # saves follow register()
                self._pool.give(p.bufs)

    def close(self) -> None:
        """Stop the saver thread (what it has not put yet is lost)."""
        self._stop = True
        with contextlib.suppress(queue.Full):
            self._q.put(None, timeout=1)
        self._thread.join(timeout=5)
