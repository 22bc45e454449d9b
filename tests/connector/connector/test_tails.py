"""Tail objects and decode KV in the scheduler half, on real vLLM requests driven step by
step the way vLLM's scheduler drives them: a chat's second turn finds everything the first
computed (prompt, answer, the blocks past the last full chunk) up to the last full block."""

from __future__ import annotations

import pytest

from kvpool_connector.connector.config import load_connector_config
from kvpool_connector.connector.keys import chunk_keys
from kvpool_connector.connector.scheduler import SchedulerSide
from kvpool_connector.connector.tails import is_tail_key, request_options, tail_key
from kvpool_connector.store import open_store
from tests.conftest import SECURITY
from tests.connector.connector.helpers import (
    BPC,
    BS,
    PREFIX,
    allocate,
    held_then_answered,
    make_request,
    run_turn,
    scheduler_output,
    with_prompt,
)

TAILS = {"tail_objects": True}


@pytest.mark.parametrize("side", [TAILS], indirect=True)
def test_second_turn_loads_full_chunks_and_the_tail_up_to_the_last_full_block(side):
    t1 = make_request("t1", 700)  # 5 blocks: 2 chunks + a 1-block tail
    assert side.num_matched(t1, 0) == (0, False)
    allocate(side, t1, 0)
    jobs = run_turn(side, t1, list(range(10, 210)))  # 200 tokens: 900 in all, 899 computed
    kinds = [k for j in jobs for k in j.kinds]
    # the prompt's two chunks, its tail at prefill end, the chunk the answer completed
    # (tokens 512-767), and at finish the tail of block 6 (tokens 768-895)
    assert kinds == ["prompt", "prompt", "prompt_tail", "decode", "decode_tail"]
    prompt_tail, finish_tail = [j for j in jobs if j.kinds[0].endswith("tail")]
    assert prompt_tail.keys == [tail_key(PREFIX, t1.block_hashes, 4, 1)]
    assert prompt_tail.block_ids == [[side.test_blocks["t1"][4]]]
    assert finish_tail.keys == [tail_key(PREFIX, t1.block_hashes, 6, 1)]
    assert all(is_tail_key(k) for k in prompt_tail.keys + finish_tail.keys)
    # the predicate the worker's store evicts first by: tails only, never a full chunk
    assert not any(is_tail_key(k) for k in chunk_keys(PREFIX, t1.block_hashes, BPC))

    t2 = with_prompt("t2", list(t1.all_token_ids) + list(range(300, 350)))  # 950 tokens
    hit, is_async = side.num_matched(t2, 0)
    # 3 full chunks + the 1-block tail: 896 of 950; computed 54 <= 50 new + one block
    assert (hit, is_async) == (896, False)  # all in the workers' memory: loaded within the step
    ids = allocate(side, t2, 896)
    (load,) = side.build_meta(scheduler_output({})).loads
    keys = chunk_keys(PREFIX, t2.block_hashes, BPC)
    assert [c.key for c in load.chunks] == keys[:3] + finish_tail.keys
    tail = load.chunks[-1]
    assert (tail.rows, tail.block_ids, tail.n_blocks) == ([0], [ids[6]], 1)
    # the workers count each hit by these kinds (and the tier that served it)
    assert [c.kind for c in load.chunks] == ["prompt", "prompt", "decode", "decode_tail"]


@pytest.mark.parametrize("side", [TAILS], indirect=True)
def test_a_tail_never_claims_the_last_prompt_token_nor_shadows_a_full_chunk(side):
    t1 = make_request("t1", 700)
    allocate(side, t1, 0)
    run_turn(side, t1, list(range(10, 18)))
    # the same 5 blocks then exactly one more token: the tail (block 4) ends at token 640,
    # the last prompt token (640) is computed
    same = with_prompt("s", list(t1.prompt_token_ids)[:640] + [5])
    assert side.num_matched(same, 0) == (640, False)
    # a prompt of exactly those 640 tokens: block 4 holds its last token, no tail is claimed
    exact = with_prompt("e", list(t1.prompt_token_ids)[:640])
    assert side.num_matched(exact, 0) == (512, False)
    # a different block 4 after the same chunks: no tail matches
    other = with_prompt("o", list(t1.prompt_token_ids)[:512] + [7] * 200)
    assert side.num_matched(other, 0) == (512, False)


@pytest.mark.parametrize("side", [TAILS], indirect=True)
def test_per_request_override_keeps_the_answer_out_and_tails_off(side):
    t1 = make_request("t1", 700)
    t1.kv_transfer_params = {"kvpool": {"save_decode": False}}
    allocate(side, t1, 0)
    jobs = run_turn(side, t1, list(range(10, 210)))
    # no decode chunk; the finish tail would be the prompt's tail again: nothing new
    assert [k for j in jobs for k in j.kinds] == ["prompt", "prompt", "prompt_tail"]
    t2 = with_prompt("t2", list(t1.all_token_ids) + [9] * 50)
    assert side.num_matched(t2, 0) == (640, False)  # the prompt and its tail, not the answer
    allocate(side, t2, 640)
    (load,) = side.build_meta(scheduler_output({})).loads
    assert [c.kind for c in load.chunks] == ["prompt", "prompt", "prompt_tail"]
    off = with_prompt("t3", list(t1.all_token_ids) + [9] * 50)
    off.kv_transfer_params = {"kvpool": {"tails": False}}
    assert side.num_matched(off, 0) == (512, False)


def test_config_off_is_todays_behaviour(side):
    """tail_objects off (this fixture) and save_decode_tokens off: prompt chunks only."""
    side.cfg = side.cfg.model_copy(update={"save_decode_tokens": False})
    t1 = make_request("t1", 700)
    allocate(side, t1, 0)
    jobs = run_turn(side, t1, list(range(10, 210)))
    assert [k for j in jobs for k in j.kinds] == ["prompt", "prompt"]


def test_a_second_engine_sharing_redis_finds_the_tail_the_first_wrote(redis_server, namespace,
                                                                       monkeypatch):
    """Engine A's workers wrote a prompt's 2 chunks and its tail through their cpu tier to
    Redis. Engine B (its own, empty cpu tier) finds both off the step loop: None while the
    Redis job runs, then the chunks and the tail, up to the last full block, from Redis."""
    monkeypatch.setenv("KVPOOL_TEST_REDIS_PASSWORD", redis_server.password)
    cfg = load_connector_config({"namespace": namespace, "security": SECURITY, "tiers": [
        {"type": "cpu", "size": "64Mi"},
        {"type": "redis", "url": redis_server.url, "password_env": "KVPOOL_TEST_REDIS_PASSWORD"}]})
    t1 = make_request("t1", 700)  # 5 blocks: 2 chunks + a 1-block tail
    keys = [*chunk_keys(PREFIX, t1.block_hashes, BPC), tail_key(PREFIX, t1.block_hashes, 4, 1)]
    with open_store(cfg.as_store_config(), layout="fp") as engine_a:
        engine_a.put_many(keys, [b"x" * 64] * 3)
    lower = open_store(cfg.as_store_config(drop_types=("cpu",)), layout="fp")
    b = SchedulerSide(cfg, PREFIX, BS, BPC, chunk_bytes=1 << 20, world_size=1, lower_store=lower,
                      block_ids=lambda rid: b.test_blocks[rid], is_async=True)
    b.test_blocks = {}
    try:
        t2 = with_prompt("t2", list(t1.prompt_token_ids) + [9] * 50)  # the next turn
        # the tail probe (the real Redis call, after the chunks') held: a probe made inline
        # would block the lookup instead of answering None
        answer = held_then_answered(b, t2, monkeypatch, lower,
                                    "first_present")
        assert answer == (640, True)  # 2 chunks + the tail; tails off: 512
        assert b.hit_sources(t2) == (0, 2) and not b.tail_hit_local(t2)
        allocate(b, t2, 640)
        (load,) = b.build_meta(scheduler_output({})).loads
        assert [(c.key, c.kind) for c in load.chunks] == [
            (keys[0], "prompt"), (keys[1], "prompt"), (keys[2], "prompt_tail")]
    finally:
        b.close()
        lower.close()


def test_request_options_parse_only_booleans():
    class R:
        kv_transfer_params = {"kvpool": {"save_decode": False, "tails": "no"}}
    assert request_options(R(), True, True) == (False, True)
    R.kv_transfer_params = None
    assert request_options(R(), True, False) == (True, False)
