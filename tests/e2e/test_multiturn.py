"""Multi-turn chat in a real vLLM engine: turn 2 (turn 1's prompt + every generated id + new
tokens, token-exact) loads the prompt's chunks, the chunk the answer completed and the tail
object past it, and computes only its new tokens plus at most one vLLM block. The KV audit
proves every loaded block (tail and decode chunk included) equals, bit for bit, the block
saved; the outputs are logprob-close to an engine without connector.
"""

from __future__ import annotations

import pytest

from kvpool_dev.testbed.oracle import check_logprobs_close

from .conftest import connector_engine, token_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 128  # vLLM's block size on the CPU platform
CPU = {"type": "cpu", "size": "512Mi"}
# 1000 prompt tokens + a 160-token answer: 1159 computed = 4 chunks (the 4th completed by
# the answer: decode KV) + 1 block past them (the tail object)
TURN1 = [token_prompt(1000, 500 + i) for i in range(3)]
ANSWER = 160
NEW = 40


def _turn2(turn1: list[int], answer: list[int], i: int) -> list[int]:
    return turn1 + answer + token_prompt(NEW, 600 + i)


@pytest.fixture(scope="module")
def runs(tiny_model, audit, namespace, plain_engine):
    """Connector engine: turn 1 of three conversations, then turn 2 of each (conversation 2
    with decode KV off for its turn 1); then a plain engine computes the same prompts."""
    out = {}
    with connector_engine(tiny_model, [CPU], namespace, audit_dir=audit.directory) as eng:
        prompts = [{"prompt_token_ids": TURN1[0]}, {"prompt_token_ids": TURN1[1]},
                   {"prompt_token_ids": TURN1[2],
                    "kv_transfer_params": {"kvpool": {"save_decode": False}}}]
        out["t1"] = []
        for p in prompts:  # one at a time: each is alone in its batch
            out["t1"] += eng.generate([p], max_tokens=ANSWER)
        out["t2_prompts"] = [_turn2(TURN1[i], out["t1"][i]["token_ids"], i) for i in range(3)]
        out["audit_before_t2"] = audit.check()
        out["t2"] = [eng.generate([p])[0] for p in out["t2_prompts"]]
        out["audit_after_t2"] = audit.check()
        # all three again at once: hits while the others load and decode
        out["t2_batch"] = eng.generate(out["t2_prompts"])
    out["base_t1"] = plain_engine.generate(TURN1, max_tokens=ANSWER)
    out["base_t2"] = plain_engine.generate(out["t2_prompts"])
    return out


def test_turn_two_computes_only_its_new_tokens_and_one_block(runs):
    for i in (0, 1):
        prompt = runs["t2_prompts"][i]
        cached = runs["t2"][i]["num_cached_tokens"]
        # turn 1 computed 1159 tokens: 4 chunks (1024) + the 1-block tail (128)
        assert cached == (len(TURN1[i]) + ANSWER - 1) // BLOCK * BLOCK == 1152, (i, cached)
        assert len(prompt) - cached <= NEW + BLOCK
    # decode KV off for conversation 2: only its prompt's 3 chunks and the prompt's tail
    # (1000 tokens: 7 blocks)
    assert runs["t2"][2]["num_cached_tokens"] == 1000 // BLOCK * BLOCK == 896
    # turn 2 itself saved its prompt (chunks + the prompt's tail): run again, every prompt
    # (1200 tokens) is served up to its last full block, conversation 2's as well
    assert [o["num_cached_tokens"] for o in runs["t2_batch"]] == [1152, 1152, 1152]


def test_tail_and_decode_blocks_load_bit_for_bit(runs, audit):
    # turn 2 loaded 9 + 9 + 7 blocks, each equal to the block saved (audit.check asserts it)
    assert runs["audit_after_t2"] - runs["audit_before_t2"] == 9 + 9 + 7
    assert audit.check() >= runs["audit_after_t2"]


def test_outputs_are_close_to_an_engine_without_connector(runs):
    names = [f"conv{i}" for i in range(3)]
    check_logprobs_close(runs["t1"], runs["base_t1"], names=names, label="turn 1")
    check_logprobs_close(runs["t2"], runs["base_t2"], names=names, label="turn 2")
    check_logprobs_close(runs["t2_batch"], runs["base_t2"], names=names, label="turn 2 batch")


CROWD = 12  # conversations at once in a paged cache of 48 blocks: both turns preempt
CROWD_BLOCKS = 48


@pytest.fixture(scope="module")
def crowd(tiny_model, audit, runs, plain_engine):  # after `runs`: one engine at a time
    """12 conversations at once, turn 1 then turn 2, in an engine whose paged cache holds
    about 4 of them: requests are preempted while their answers' KV is being saved."""
    from kvpool_dev.testbed.engine import metric_total

    turn1 = [token_prompt(1000, 700 + i) for i in range(CROWD)]
    out = {"turn1": turn1}
    with connector_engine(tiny_model, [CPU], "crowd-" + str(id(out)), audit_dir=audit.directory,
                          max_model_len=4096, num_gpu_blocks_override=CROWD_BLOCKS,
                          disable_log_stats=False) as eng:
        before = eng.metric_samples()
        out["t1"] = eng.generate(turn1, max_tokens=ANSWER, timeout=900)
        out["t2_prompts"] = [_turn2(turn1[i], out["t1"][i]["token_ids"], 100 + i)
                             for i in range(CROWD)]
        out["audit_before"] = audit.check()
        out["t2"] = eng.generate(out["t2_prompts"], timeout=900)
        out["audit_after"] = audit.check()
        out["preemptions"] = (metric_total(eng.metric_samples(), "vllm:num_preemptions")
                              - metric_total(before, "vllm:num_preemptions"))
    out["base_t1"] = plain_engine.generate(turn1, max_tokens=ANSWER)
    out["base_t2"] = plain_engine.generate(out["t2_prompts"])
    return out


def test_concurrent_conversations_with_preemption(crowd):
    assert crowd["preemptions"] > 0, "the batch did not overflow the paged cache"
    names = [f"crowd{i}" for i in range(CROWD)]
    check_logprobs_close(crowd["t1"], crowd["base_t1"], names=names, label="crowd turn 1")
    check_logprobs_close(crowd["t2"], crowd["base_t2"], names=names, label="crowd turn 2")
    cached = [o["num_cached_tokens"] for o in crowd["t2"]]
    # every turn 2 finds at least its prompt's chunks; most find the answer and the tail too
    # (a turn 1 whose tail or decode chunk was dropped or evicted computes more)
    assert all(c >= 768 for c in cached), cached
    assert sum(c == 1152 for c in cached) >= CROWD // 2, cached
    assert crowd["audit_after"] > crowd["audit_before"]  # bit-for-bit (audit.check asserts)
