"""Tail objects and decode KV in the scheduler half, on real vLLM requests driven step by
step the way vLLM's scheduler drives them: a chat's second turn finds everything the first
computed (prompt, answer, the blocks past the last full chunk) up to the last full block."""

from __future__ import annotations

import pytest
from vllm.v1.request import RequestStatus

from kvpool_connector.connector.config import load_connector_config
from kvpool_connector.connector.keys import chunk_keys
from kvpool_connector.connector.metadata import KVPoolWorkerMetadata
from kvpool_connector.connector.scheduler import SchedulerSide
from kvpool_connector.connector.tails import is_tail_key, request_options, tail_key
from kvpool_connector.store import open_store
from tests.conftest import SECURITY
from tests.connector.connector.conftest import scheduler_side
from tests.connector.connector.helpers import (
    BPC,
    BS,
    PREFIX,
    allocate,
    held_then_answered,
    make_request,
    part_of,
    run_turn,
    scheduler_output,
    with_prompt,
)

TAILS = {"tail_objects": True}


@pytest.mark.parametrize("side", [TAILS], indirect=True)
def test_second_turn_loads_everything_the_first_computed(side):
    t1 = make_request("t1", 700)  # 5 blocks (2 chunks + a 1-block tail) and 60 tokens
    assert side.num_matched(t1, 0) == (0, False)
    allocate(side, t1, 0)
    jobs = run_turn(side, t1, list(range(10, 210)))  # 200 tokens: 900 in all, 899 computed
    kinds = [k for j in jobs for k in j.kinds]
    # the prompt's two chunks; at prefill end its tail (block 4); the chunk the answer
    # completed (tokens 512-767); at finish the tail of block 6 and the partial block 7
    # (tokens 896-898)
    assert kinds == ["prompt", "prompt", "prompt_tail", "decode", "decode_tail", "decode_tail"]
    prompt_tail, finish_tail, finish_part = [j for j in jobs if j.kinds[0].endswith("tail")]
    assert prompt_tail.keys == [tail_key(PREFIX, t1.block_hashes, 4, 1)]
    assert prompt_tail.block_ids == [[side.test_blocks["t1"][4]]]
    assert finish_tail.keys == [tail_key(PREFIX, t1.block_hashes, 6, 1)]
    assert finish_part.keys == [part_of(t1, 899)]
    assert finish_part.block_ids == [[side.test_blocks["t1"][7]]]
    tails = prompt_tail.keys + finish_tail.keys + finish_part.keys
    assert all(is_tail_key(k) for k in tails)
    # the predicate the worker's store evicts first by: tails only, never a full chunk
    assert not any(is_tail_key(k) for k in chunk_keys(PREFIX, t1.block_hashes, BPC))

    t2 = with_prompt("t2", list(t1.all_token_ids) + list(range(300, 350)))  # 950 tokens
    hit, is_async = side.num_matched(t2, 0)
    # 3 full chunks, the 1-block tail and 3 tokens of block 7: 899 of 950, computed 51:
    # the 50 new tokens and the answer's last one, which vLLM never computed
    assert (hit, is_async) == (899, False)  # all in the workers' memory: loaded within the step
    ids = allocate(side, t2, 899)
    (load,) = side.build_meta(scheduler_output({})).loads
    keys = chunk_keys(PREFIX, t2.block_hashes, BPC)
    assert [c.key for c in load.chunks] == keys[:3] + finish_tail.keys + finish_part.keys
    tail, part = load.chunks[-2:]
    assert (tail.rows, tail.block_ids, tail.n_blocks, tail.tokens) == ([0], [ids[6]], 1, 0)
    assert (part.rows, part.block_ids, part.n_blocks, part.tokens) == ([0], [ids[7]], 1, 3)
    # the workers count each hit by these kinds (and the tier that served it)
    assert [c.kind for c in load.chunks] == ["prompt", "prompt", "decode", "decode_tail",
                                             "decode_tail"]


@pytest.mark.parametrize("side", [TAILS], indirect=True)
def test_a_partial_block_matches_only_its_own_tokens_and_follows_vllms_own_cache(side):
    t1 = make_request("t1", 700)
    allocate(side, t1, 0)
    run_turn(side, t1, list(range(10, 14)))  # 704 tokens, 703 computed: block 5 holds 63
    base = list(t1.all_token_ids)[:703]
    # the same 703 tokens then others: the partial block 5 (63 tokens)
    assert side.num_matched(with_prompt("a", base + [5, 6]), 0) == (703, False)
    # block 5's 61st token differs: no partial block matches, the whole blocks do
    changed = base[:700] + [1999] + base[701:] + [5]
    assert side.num_matched(with_prompt("b", changed), 0) == (640, False)
    # vLLM's own prefix cache holds the 5 whole blocks: the partial block alone is loaded
    c = with_prompt("c", base + [5])
    assert side.num_matched(c, 640) == (63, False)
    # vLLM's hit sources name the cpu tier for all of it (the connector's
    # get_external_cache_hit_sources asks this)
    assert side.hit_sources(c) == (2, 0) and side.tail_hit_local(c)
    ids = allocate(side, c, 63)
    (load,) = side.build_meta(scheduler_output({})).loads
    assert [(x.key, x.block_ids, x.tokens) for x in load.chunks] == [
        (part_of(t1, 703), [ids[5]], 63)]
    # a request with an image: token ids do not name its KV, no partial block
    img = with_prompt("i", base + [5])
    img.mm_features = ["an image"]
    assert side.num_matched(img, 0) == (640, False)


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
    # no decode chunk; at finish the tail is the prompt's again (nothing new) and the
    # partial block the 60 prompt tokens of block 5
    assert [k for j in jobs for k in j.kinds] == ["prompt", "prompt", "prompt_tail",
                                                  "prompt_tail"]
    t2 = with_prompt("t2", list(t1.all_token_ids) + [9] * 50)
    assert side.num_matched(t2, 0) == (700, False)  # the prompt, not the answer
    allocate(side, t2, 700)
    (load,) = side.build_meta(scheduler_output({})).loads
    assert [c.kind for c in load.chunks] == ["prompt", "prompt", "prompt_tail", "prompt_tail"]
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
    """Engine A's workers wrote a prompt's 2 chunks, its tail and its partial block through
    their cpu tier to Redis. Engine B (its own, empty cpu tier) finds them off the step
    loop: None while the Redis job runs, then all 700 prompt tokens, from Redis."""
    monkeypatch.setenv("KVPOOL_TEST_REDIS_PASSWORD", redis_server.password)
    cfg = load_connector_config({"namespace": namespace, "security": SECURITY, "tiers": [
        {"type": "cpu", "size": "64Mi"},
        {"type": "redis", "url": redis_server.url, "password_env": "KVPOOL_TEST_REDIS_PASSWORD"}]})
    t1 = make_request("t1", 700)  # 5 blocks: 2 chunks + a 1-block tail, and 60 tokens
    keys = [*chunk_keys(PREFIX, t1.block_hashes, BPC), tail_key(PREFIX, t1.block_hashes, 4, 1),
            part_of(t1, 700)]
    with open_store(cfg.as_store_config(), layout="fp") as engine_a:
        engine_a.put_many(keys, [b"x" * 64] * 4)
    lower = open_store(cfg.as_store_config(drop_types=("cpu",)), layout="fp")
    b = SchedulerSide(cfg, PREFIX, BS, BPC, chunk_bytes=1 << 20, world_size=1, lower_store=lower,
                      block_ids=lambda rid: [b.test_blocks[rid]], is_async=True)
    b.test_blocks = {}
    try:
        t2 = with_prompt("t2", list(t1.prompt_token_ids) + [9] * 50)  # the next turn
        # the tail probe (the real Redis call, after the chunks') held: a probe made inline
        # would block the lookup instead of answering None
        answer = held_then_answered(b, t2, monkeypatch, lower,
                                    "first_present")
        assert answer == (700, True)  # 2 chunks, the tail, 60 tokens; tails off: 512
        assert b.hit_sources(t2) == (0, 2) and not b.tail_hit_local(t2)
        allocate(b, t2, 700)
        (load,) = b.build_meta(scheduler_output({})).loads
        assert [(c.key, c.kind, c.tokens) for c in load.chunks] == [
            (keys[0], "prompt", 0), (keys[1], "prompt", 0), (keys[2], "prompt_tail", 0),
            (keys[3], "prompt_tail", 60)]
    finally:
        b.close()
        lower.close()


def test_request_options_parse_only_booleans():
    class R:
        kv_transfer_params = {"kvpool": {"save_decode": False, "tails": "no"}}
    assert request_options(R(), True, True) == (False, True)
    R.kv_transfer_params = None
    assert request_options(R(), True, False) == (True, False)


@pytest.mark.parametrize("side", [{**TAILS, "require_cache_salt": True}], indirect=True)
def test_a_pool_isolating_unsalted_requests_without_encryption_saves_no_partial_block(side,
                                                                                    tmp_path):
    """A partial block carries its block's other slots as an earlier request left them,
    maybe an unsalted one the pool never stores: with require_cache_salt and unencrypted
    shared tiers (this disk tier) no partial block is saved; whole blocks are."""
    assert not side.cfg.security.encrypt
    t1 = make_request("t1", 700, cache_salt="tenant-a")
    allocate(side, t1, 0)
    jobs = run_turn(side, t1, list(range(10, 210)))
    assert [k for j in jobs for k in j.kinds] == ["prompt", "prompt", "prompt_tail", "decode",
                                                  "decode_tail"]
    # the same pool encrypting its shared tiers saves it
    enc = scheduler_side("enc", {"type": "disk", "path": str(tmp_path / "enc"), "size": "64Mi"},
                         **TAILS, require_cache_salt=True,
                         security={**SECURITY, "encrypt": True})
    try:
        t2 = make_request("t2", 700, cache_salt="tenant-a")
        allocate(enc, t2, 0)
        jobs = run_turn(enc, t2, list(range(10, 210)))
        assert jobs[-1].keys == [part_of(t2, 899)]
    finally:
        enc.close()
        enc.lower.close()


def test_a_request_may_turn_tails_and_decode_kv_off_but_never_on():
    class R:
        kv_transfer_params = {"kvpool": {"save_decode": True, "tails": True}}
    assert request_options(R(), False, False) == (False, False)


@pytest.mark.parametrize("side", [TAILS], indirect=True)
def test_finish_saves_only_what_executed_steps_computed(side):
    """With async scheduling (speculative decoding) num_computed_tokens counts a step in
    flight, drafts not in all_token_ids yet: the finish saves stop at vLLM's safe point
    (num_computed_tokens - num_output_placeholders) and never past the token ids (a
    255-token prompt and one output token used to end the engine in an assertion)."""
    req = make_request("s", 255)
    allocate(side, req, 0)
    side.build_meta(scheduler_output({"s": 255}))
    req.num_computed_tokens = 259  # the in-flight step: 1 real token + 3 drafts
    req.num_output_placeholders = 3
    req.append_output_token_ids(7)  # 256 token ids
    req.status = RequestStatus.FINISHED_STOPPED
    side.finished(req, [list(range(100, 104))])
    saves = side.build_meta(scheduler_output({})).saves
    assert [k for s in saves for k in s.keys] == []  # 256 tokens: one full chunk, saved
    req2 = make_request("s2", 300)
    allocate(side, req2, 0)
    side.build_meta(scheduler_output({"s2": 300}))
    req2.num_computed_tokens = 304  # no placeholders reported, ids end at 301
    req2.append_output_token_ids(7)
    req2.status = RequestStatus.FINISHED_STOPPED
    side.finished(req2, [list(range(100, 104))])
    (part,) = side.build_meta(scheduler_output({})).saves
    assert part.keys == [part_of(req2, 301)]


@pytest.mark.parametrize("side", [TAILS], indirect=True)
def test_a_history_shorter_than_a_block_saves_no_partial_block(side):
    """A partial block keys on the block before it (whose hash chain carries the tenant's
    salt): nothing of block 0 alone is ever saved or looked up."""
    req = make_request("short", 60, cache_salt="tenant-a")
    allocate(side, req, 0)
    jobs = run_turn(side, req, list(range(10, 40)))  # 90 tokens, 89 computed
    assert jobs == []
    again = with_prompt("again", list(req.all_token_ids) + [5])
    assert side.num_matched(again, 0) == (0, False)


@pytest.mark.parametrize("side", [TAILS], indirect=True)
def test_a_partial_block_that_fails_to_load_is_forgotten_and_recomputed(side):
    t1 = make_request("t1", 700)
    allocate(side, t1, 0)
    run_turn(side, t1, list(range(10, 14)))  # 703 computed: the partial block 5 (63)
    t2 = with_prompt("t2", list(t1.all_token_ids) + [5])
    assert side.num_matched(t2, 0) == (703, False)
    allocate(side, t2, 703)
    side.build_meta(scheduler_output({}))
    part = part_of(t1, 703)
    side.on_worker_meta(KVPoolWorkerMetadata(failed_loads={"t2": [part]}))
    assert part not in side.index  # evicted or corrupt: no longer promised
    assert side.num_matched(t2, 0) == (640, False)  # the chunks and the tail still are
