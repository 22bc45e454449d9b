"""Multi-turn chat in a real vLLM engine: turn 2 (turn 1's prompt + every generated id + new
tokens, token-exact) loads the prompt's chunks, the chunk the answer completed, the tail
object past it and the partial block after that, and computes only its new tokens and the
answer's last token (which turn 1 sampled but never computed). The KV audit
proves every loaded block (tail and decode chunk included) equals, bit for bit, the block
saved; the outputs are logprob-close to an engine without connector. Then 64 conversations
at once in a paged cache of 48 blocks, both turns preempted: the same oracles, every kind of
object (prompt and decode chunks, prompt and decode tails) counted as loaded, every load the
scheduler planned either loaded (and audited) or counted as an error.
"""

from __future__ import annotations

import pytest

from kvpool_dev.testbed.oracle import check_logprobs_close

from .conftest import connector_engine, token_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 128  # vLLM's block size on the CPU platform
CPU = {"type": "cpu", "size": "512Mi"}
# 1000 prompt tokens + a 160-token answer: 1159 computed = 4 chunks (the 4th completed by
# the answer: decode KV) + 1 block past them (the tail object) + 7 tokens (a partial block)
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


def test_turn_two_computes_only_its_new_tokens(runs):
    for i in (0, 1):
        prompt = runs["t2_prompts"][i]
        cached = runs["t2"][i]["num_cached_tokens"]
        # turn 1 computed 1159 tokens: 4 chunks (1024), the 1-block tail, 7 more tokens
        assert cached == len(TURN1[i]) + ANSWER - 1 == 1159, (i, cached)
        assert len(prompt) - cached == NEW + 1
    # decode KV off for conversation 2: its prompt's 3 chunks, tail and partial block
    assert runs["t2"][2]["num_cached_tokens"] == 1000
    # turn 2 itself saved its prompt's chunks and tail (9 blocks) and, at finish, a partial
    # block past its prompt: run again, the same prompts (1200 tokens) find those 1152
    # tokens and turn 1's partial block (7 more tokens); conversation 2's turn 1 partial
    # block (104 tokens of block 7) is shorter than the whole blocks turn 2 stored
    assert [o["num_cached_tokens"] for o in runs["t2_batch"]] == [1159, 1159, 1152]


def test_tail_and_decode_blocks_load_bit_for_bit(runs, audit):
    # turn 2 loaded 10 + 10 + 8 blocks (a partial block each), each equal to the block
    # saved (audit.check asserts it)
    assert runs["audit_after_t2"] - runs["audit_before_t2"] == 10 + 10 + 8
    assert audit.check() >= runs["audit_after_t2"]


def test_outputs_are_close_to_an_engine_without_connector(runs):
    names = [f"conv{i}" for i in range(3)]
    check_logprobs_close(runs["t1"], runs["base_t1"], names=names, label="turn 1")
    check_logprobs_close(runs["t2"], runs["base_t2"], names=names, label="turn 2")
    check_logprobs_close(runs["t2_batch"], runs["base_t2"], names=names, label="turn 2 batch")


CROWD = 64  # conversations at once in a paged cache of 48 blocks: both turns preempt
CROWD_BLOCKS = 48
CROWD_ANSWER = 70
# prompt tokens by conversation i % 3, and what turn 2 then loads (70-token answers): all
# that turn 1 computed, the last of it in a partial block holding generated tokens
# (decode_tail):
# 200: 269 computed, the one chunk completed by the answer (decode), 13 tokens more;
# 330: 399 computed, the prompt's chunk + one block past it holding generated tokens
#      (decode_tail), 15 tokens more;
# 400: 469 computed, the prompt's chunk + one block of prompt tokens (prompt_tail), 85 more
SHAPES = (200, 330, 400)
SHAPE_CACHED = (269, 399, 469)  # what turn 2 finds of each (its new tokens come after)
SHAPE_KINDS = (("decode", "decode_tail"), ("prompt", "decode_tail"),
               ("prompt", "prompt_tail", "decode_tail"))


def _delta(before: list[dict], after: list[dict], name: str, **labels: str) -> float:
    from kvpool_dev.testbed.engine import metric_total

    return metric_total(after, name, **labels) - metric_total(before, name, **labels)


@pytest.fixture(scope="module")
def crowd(tiny_model, audit, runs, plain_engine):  # after `runs`: one engine at a time
    """64 conversations at once, turn 1 then turn 2, in an engine whose paged cache holds
    about 14 of them: requests are preempted while their chunks, answers' KV and tails are
    being saved and loaded."""
    turn1 = [token_prompt(SHAPES[i % 3], 700 + i) for i in range(CROWD)]
    out: dict = {"turn1": turn1}
    with connector_engine(tiny_model, [CPU], "crowd-" + str(id(out)), audit_dir=audit.directory,
                          max_model_len=4096, num_gpu_blocks_override=CROWD_BLOCKS,
                          disable_log_stats=False) as eng:
        out["audit_start"] = audit.check()
        before = eng.metric_samples()
        out["t1"] = eng.generate(turn1, max_tokens=CROWD_ANSWER, timeout=900)
        out["t2_prompts"] = [_turn2(turn1[i], out["t1"][i]["token_ids"], 100 + i)
                             for i in range(CROWD)]
        out["audit_before"] = audit.check()
        mid = eng.metric_samples()
        out["t2"] = eng.generate(out["t2_prompts"], timeout=900)
        out["audit_after"] = audit.check()
        after = eng.metric_samples()
    out["d1"] = lambda name, **labels: _delta(before, mid, name, **labels)
    out["d2"] = lambda name, **labels: _delta(mid, after, name, **labels)
    out["d"] = lambda name, **labels: _delta(before, after, name, **labels)
    out["base_t1"] = plain_engine.generate(turn1, max_tokens=CROWD_ANSWER)
    out["base_t2"] = plain_engine.generate(out["t2_prompts"])
    return out


def test_64_concurrent_conversations_with_preemption(crowd):
    """Both turns preempted, every load bit for bit (the audit), outputs close to an engine
    without connector, and turn 2 really loaded tails and decode chunks."""
    d, d1, d2 = crowd["d"], crowd["d1"], crowd["d2"]
    assert d1("vllm:num_preemptions") > 0, "turn 1 did not overflow the paged cache"
    assert d2("vllm:num_preemptions") > 0, "turn 2 did not overflow the paged cache"
    names = [f"crowd{i}" for i in range(CROWD)]
    check_logprobs_close(crowd["t1"], crowd["base_t1"], names=names, label="crowd turn 1")
    check_logprobs_close(crowd["t2"], crowd["base_t2"], names=names, label="crowd turn 2")
    cached = [o["num_cached_tokens"] for o in crowd["t2"]]
    expected = [SHAPE_CACHED[i % 3] for i in range(CROWD)]
    # a turn 1 whose tail or decode chunk was dropped computes more; at most a few
    assert all(c <= e for c, e in zip(cached, expected, strict=True)), cached
    assert sum(c == e for c, e in zip(cached, expected, strict=True)) >= CROWD * 3 // 4, cached
    # turn 2 loaded each kind its shapes hold (counted per object loaded and verified; a
    # request preempted during turn 2 loads its objects again, so counts may exceed these)
    for kind in ("prompt", "decode", "prompt_tail", "decode_tail"):
        holders = sum(kind in SHAPE_KINDS[i % 3] for i in range(CROWD))
        assert d2("kvpool_hit_objects", kind=kind, tier="cpu") >= holders // 2, kind
    # every block loaded was audited equal to its save, and every load is accounted for:
    # what the scheduler planned to load is what the workers loaded (hit tokens, each block
    # of them audited) plus what failed (counted, recomputed by vLLM)
    audited = crowd["audit_after"] - crowd["audit_start"]  # audit.check asserted equality
    hit_tokens = d("kvpool_hit_tokens")
    # a partial block is one block audited and only its tokens counted
    parts = d("kvpool_hit_objects", kind="decode_tail") + d("kvpool_hit_objects",
                                                            kind="prompt_tail")
    assert 0 < hit_tokens <= audited * BLOCK < hit_tokens + parts * BLOCK
    planned, errors = d("kvpool_lookup_hit_tokens"), d("kvpool_load_error_chunks")
    if errors:
        assert 0 < planned - hit_tokens <= errors * 2 * BLOCK, (planned, hit_tokens, errors)
    else:
        assert planned == hit_tokens, (planned, hit_tokens)
