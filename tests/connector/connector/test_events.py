"""vLLM KV events of the local tiers: what real cpu/disk tiers record, and the BlockStored /
BlockRemoved the scheduler half builds from it on real vLLM requests (sha256 block hashes),
encoded by vLLM's own msgspec encoder and decoded as an external subscriber would."""

from __future__ import annotations

import msgpack
import pytest
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.serial_utils import MsgpackEncoder

from kvpool_connector.connector.config import load_connector_config
from kvpool_connector.connector.keys import chunk_keys
from kvpool_connector.connector.metadata import KVPoolWorkerMetadata
from kvpool_connector.connector.scheduler import SchedulerSide
from kvpool_connector.connector.tails import tail_key
from kvpool_connector.store import open_store
from kvpool_dev.testbed.kv_events import decode_batch
from tests.conftest import SECURITY
from tests.connector.connector.helpers import (
    BPC,
    BS,
    PREFIX,
    allocate,
    make_request,
    run_turn,
    scheduler_output,
)

CHUNK = 64 * 1024


def ext(hashes) -> list:
    """Block hashes as vLLM's events carry them (64-bit ints by default)."""
    return [maybe_convert_block_hash(h) for h in hashes]


def test_local_tiers_record_stores_and_evictions_of_the_keys_this_store_wrote(tmp_path):
    store = open_store({"namespace": "ev", "security": SECURITY, "tiers": [
        {"type": "cpu", "size": 4 * CHUNK, "slot_size": CHUNK},  # 4 chunks, then LRU evicts
        {"type": "disk", "path": str(tmp_path), "size": 6 * CHUNK + 4096, "rescan_seconds": 0}]})
    keys = [bytes([i]) * 48 for i in range(8)]
    try:
        store.put_many(keys[:2], [b"a" * CHUNK] * 2)
        assert store.take_events() == []  # nobody listens yet: nothing is recorded
        store.enable_events()
        store.put_many(keys[2:], [b"b" * (CHUNK - 200)] * 6)
        assert store.flush(10)
        ev = store.take_events()
        cpu = {k: s for t, s, k in ev if t == "cpu"}
        disk = {k: s for t, s, k in ev if t == "disk"}
        assert len(cpu) + len(disk) == len(ev)  # one event per key and tier: the last state
        # 4 slots: keys 2 and 3 came and went, 4-7 stay; the evictions of keys 0 and 1
        # (written before anyone listened) have no known key and are left out
        assert cpu == {keys[2]: False, keys[3]: False, keys[4]: True, keys[5]: True,
                       keys[6]: True, keys[7]: True}
        assert set(disk) == set(keys[2:]) and disk[keys[6]] and disk[keys[7]]
        assert store.take_events() == []  # drained
        store.delete_many(keys[7:])
        assert ("cpu", False, keys[7]) in store.take_events()
    finally:
        store.close()


@pytest.fixture
def sched(side):
    """The scheduler test's SchedulerSide (cpu + disk tiers), with vLLM's KV events on."""
    side.enable_events(chunk_bytes=1 << 20)
    return side


def _saved_keys(sched, req) -> list[bytes]:
    sched.num_matched(req, 0)
    allocate(sched, req, 0)
    saves = sched.build_meta(scheduler_output({req.request_id: req.num_tokens})).saves
    # the chunks, not the prompt's tail object (tails are off in this fixture unless asked)
    return [k for s in saves for k, kind in zip(s.keys, s.kinds, strict=True)
            if not kind.endswith("tail")]


def test_a_saved_chunk_is_announced_like_vllms_own_blocks(sched):
    req = make_request("r1", 1000, cache_salt="tenant-a")  # 3 complete chunks
    keys = _saved_keys(sched, req)
    assert sched.events.take() == []  # planned is not stored yet
    sched.on_worker_meta(KVPoolWorkerMetadata(stored_keys=keys))
    events = sched.events.take()
    assert [type(e) for e in events] == [BlockStored] * 3
    for c, e in enumerate(events):
        assert e.medium == "CPU" and e.block_size == BS and e.group_idx == 0
        assert e.block_hashes == ext(req.block_hashes[c * BPC:(c + 1) * BPC])
        assert e.parent_block_hash == (ext([req.block_hashes[c * BPC - 1]])[0] if c else None)
        assert e.token_ids == req.all_token_ids[c * 256:(c + 1) * 256]
        # vLLM's extra keys: the cache salt on the first block only
        assert e.extra_keys == ([("tenant-a",), None] if c == 0 else [None, None])
    # the same chunk reported again (another rank, a second save) is not announced twice
    sched.on_worker_meta(KVPoolWorkerMetadata(stored_keys=keys[:1]))
    assert sched.events.take() == []


def test_lower_local_tier_evictions_and_drops(sched):
    req = make_request("r1", 600)
    keys = _saved_keys(sched, req)  # 2 chunks
    sched.on_worker_meta(KVPoolWorkerMetadata(stored_keys=keys, tier_events=[
        ("disk", True, keys[0]), ("redis", True, keys[0])]))  # the shared tier: not announced
    assert [(type(e), e.medium) for e in sched.events.take()] == [
        (BlockStored, "CPU"), (BlockStored, "CPU"), (BlockStored, "STORAGE")]
    sched.on_worker_meta(KVPoolWorkerMetadata(tier_events=[
        ("cpu", False, keys[0]), ("cpu", False, keys[0]), ("disk", False, keys[1])]))
    (removed,) = sched.events.take()  # keys[1] never reached the disk: nothing to remove there
    assert isinstance(removed, BlockRemoved) and removed.medium == "CPU"
    assert removed.block_hashes == ext(req.block_hashes[:BPC])
    sched.on_worker_meta(KVPoolWorkerMetadata(dropped_keys=[keys[1]]))  # the save never landed
    (dropped,) = sched.events.take()
    assert dropped.medium == "CPU" and dropped.block_hashes == ext(req.block_hashes[BPC:2 * BPC])


def test_a_promoted_load_is_announced_when_the_cpu_tier_takes_it(sched):
    req = make_request("r1", 1000)
    keys = chunk_keys(PREFIX, req.block_hashes, BPC)
    sched.lower.put_many(keys, [b"x" * 64] * 3)  # found on disk (another engine wrote it)
    assert sched.num_matched(req, 0) == (768, True)
    allocate(sched, req, 768)
    sched.build_meta(scheduler_output({}))
    assert sched.events.take() == []
    sched.on_worker_meta(KVPoolWorkerMetadata(tier_events=[("cpu", True, k) for k in keys]))
    assert [e.medium for e in sched.events.take()] == ["CPU"] * 3


def test_snapshots_are_bounded_and_what_falls_out_is_withdrawn(sched):
    sched.events.capacity = 3
    req = make_request("r1", 1000)  # 3 chunks: the snapshots are full
    keys = _saved_keys(sched, req)
    sched.on_worker_meta(KVPoolWorkerMetadata(stored_keys=keys[:2]))
    sched.events.take()
    other = make_request("r2", 300, seed=5)
    _saved_keys(sched, other)  # a third snapshot pushes out the oldest announced chunk
    (withdrawn,) = sched.events.take()
    assert isinstance(withdrawn, BlockRemoved) and withdrawn.block_hashes == ext(req.block_hashes[:2])


@pytest.mark.parametrize("side", [{"tail_objects": True}], indirect=True)
def test_tails_are_announced_as_their_blocks_and_no_block_twice(sched):
    """A chat turn saves chunks, the prompt's tail (block 4), the chunk the answer completes
    over it (blocks 4-5) and the finish tail (block 6): each block is announced once per
    medium, and removed only when the last object holding it there leaves."""
    t1 = make_request("t1", 700)  # 5 blocks: 2 chunks + a 1-block tail
    sched.num_matched(t1, 0)
    allocate(sched, t1, 0)
    run_turn(sched, t1, list(range(10, 210)))  # 899 tokens computed, all reported stored
    h = t1.block_hashes
    stored = sched.events.take()
    assert {(type(e), e.medium) for e in stored} == {(BlockStored, "CPU")}
    assert [e.block_hashes for e in stored] == [ext(h[0:2]), ext(h[2:4]), ext(h[4:5]),
                                                ext(h[5:6]), ext(h[6:7])]
    assert [e.parent_block_hash for e in stored] == [None, *ext([h[1], h[3], h[4], h[5]])]
    assert [e.token_ids for e in stored[2:]] == [t1.all_token_ids[b * BS:(b + 1) * BS]
                                                 for b in (4, 5, 6)]
    assert [len(e.extra_keys) for e in stored] == [2, 2, 1, 1, 1]
    prompt_tail, finish_tail = tail_key(PREFIX, h, 4, 1), tail_key(PREFIX, h, 6, 1)
    chunk2 = chunk_keys(PREFIX, h, BPC)[2]

    def events(*tier_events):
        sched.on_worker_meta(KVPoolWorkerMetadata(tier_events=list(tier_events)))
        return [(type(e).__name__, e.medium, e.block_hashes) for e in sched.events.take()]

    # cpu: the tail leaves first, its block is still in chunk 2
    assert events(("cpu", False, prompt_tail)) == []
    assert events(("cpu", False, chunk2)) == [("BlockRemoved", "CPU", ext(h[4:6]))]
    assert events(("cpu", False, finish_tail)) == [("BlockRemoved", "CPU", ext(h[6:7]))]
    # disk: the tail comes first; the chunk over it adds block 5 only and leaves block 4
    assert events(("disk", True, prompt_tail), ("disk", True, chunk2)) == [
        ("BlockStored", "STORAGE", ext(h[4:5])), ("BlockStored", "STORAGE", ext(h[5:6]))]
    assert events(("disk", False, chunk2)) == [("BlockRemoved", "STORAGE", ext(h[5:6]))]
    assert events(("disk", False, prompt_tail)) == [("BlockRemoved", "STORAGE", ext(h[4:5]))]


@pytest.mark.parametrize("side", [{"tail_objects": True}], indirect=True)
def test_a_tail_loaded_from_a_lower_tier_is_announced_when_promoted(sched):
    t1 = make_request("t1", 700)
    h = t1.block_hashes
    keys = chunk_keys(PREFIX, h, BPC)
    tail = tail_key(PREFIX, h, 4, 1)
    sched.lower.put_many([*keys, tail], [b"x" * 64] * 3)  # another engine wrote them
    assert sched.num_matched(t1, 0) == (640, True)
    allocate(sched, t1, 640)
    sched.on_worker_meta(KVPoolWorkerMetadata(tier_events=[("cpu", True, k) for k in [*keys, tail]]))
    assert [e.block_hashes for e in sched.events.take()] == [ext(h[0:2]), ext(h[2:4]), ext(h[4:5])]


def test_events_go_out_in_vllms_wire_format(sched):
    req = make_request("r1", 600)
    keys = _saved_keys(sched, req)
    sched.on_worker_meta(KVPoolWorkerMetadata(stored_keys=keys[:1], tier_events=[("cpu", False, keys[0])]))
    batch = KVEventBatch(ts=1.0, events=sched.events.take())
    (frame,) = [bytes(b) for b in MsgpackEncoder().encode(batch)]
    ts, (stored, removed), _ = decode_batch(frame)  # as an external subscriber reads it
    assert ts == 1.0 and stored["type"] == "BlockStored" and removed["type"] == "BlockRemoved"
    assert stored["block_hashes"] == ext(req.block_hashes[:BPC]) == removed["block_hashes"]
    assert stored["token_ids"] == req.all_token_ids[:256] and stored["parent_block_hash"] is None
    assert stored["medium"] == removed["medium"] == "CPU" and stored["block_size"] == BS


def test_the_decoder_reads_positional_events_too():
    old = msgpack.packb([2.0, [["BlockRemoved", [b"h"], "CPU"]], 0])
    assert decode_batch(old) == (2.0, [{"type": "BlockRemoved", "block_hashes": [b"h"],
                                        "medium": "CPU"}], 0)


def test_no_events_work_unless_vllm_asks(tmp_path):
    cfg = load_connector_config({"namespace": "t", "tiers": [{"type": "cpu", "size": "64Mi"}]})
    s = SchedulerSide(cfg, PREFIX, BS, BPC, chunk_bytes=1 << 20, world_size=1, lower_store=None,
                      block_ids=lambda rid: [], is_async=True)
    assert s.events is None
    remote_first = load_connector_config({"namespace": "t", "security": SECURITY, "tiers": [
        {"type": "redis", "url": "redis://127.0.0.1:1/0"}]})
    r = SchedulerSide(remote_first, PREFIX, BS, BPC, chunk_bytes=1 << 20, world_size=1,
                      lower_store=None, block_ids=lambda rid: [], is_async=True)
    r.enable_events(1 << 20)
    assert r.events is None  # nothing local to announce
