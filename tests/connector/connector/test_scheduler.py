"""Scheduler half of the connector on real vLLM requests (sha256 block hashes) and a real
disk-tier store: lookups, load plans, save plans, delayed frees, failed-load re-saves."""

from __future__ import annotations

import threading
import time

import pytest

from kvpool_connector.connector.keys import chunk_keys
from kvpool_connector.connector.metadata import KVPoolWorkerMetadata
from kvpool_connector.connector.scheduler import SchedulerSide
from tests.connector.connector.conftest import scheduler_side, wait_inline
from tests.connector.connector.helpers import (
    BPC,
    BS,
    PREFIX,
    allocate,
    answered,
    held_then_answered,
    make_request,
    scheduler_output,
)


def test_cold_request_plans_saves_of_complete_prompt_chunks_only(side):
    req = make_request("r1", 1000)  # 7 full blocks: 3 complete chunks + a tail
    assert side.num_matched(req, 0) == (0, False)
    allocate(side, req, 0)
    meta = side.build_meta(scheduler_output({"r1": 1000}))
    assert not meta.idle
    assert not meta.loads and len(meta.saves) == 1
    save = meta.saves[0]
    assert save.keys == chunk_keys(PREFIX, req.block_hashes, BPC)
    assert save.block_ids == [[100, 101], [102, 103], [104, 105]]
    # the same chunks are not planned again for another request while in flight
    twin = make_request("r2", 1000)
    allocate(side, twin, 0)
    assert side.build_meta(scheduler_output({"r2": 1000})).saves == []


def test_reported_chunks_become_hits_loaded_within_the_step(side):
    """Chunks the workers hold in their own memory (reported stored, in the KeyIndex) load
    synchronously: copied before the forward, the request computes the rest of its prompt
    in that same step instead of waiting a step (sync_local_loads)."""
    req = make_request("r1", 1000)
    keys = chunk_keys(PREFIX, req.block_hashes, BPC)
    side.on_worker_meta(KVPoolWorkerMetadata(stored_keys=keys[:2]))
    assert side.num_matched(req, 0) == (512, False)
    # a local prefix hit of one block: load only the rest of the hit
    again = make_request("r1b", 1000)
    assert side.num_matched(again, 128) == (384, False)
    ids = allocate(side, again, 384)
    meta = side.build_meta(scheduler_output({"r1b": 616}))
    (load,) = meta.loads
    assert not load.is_async
    assert [c.key for c in load.chunks] == keys[:2]
    assert [c.rows for c in load.chunks] == [[1], [0, 1]]
    assert [c.block_ids for c in load.chunks] == [[ids[1]], [ids[2], ids[3]]]


@pytest.mark.parametrize("side", [{"tail_objects": False, "sync_local_loads": False}],
                         indirect=True)
def test_without_sync_local_loads_a_local_hit_waits_a_step_for_an_async_load(side):
    req = make_request("r1", 1000)
    keys = chunk_keys(PREFIX, req.block_hashes, BPC)
    side.on_worker_meta(KVPoolWorkerMetadata(stored_keys=keys[:2]))
    assert side.num_matched(req, 0) == (512, True)
    allocate(side, req, 512)
    meta = side.build_meta(scheduler_output({}))
    assert meta.idle  # the request waits for its load: the workers may wait for it too
    (load,) = meta.loads
    assert load.is_async and [c.key for c in load.chunks] == keys[:2]


def test_a_hit_partly_in_a_lower_tier_loads_between_steps(side):
    """A disk, Redis or S3 read must never stall a forward: any chunk of the hit outside
    the KeyIndex makes the whole load asynchronous."""
    req = make_request("r1", 1000)
    keys = chunk_keys(PREFIX, req.block_hashes, BPC)
    side.on_worker_meta(KVPoolWorkerMetadata(stored_keys=keys[:1]))
    side.lower.put_many(keys[1:3], [b"x" * 64, b"y" * 64])
    assert side.num_matched(req, 0) == (768, True)


def test_lower_tier_objects_count_as_hits_and_the_last_token_is_never_claimed(side):
    req = make_request("r1", 512)  # exactly two chunks
    keys = chunk_keys(PREFIX, req.block_hashes, BPC)
    side.lower.put_many(keys, [b"x" * 64, b"y" * 64])
    # both chunks are stored, but vLLM must compute the last prompt token
    assert side.num_matched(req, 0) == (384, True)


def test_finished_request_waits_for_its_save_copies(side):
    req = make_request("r1", 600)
    side.num_matched(req, 0)
    allocate(side, req, 0)
    meta = side.build_meta(scheduler_output({"r1": 600}))
    assert len(meta.saves) == 1
    assert side.finished(req) is True  # copy not confirmed yet: keep the blocks
    meta = side.build_meta(scheduler_output({}))
    assert meta.await_saves == {"r1"}
    side.on_worker_meta(KVPoolWorkerMetadata(copied_saves={"r1": 1}))
    assert side.delayed == {}
    done = make_request("r2", 100)  # no complete chunk, nothing to wait for
    side.num_matched(done, 0)
    assert side.finished(done) is False


def test_failed_load_is_saved_again_after_recompute(side):
    req = make_request("r1", 1000)
    keys = chunk_keys(PREFIX, req.block_hashes, BPC)
    side.on_worker_meta(KVPoolWorkerMetadata(stored_keys=keys))
    assert side.num_matched(req, 0) == (768, False)  # local: loaded within the step
    allocate(side, req, 768)
    side.build_meta(scheduler_output({}))
    side.on_worker_meta(KVPoolWorkerMetadata(failed_loads={"r1": [keys[1]]}))
    assert keys[1] not in side.index
    req.num_computed_tokens = 256  # vLLM rewinds to the first failed block
    meta = side.build_meta(scheduler_output({"r1": 1000 - 256}))
    (save,) = meta.saves
    assert save.keys == [keys[1]]  # keys[2] is still indexed: not saved twice


def test_kv_role_producer_never_loads_and_consumer_never_saves(side):
    req = make_request("r1", 1000)
    side.on_worker_meta(KVPoolWorkerMetadata(stored_keys=chunk_keys(PREFIX, req.block_hashes, BPC)))
    side.load_enabled = False  # kv_producer
    assert side.num_matched(req, 0) == (0, False)
    side.load_enabled, side.save_enabled = True, False  # kv_consumer
    cold = make_request("r2", 1000, seed=1)
    side.num_matched(cold, 0)
    allocate(side, cold, 0)
    assert side.build_meta(scheduler_output({"r2": 1000})).saves == []


def test_cache_salt_isolates_tenants_and_can_be_required(side):
    """vLLM mixes cache_salt into the first block hash: two tenants' identical prompts share
    no chunk. With require_cache_salt an unsalted request is neither looked up nor saved."""
    a = make_request("a", 1000, seed=3, cache_salt="tenant-a")
    b = make_request("b", 1000, seed=3, cache_salt="tenant-b")
    plain = make_request("p", 1000, seed=3)
    ka, kb, kp = (chunk_keys(PREFIX, r.block_hashes, BPC) for r in (a, b, plain))
    assert not set(ka) & set(kb) and not set(ka) & set(kp)
    side.on_worker_meta(KVPoolWorkerMetadata(stored_keys=ka))
    assert side.num_matched(a, 0)[0] > 0 and side.num_matched(b, 0) == (0, False)

    strict = SchedulerSide(side.cfg.model_copy(update={"require_cache_salt": True}), PREFIX, BS,
                           BPC, chunk_bytes=1 << 20, world_size=1, lower_store=side.lower,
                           block_ids=lambda rid: [side.test_blocks[rid]], is_async=True)
    strict.on_worker_meta(KVPoolWorkerMetadata(stored_keys=ka + kp))
    assert strict.num_matched(plain, 0) == (0, False)  # stored, but never looked up
    strict.num_matched(a, 0)
    assert strict.reqs["a"].hit_chunks == 3
    fresh = make_request("f", 1000, seed=4)
    strict.num_matched(fresh, 0)
    allocate(side, fresh, 0)
    strict.test_blocks = side.test_blocks
    assert strict.build_meta(scheduler_output({"f": 1000})).saves == []  # and never saved
    salted = make_request("s", 1000, seed=4, cache_salt="tenant-a")
    strict.num_matched(salted, 0)
    allocate(side, salted, 0)
    assert strict.build_meta(scheduler_output({"s": 1000})).saves


def test_a_remote_lookup_running_past_the_bound_answers_at_a_later_step(remote_side,
                                                                        monkeypatch):
    """With Redis below the cpu tier, a lookup answers None ("ask again next step") while
    the Redis round trip runs on a thread past the inline bound, then the hit count once it
    is back."""
    req = make_request("r1", 1000, seed=11)
    keys = chunk_keys(PREFIX, req.block_hashes, BPC)
    remote_side.lower.put_many(keys[:2], [b"x" * 64] * 2)
    remote_side.lower.flush()
    answer = held_then_answered(remote_side, req, monkeypatch, remote_side.lower,
                                "contains_prefix")
    assert answer == (2 * 256, True)
    assert remote_side.hit_sources(req) == (0, 2)


def test_a_remote_lookup_that_answers_within_the_bound_costs_no_step(remote_side, monkeypatch):
    """A lookup job that is done within the inline bound is answered in the call that asked
    (no "ask again next step"). The bound is raised here so that a busy test machine cannot
    make the loopback round trip miss it: what is checked is the waiting, not its speed."""
    wait_inline(remote_side, 30.0, 30.0)
    remote_side.build_meta(scheduler_output({}))  # a new step: the raised budget
    req = make_request("r1", 1000, seed=12)
    keys = chunk_keys(PREFIX, req.block_hashes, BPC)
    remote_side.lower.put_many(keys[:2], [b"x" * 64] * 2)
    remote_side.lower.flush()
    assert remote_side.num_matched(req, 0) == (2 * 256, True)
    assert remote_side.hit_sources(req) == (0, 2)
    assert "kvpool_lookups_deferred" not in remote_side.stats.data


def test_lookup_wait_ms_sets_the_bound_and_the_step_budget(redis_tier, namespace, monkeypatch):
    """The config key is the bound (default 5 ms, a LAN round trip); a step waits twice
    that at most; 0 turns the wait off."""
    # the directory's autouse fixture zeroes every side's bound: the real constructor here
    monkeypatch.setattr(SchedulerSide, "__init__", SchedulerSide.__init__.__wrapped__)
    for keys, bound in (({}, 0.005), ({"lookup_wait_ms": 12}, 0.012),
                        ({"lookup_wait_ms": 0}, 0.0)):
        s = scheduler_side(namespace, redis_tier, **keys)
        try:
            assert (s.jobs.wait_s, s.jobs.budget_s) == pytest.approx((bound, 2 * bound))
            s.build_meta(scheduler_output({}))
            assert s.jobs.left == pytest.approx(2 * bound)
        finally:
            s.close()
            s.lower.close()


def test_the_wait_for_lookup_jobs_is_bounded_per_step(remote_side, monkeypatch):
    """Lookups held on a slow tier: each request waits the bound, all of one step's
    together at most the step's budget; then they answer None without waiting, until the next
    step (build_meta) renews the budget."""
    wait_inline(remote_side, 0.03, 0.05)
    remote_side.build_meta(scheduler_output({}))
    gate = threading.Event()
    lower = remote_side.lower
    real = lower.contains_prefix
    monkeypatch.setattr(lower, "contains_prefix", lambda ks: (gate.wait(10), real(ks))[1])
    reqs = [make_request(f"h{i}", 1000, seed=20 + i) for i in range(3)]
    try:
        t0 = time.perf_counter()
        assert remote_side.num_matched(reqs[0], 0) == (None, False)
        assert time.perf_counter() - t0 >= 0.03  # it did wait (a timed wait never ends early)
        assert remote_side.jobs.left <= 0.05 - 0.03 + 1e-3
        assert remote_side.num_matched(reqs[1], 0) == (None, False)  # what was left of 0.05 s
        assert remote_side.jobs.left <= 0
        spent = remote_side.jobs.left
        assert remote_side.num_matched(reqs[2], 0) == (None, False)
        assert remote_side.jobs.left == spent  # the budget is gone: no wait at all
        assert remote_side.stats.data["kvpool_lookups_deferred"] == {"": 3}  # a step each
        remote_side.build_meta(scheduler_output({}))
        assert remote_side.jobs.left == 0.05
    finally:
        gate.set()
    assert answered(remote_side, reqs[2]) == (0, False)


def test_nobody_waits_while_lookup_jobs_run_longer_than_the_bound(remote_side, monkeypatch):
    """A slow tier (S3; here Redis behind a 60 ms delay): once the jobs' running mean of
    durations passes the bound, a new lookup is not waited for at all (it would only
    delay the step); when the tier is fast again, the wait comes back."""
    wait_inline(remote_side, 0.02, 30.0)
    lower = remote_side.lower
    real = lower.contains_prefix
    delay = {"s": 0.06}
    monkeypatch.setattr(lower, "contains_prefix",
                        lambda ks: (time.sleep(delay["s"]), real(ks))[1])
    for i in range(2):  # the mean after two 60 ms jobs: >= 0.06 * (1 - 0.75 ** 2) = 26 ms
        remote_side.build_meta(scheduler_output({}))
        assert answered(remote_side, make_request(f"s{i}", 1000, seed=40 + i)) == (0, False)
    assert remote_side.jobs.mean_s > 0.02
    remote_side.build_meta(scheduler_output({}))
    slow = make_request("s2", 1000, seed=42)
    assert remote_side.num_matched(slow, 0) == (None, False)
    assert remote_side.jobs.left == 30.0  # not waited for
    delay["s"] = 0.0
    assert answered(remote_side, slow) == (0, False)
    for i in range(20):  # fast jobs pull the mean down
        if remote_side.jobs.mean_s <= 0.02:
            break
        assert answered(remote_side, make_request(f"f{i}", 1000, seed=60 + i)) == (0, False)
    assert remote_side.jobs.mean_s <= 0.02
    gate = threading.Event()  # the next job held: whether the ask waits is then plain
    monkeypatch.setattr(lower, "contains_prefix", lambda ks: (gate.wait(10), real(ks))[1])
    try:
        remote_side.build_meta(scheduler_output({}))
        held = make_request("w", 1000, seed=90)
        assert remote_side.num_matched(held, 0) == (None, False)
        assert remote_side.jobs.left <= 30.0 - 0.02  # the wait is back
    finally:
        gate.set()
    assert answered(remote_side, held) == (0, False)


def test_a_lookup_job_that_fails_within_the_bound_is_a_miss_counted_once(remote_side,
                                                                          monkeypatch):
    wait_inline(remote_side, 30.0, 30.0)
    remote_side.build_meta(scheduler_output({}))

    def broken(keys):
        raise RuntimeError("a bug in a tier")
    monkeypatch.setattr(remote_side.lower, "contains_prefix", broken)
    before = remote_side.stats.data.get("kvpool_lookups", {}).get("", 0)
    assert remote_side.num_matched(make_request("b", 1000, seed=80), 0) == (0, False)
    assert remote_side.stats.data["kvpool_lookups"][""] == before + 1


def test_prompt_tokens_computed_count_what_neither_cache_served(side):
    """kvpool_prompt_tokens_computed (the autoscaling trigger that credits pool hits): at each
    admission, the request's tokens less vLLM's prefix-cache hit less the pool's."""
    cold = make_request("r1", 1000)
    side.num_matched(cold, 0)
    allocate(side, cold, 0)
    assert side.stats.data["kvpool_prompt_tokens_computed"] == {"": 1000}
    keys = chunk_keys(PREFIX, cold.block_hashes, BPC)
    side.on_worker_meta(KVPoolWorkerMetadata(stored_keys=keys[:2]))
    warm = make_request("r2", 1000)
    assert side.num_matched(warm, 128) == (384, False)  # local: in the step; 128 in vLLM's cache, 384 from the pool
    allocate(side, warm, 384)
    assert side.stats.data["kvpool_prompt_tokens_computed"] == {"": 1000 + 1000 - 128 - 384}
    hit = make_request("r3", 512)  # both chunks stored; vLLM computes the last block itself
    side.lower.put_many(chunk_keys(PREFIX, hit.block_hashes, BPC), [b"x" * 64, b"y" * 64])
    assert side.num_matched(hit, 0) == (384, False)  # the same first 512 tokens as r1: in the index
    allocate(side, hit, 384)
    assert side.stats.data["kvpool_prompt_tokens_computed"] == {"": 1488 + 512 - 384}


def test_prompt_tokens_computed_count_a_load_between_steps_once(side):
    """vLLM admits a request whose load runs between steps twice: with the pool's tokens,
    then, the load done, again with none and its num_computed_tokens at what loaded. The
    second admission counts only what a failed load left to recompute (counting the prompt
    again put a P/D decode engine's counter at prompt + its own work per handover)."""
    cold = make_request("c", 1000)
    side.lower.put_many(chunk_keys(PREFIX, cold.block_hashes, BPC)[:3], [b"x" * 64] * 3)
    loaded = make_request("r1", 1000)  # the same tokens as `cold`
    assert side.num_matched(loaded, 0) == (768, True)  # from the lower tier: between steps
    allocate(side, loaded, 768)
    assert side.stats.data["kvpool_prompt_tokens_computed"] == {"": 232}
    loaded.num_computed_tokens = 768  # vLLM, once the workers report the load done
    allocate(side, loaded, 0)
    assert side.stats.data["kvpool_prompt_tokens_computed"] == {"": 232}
    failed = make_request("r2", 1000)
    side.num_matched(failed, 0)
    allocate(side, failed, 768)
    failed.num_computed_tokens = 256  # the load failed past the first chunk: recompute
    allocate(side, failed, 0)
    assert side.stats.data["kvpool_prompt_tokens_computed"] == {"": 232 + 232 + 512}
