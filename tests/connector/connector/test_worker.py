"""The worker half's load loop against vLLM's engine loop: an idle step (nothing scheduled,
every request waiting for its KV) waits for an in-flight load instead of returning at once.

Why it matters: vLLM's in-process engine loop calls the connector again right away after an
idle step and holds the GIL in between; the loader thread, which reacquires the GIL after
every tensor copy, then crawled (a 16k-token hit of the tiny model took 5 s of 45,000 empty
steps instead of 0.01 s). Real tensors, a real store; a gate in front of the store's read
holds the load in flight for as long as a test needs.
"""

from __future__ import annotations

import threading
import time

import torch

from kvpool_connector.connector import loads as loads_module, worker as worker_module
from kvpool_connector.connector.layout import KVLayout
from kvpool_connector.connector.metadata import ChunkLoad, KVPoolMetadata, LoadJob, SaveJob
from kvpool_connector.connector.stats import KVPoolConnectorStats
from kvpool_connector.connector.worker import WorkerSide
from kvpool_connector.store import open_store
from tests.conftest import SECURITY

NUM_BLOCKS, BPC = 8, 2


class GatedStore:
    """A real store whose reads wait until the test opens the gate."""

    def __init__(self, store) -> None:
        self.store, self.gate = store, threading.Event()

    def get_many_into(self, keys, bufs, **kw):
        assert self.gate.wait(30), "the test never opened the gate"
        return self.store.get_many_into(keys, bufs, **kw)

    def read_in_place(self, keys, use, **kw):
        assert self.gate.wait(30), "the test never opened the gate"
        return self.store.read_in_place(keys, use, **kw)

    def in_memory(self, keys):
        return False  # a slow tier: its loads run on the loader thread

    def __getattr__(self, name):
        return getattr(self.store, name)


def worker_with_one_stored_chunk(store_class=None):
    store_class = store_class or GatedStore
    caches = {f"layer.{i}": torch.randn(NUM_BLOCKS, 2, 16, 64) for i in range(2)}
    layout = KVLayout(caches, list(caches), NUM_BLOCKS, "TEST")
    store = store_class(open_store({"namespace": "worker-test",
                                   "tiers": [{"type": "cpu", "size": "16Mi"}]}, layout=b"l"))
    payload = torch.empty(layout.chunk_nbytes(BPC), dtype=torch.uint8)
    layout.gather(torch.tensor([0, 1]), payload)
    store.put_many([b"k" * 16], [payload.numpy()])
    side = WorkerSide(store, blocks_per_chunk=BPC, layerwise=False)
    side.register(layout)
    load = LoadJob("req", [ChunkLoad(b"k" * 16, rows=[0, 1], block_ids=[5, 6])], is_async=True)
    side.submit_loads(KVPoolMetadata(loads=[load]))
    return side, store, caches


def test_a_busy_step_never_waits_for_a_load():
    side, store, _ = worker_with_one_stored_chunk()
    t0 = time.monotonic()
    assert side.get_finished(KVPoolMetadata(idle=False)) == (set(), set())
    assert time.monotonic() - t0 < loads_module.IDLE_WAIT_S  # the gate is still shut
    store.gate.set()


def test_an_idle_step_waits_for_the_load_and_reports_it(monkeypatch):
    monkeypatch.setattr(loads_module, "IDLE_WAIT_S", 30.0)
    side, store, caches = worker_with_one_stored_chunk()
    t0 = time.monotonic()  # before the timer starts: it opens the gate >= 0.05 s after t0
    threading.Timer(0.05, store.gate.set).start()
    assert side.get_finished(KVPoolMetadata(idle=True)) == (set(), {"req"})
    assert store.gate.is_set() and time.monotonic() - t0 >= 0.045
    for cache in caches.values():  # the load landed: blocks 5, 6 hold what 0, 1 held
        assert torch.equal(cache[5:7], cache[0:2])


def test_an_idle_step_waits_a_bounded_time():
    side, store, _ = worker_with_one_stored_chunk()
    t0 = time.monotonic()
    assert side.get_finished(KVPoolMetadata(idle=True)) == (set(), set())
    assert time.monotonic() - t0 >= loads_module.IDLE_WAIT_S * 0.9
    store.gate.set()


class ThreadRecordingStore:
    """A real store that records which thread read it."""

    def __init__(self, store) -> None:
        self.store, self.readers = store, []

    def get_many_into(self, keys, bufs, **kw):
        self.readers.append(threading.current_thread())
        return self.store.get_many_into(keys, bufs, **kw)

    def read_in_place(self, keys, use, **kw):
        self.readers.append(threading.current_thread())
        return self.store.read_in_place(keys, use, **kw)

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_a_load_from_the_cpu_tier_is_done_before_the_forward_starts():
    """Like vLLM's native offloading: chunks in the worker's own memory are copied in the
    step that submits them, so that step's get_finished reports the request even when the
    forward is shorter than the copy (on the loader thread it waited another step)."""
    side, store, caches = worker_with_one_stored_chunk(ThreadRecordingStore)
    assert store.readers == [threading.current_thread()]
    for cache in caches.values():
        assert torch.equal(cache[5:7], cache[0:2])
    assert side.get_finished(KVPoolMetadata(idle=False)) == (set(), {"req"})
    assert side.take_stats().data["kvpool_inline_loads"] == {"": 1}


def test_a_sync_load_from_the_cpu_tier_is_in_its_blocks_when_submit_returns():
    """sync_local_loads: the scheduler counted the hit as computed, so the forward that
    follows reads the blocks: the copy is done in the step, on the calling thread, and the
    forward's end collects it (no finished_recving: the request never waited)."""
    side, store, caches = worker_with_one_stored_chunk(ThreadRecordingStore)
    load = LoadJob("sync", [ChunkLoad(b"k" * 16, rows=[0, 1], block_ids=[2, 3])],
                   is_async=False)
    for cache in caches.values():
        cache[2:4].zero_()
    side.submit_loads(KVPoolMetadata(loads=[load]))
    assert store.readers[-1] is threading.current_thread()
    for cache in caches.values():
        assert torch.equal(cache[2:4], cache[0:2])
    side.wait_layer("layer.1")  # returns at once: the load is done
    side.finish_sync_loads()
    assert side.get_finished(KVPoolMetadata(idle=False))[1] == {"req"}  # the async one only
    assert side.take_load_errors() == set()
    assert side.take_stats().data["kvpool_inline_loads"] == {"": 2}


def test_a_sync_load_of_an_evicted_chunk_is_a_load_error_at_the_forwards_end():
    """The scheduler's index said the worker held it, the cpu tier evicted it meanwhile:
    its blocks are load errors, which vLLM recomputes (kv_load_failure_policy recompute)."""
    side, store, _ = worker_with_one_stored_chunk(ThreadRecordingStore)
    load = LoadJob("gone", [ChunkLoad(b"e" * 16, rows=[0, 1], block_ids=[3, 4])],
                   is_async=False)
    side.submit_loads(KVPoolMetadata(loads=[load]))
    side.wait_layer("layer.0")
    side.finish_sync_loads()
    assert side.take_load_errors() == {3, 4}


def test_a_missing_chunk_goes_to_the_loader_thread_and_fails_there():
    """Not in memory: the loader thread reads it (a lower tier could have it); missing
    everywhere it is a load error, as before."""
    side, store, caches = worker_with_one_stored_chunk(ThreadRecordingStore)
    load = LoadJob("req2", [ChunkLoad(b"m" * 16, rows=[0, 1], block_ids=[3, 4])],
                   is_async=True)
    side.submit_loads(KVPoolMetadata(loads=[load]))
    assert side.loads.async_loads["req2"].done.wait(5)
    assert store.readers[-1] is not threading.current_thread()
    assert side.get_finished(KVPoolMetadata(idle=False))[1] == {"req", "req2"}
    assert side.take_load_errors() == {3, 4}


class PutRecordingStore(ThreadRecordingStore):
    def __init__(self, store) -> None:
        super().__init__(store)
        self.writers = []

        self.in_place = []  # per write_in_place call: whether it took the job

    def put_many(self, keys, payloads):
        self.writers.append(threading.current_thread())
        return self.store.put_many(keys, payloads)

    def write_in_place(self, keys, sizes, fill, **kw):
        self.writers.append(threading.current_thread())
        landed = self.store.write_in_place(keys, sizes, fill, **kw)
        self.in_place.append(landed is not None)
        return landed


def test_a_memory_only_store_takes_a_save_within_the_step():
    """A store that is only the worker's memory takes the chunk in wait_for_save, on the
    step's thread: no saver-thread GIL handoffs while the forward's threads spin; gathered
    straight into the cpu tier's slot (write_in_place: no staging copy). The chunk is
    reported stored and loads back exactly."""
    side, store, caches = worker_with_one_stored_chunk(PutRecordingStore)
    store.writers.clear()
    save = SaveJob("req3", [b"s" * 16], [[2, 3]])
    side.submit_saves(KVPoolMetadata(saves=[save]))
    assert store.writers == [threading.current_thread()] and store.in_place == [True]
    meta = side.worker_meta()
    assert meta.stored_keys == [b"s" * 16] and meta.copied_saves == {"req3": 1}
    load = LoadJob("req4", [ChunkLoad(b"s" * 16, rows=[0, 1], block_ids=[6, 7])],
                   is_async=True)
    side.submit_loads(KVPoolMetadata(loads=[load]))
    for cache in caches.values():
        assert torch.equal(cache[6:8], cache[2:4])


def test_a_store_with_lower_tiers_saves_on_the_saver_thread(tmp_path):
    caches = {f"layer.{i}": torch.randn(NUM_BLOCKS, 2, 16, 64) for i in range(2)}
    layout = KVLayout(caches, list(caches), NUM_BLOCKS, "TEST")
    store = PutRecordingStore(open_store(
        {"namespace": "worker-test", "tiers": [{"type": "cpu", "size": "16Mi"},
                                               {"type": "disk", "path": str(tmp_path),
                                                "size": "16Mi"}],
         "security": SECURITY}, layout=b"l"))
    side = WorkerSide(store, blocks_per_chunk=BPC, layerwise=False)
    side.register(layout)
    side.submit_saves(KVPoolMetadata(saves=[SaveJob("r", [b"t" * 16], [[0, 1]])]))
    side.store.flush(timeout=10)
    deadline = time.monotonic() + 10
    while not store.writers and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.writers and store.writers[0].name == "kvpool-saver"
    side.shutdown()


# -- objects saved and hit, by kind and tier ---------------------------------------------------

def _two_tier_worker(tmp_path):
    """A worker over a real cpu + disk store, both tiers named (metrics labels)."""
    caches = {f"layer.{i}": torch.randn(NUM_BLOCKS, 2, 16, 64) for i in range(2)}
    layout = KVLayout(caches, list(caches), NUM_BLOCKS, "TEST")
    store = open_store({"namespace": "worker-test", "security": SECURITY, "tiers": [
        {"type": "cpu", "size": "16Mi", "name": "ram"},
        {"type": "disk", "path": str(tmp_path), "size": "16Mi", "name": "ssd"}]}, layout=b"l")
    side = WorkerSide(store, blocks_per_chunk=BPC, layerwise=False, block_size=128)
    side.register(layout)
    return side, store, caches


def _saved(side, store) -> None:
    """The saver thread handed every save to the store, and the disk tier wrote them."""
    deadline = time.monotonic() + 10
    while side._pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not side._pending and store.flush(timeout=10)


def test_hits_are_counted_by_kind_and_the_tier_that_served_them(tmp_path):
    """A prompt chunk in the cpu tier, a decode tail only on disk (evicted from the cpu
    tier): each hit names its own tier; tokens count the blocks loaded."""
    side, store, caches = _two_tier_worker(tmp_path)
    chunk, tail = b"c" * 16, b"t" * 16
    side.submit_saves(KVPoolMetadata(saves=[
        SaveJob("r", [chunk, tail], [[0, 1], [2]], ["prompt", "decode_tail"])]))
    _saved(side, store)
    store.runners[0].tier.delete_many(store.object_names([tail]))  # now only on disk
    saved = side.take_stats().data["kvpool_saved_objects"]
    assert saved == {"prompt/ram": 1, "decode_tail/ram": 1}  # saves: the first tier
    load = LoadJob("q", [ChunkLoad(chunk, rows=[0, 1], block_ids=[4, 5], kind="prompt"),
                         ChunkLoad(tail, rows=[0], block_ids=[6], n_blocks=1,
                                   kind="decode_tail")], is_async=True)
    side.submit_loads(KVPoolMetadata(loads=[load]))
    assert side.loads.async_loads["q"].done.wait(10)
    assert side.get_finished(KVPoolMetadata())[1] == {"q"}
    data = side.take_stats().data
    assert data["kvpool_hit_objects"] == {"prompt/ram": 1, "decode_tail/ssd": 1}
    assert data["kvpool_hit_tokens"] == {"prompt/ram": 256, "decode_tail/ssd": 128}
    for cache in caches.values():  # and the bytes are the ones saved
        assert torch.equal(cache[4:6], cache[0:2]) and torch.equal(cache[6], cache[2])
    side.shutdown()


def test_a_missing_object_is_no_hit_and_rank_one_counts_no_tokens(tmp_path):
    side, store, _ = _two_tier_worker(tmp_path)
    side.count_tokens = False  # tensor-parallel rank 1: objects yes, tokens no
    side.submit_saves(KVPoolMetadata(saves=[SaveJob("r", [b"c" * 16], [[0, 1]], ["decode"])]))
    _saved(side, store)
    side.take_stats()
    load = LoadJob("q", [ChunkLoad(b"c" * 16, rows=[0, 1], block_ids=[4, 5], kind="decode"),
                         ChunkLoad(b"m" * 16, rows=[0, 1], block_ids=[6, 7], kind="prompt")],
                   is_async=True)
    side.submit_loads(KVPoolMetadata(loads=[load]))
    assert side.loads.async_loads["q"].done.wait(10)
    side.get_finished(KVPoolMetadata())
    data = side.take_stats().data
    assert data["kvpool_hit_objects"] == {"decode/ram": 1}
    assert "kvpool_hit_tokens" not in data
    assert side.take_load_errors() == {6, 7}
    side.shutdown()



def test_a_finished_load_sends_the_stores_counts_in_that_steps_stats(tmp_path, monkeypatch):
    """The store's series are sampled every STORE_STATS_EVERY_S, and at once after a load:
    an engine that goes idle after a request (no more steps, no more stats) still reports
    the hits that served it."""
    monkeypatch.setattr(worker_module, "STORE_STATS_EVERY_S", 3600.0)  # no periodic sample
    side, store, _ = _two_tier_worker(tmp_path)
    side.submit_saves(KVPoolMetadata(saves=[SaveJob("r", [b"c" * 16], [[0, 1]], ["prompt"])]))
    _saved(side, store)
    side.take_stats()  # the first call samples the store
    assert "kvpool_store_events" not in (side.take_stats() or KVPoolConnectorStats()).data
    load = LoadJob("q", [ChunkLoad(b"c" * 16, rows=[0, 1], block_ids=[4, 5], kind="prompt")],
                   is_async=True)
    side.submit_loads(KVPoolMetadata(loads=[load]))
    assert side.loads.async_loads["q"].done.wait(10)
    assert side.get_finished(KVPoolMetadata())[1] == {"q"}
    events = side.take_stats().data["kvpool_store_events"]
    assert any(tier.get("ram", {}).get("hits") for tier in events.values()), events
    side.shutdown()


def test_a_partial_block_loads_whole_and_counts_only_its_tokens():
    """A partial-block object is one whole block (vLLM computes over the slots past its
    tokens), loaded bit for bit; only its tokens count as hit tokens."""
    caches = {f"layer.{i}": torch.randn(NUM_BLOCKS, 2, 16, 64) for i in range(2)}
    layout = KVLayout(caches, list(caches), NUM_BLOCKS, "TEST")
    store = open_store({"namespace": "worker-test", "tiers": [{"type": "cpu", "size": "16Mi"}]},
                       layout=b"l")
    side = WorkerSide(store, blocks_per_chunk=BPC, layerwise=False, block_size=16)
    side.register(layout)
    part = b"p" * 16
    side.submit_saves(KVPoolMetadata(saves=[SaveJob("r", [part], [[3]], ["decode_tail"])]))
    assert side.worker_meta().stored_keys == [part]
    side.take_stats()
    load = LoadJob("q", [ChunkLoad(part, rows=[0], block_ids=[7], n_blocks=1,
                                   kind="decode_tail", tokens=5)], is_async=False)
    side.submit_loads(KVPoolMetadata(loads=[load]))
    for cache in caches.values():
        assert torch.equal(cache[7], cache[3])
    assert side.take_stats().data["kvpool_hit_tokens"] == {"decode_tail/cpu": 5}
    side.shutdown()


class SlowReadStore:
    """A real store whose reads take at least READ_S (a tier of this process's memory that
    is slow to copy out)."""
    READ_S = 0.03

    def __init__(self, store) -> None:
        self.store = store

    def get_many_into(self, keys, bufs, **kw):
        time.sleep(self.READ_S)
        return self.store.get_many_into(keys, bufs, **kw)

    def read_in_place(self, keys, use, **kw):
        time.sleep(self.READ_S)
        return self.store.read_in_place(keys, use, **kw)

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_the_steps_time_in_loads_and_saves_is_counted_by_phase():
    """kvpool_step_seconds{phase}: what the connector adds to the engine's step, the load
    before the forward (its read included) and the save after it; a step with neither adds
    no series."""
    side, _, _ = worker_with_one_stored_chunk(SlowReadStore)  # an inline load of one chunk
    side.finish_sync_loads()
    side.submit_saves(KVPoolMetadata(saves=[SaveJob("req", [b"s" * 16], [[3, 4]])]))
    step = side.take_stats().data["kvpool_step_seconds"]
    assert set(step) == {"load", "save"}
    assert SlowReadStore.READ_S <= step["load"] < 10 and 0 < step["save"] < 10
    side.finish_sync_loads()  # nothing loading: nothing counted
    side.wait_layer("layer.0")
    stats = side.take_stats()
    assert stats is None or "kvpool_step_seconds" not in stats.data
    # another tensor-parallel rank times nothing: its copies run beside rank 0's
    side.count_tokens = False
    side.submit_saves(KVPoolMetadata(saves=[SaveJob("req2", [b"t" * 16], [[3, 4]])]))
    stats = side.take_stats()
    assert stats is None or "kvpool_step_seconds" not in stats.data


class ReadRecordingStore:
    """A real store that records which keys each read path served."""

    def __init__(self, store) -> None:
        self.store, self.into, self.in_place = store, [], []

    def get_many_into(self, keys, bufs, **kw):
        self.into += list(keys)
        return self.store.get_many_into(keys, bufs, **kw)

    def read_in_place(self, keys, use, **kw):
        taken = self.store.read_in_place(keys, use, **kw)
        self.in_place += [k for k, ok in zip(keys, taken, strict=True) if ok]
        return taken

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_a_cpu_tier_hit_is_scattered_straight_from_the_tier(tmp_path):
    """One copy per chunk for what the cpu tier holds (read in place into the blocks);
    a chunk only in a lower tier is read into a load buffer as before; both land exactly,
    and a hit counts once for the tier that served it."""
    caches = {f"layer.{i}": torch.randn(NUM_BLOCKS, 2, 16, 64) for i in range(2)}
    layout = KVLayout(caches, list(caches), NUM_BLOCKS, "TEST")
    store = ReadRecordingStore(open_store(
        {"namespace": "in-place", "security": SECURITY,
         "tiers": [{"type": "cpu", "size": "16Mi"},
                   {"type": "disk", "path": str(tmp_path), "size": "16Mi"}]}, layout=b"l"))
    keys = [b"a" * 16, b"b" * 16]
    for key, ids in zip(keys, ([0, 1], [2, 3]), strict=True):
        payload = torch.empty(layout.chunk_nbytes(BPC), dtype=torch.uint8)
        layout.gather(torch.tensor(ids), payload)
        store.put_many([key], [payload.numpy()])
    assert store.flush(5)
    store.store.runners[0].tier.delete_many(store.object_names([keys[1]]))  # b: disk only
    side = WorkerSide(store, blocks_per_chunk=BPC, layerwise=False, block_size=16)
    side.register(layout)
    load = LoadJob("r", [ChunkLoad(keys[0], rows=[0, 1], block_ids=[4, 5]),
                         ChunkLoad(keys[1], rows=[0, 1], block_ids=[6, 7])], is_async=False)
    side.submit_loads(KVPoolMetadata(loads=[load]))
    side.finish_sync_loads()
    assert side.take_load_errors() == set()
    assert store.in_place == [keys[0]] and store.into == [keys[1]]
    for cache in caches.values():
        assert torch.equal(cache[4:8], cache[0:4])
    hits = side.take_stats().data["kvpool_hit_objects"]
    assert hits == {"prompt/cpu": 1, "prompt/disk": 1}
