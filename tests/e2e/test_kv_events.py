"""vLLM's KV event stream with kvpool's local tiers in it: a real engine with
`kv_events_config` (vLLM's ZMQ publisher, as `--kv-events-config` sets it up in a server) and
a real ZMQ subscriber decoding its msgpack batches.
vLLM's own events for the paged cache (medium GPU) are the oracle: the cpu and disk tiers'
events must name the same block hashes, parents and tokens, chunk by chunk."""

from __future__ import annotations

import json

import pytest

from kvpool_dev.testbed.dtype import engine_dtype
from kvpool_dev.testbed.engine import OfflineEngine
from kvpool_dev.testbed.kv_events import KVEventSubscriber
from kvpool_dev.testbed.localmodel import kv_bytes_per_token
from tests.e2e.conftest import kv_config, token_prompt

BPC = 2           # 256-token chunks of 128-token blocks (vLLM's block size on CPU)
CHUNK_TOKENS = 256
CPU_CHUNKS = 8


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory, namespace):
    # ipc: the publisher binds a local socket (a tcp host:port endpoint would make it connect)
    endpoint = f"ipc://{tmp_path_factory.mktemp('zmq')}/kv-events"
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
              "topic": "kvpool-test"}
    config = json.loads((tiny_model / "config.json").read_text())
    chunk_bytes = kv_bytes_per_token(config, engine_dtype()) * CHUNK_TOKENS
    tiers = [{"type": "cpu", "size": CPU_CHUNKS * chunk_bytes},
             {"type": "disk", "path": str(tmp_path_factory.mktemp("disk")), "size": "64Mi"}]
    eng = OfflineEngine(tiny_model, kv_transfer_config=kv_config(tiers, namespace),
                        kv_events_config=events, max_model_len=4096)
    with eng:
        sub = KVEventSubscriber(endpoint, topic="kvpool-test")
        eng.subscriber = sub
        # ZMQ's slow joiner: events published before the SUB socket joined are lost. Send
        # new prompts of one vLLM block (less than a chunk, tail objects off: nothing for
        # kvpool's tiers) until their paged-cache events arrive; the tests start from a
        # clean slate after that.
        seeds = iter(range(400, 500))
        sub.wait_for(lambda ev: ev or complete(eng, {
            "prompt_token_ids": token_prompt(200, seed=next(seeds)),
            "kv_transfer_params": {"kvpool": {"tails": False}}}), 60, "the subscription to join")
        sub.events.clear()
        sub.seqs.clear()
        yield eng
        sub.close()


def complete(engine, prompt: list[int] | dict) -> None:
    engine.generate([prompt], max_tokens=1, logprobs=0)


def of(events, kind: str, medium: str) -> list[dict]:
    return [e for e in events if e["type"] == kind and e.get("medium") == medium]


def hashes(events) -> list:
    return [h for e in events for h in e["block_hashes"]]


@pytest.mark.vllm
def test_cpu_and_disk_tiers_are_announced_like_the_paged_cache(engine):
    sub = engine.subscriber
    prompt = token_prompt(1100, seed=501)  # 8 full blocks: 4 chunks
    complete(engine, prompt)
    sub.wait_for(lambda ev: len(of(ev, "BlockStored", "CPU")) >= 4, 60, "4 CPU BlockStored")
    gpu, cpu = of(sub.events, "BlockStored", "GPU"), of(sub.events, "BlockStored", "CPU")
    assert len(cpu) == 4
    assert hashes(cpu) == hashes(gpu)[:4 * BPC]  # the same blocks, named the same way
    for c, e in enumerate(cpu):
        assert e["block_size"] == 128 and e["token_ids"] == prompt[c * 256:(c + 1) * 256]
        assert e["parent_block_hash"] == (hashes(gpu)[c * BPC - 1] if c else None)
    # the disk tier's writes are reported by the step after they land: drive steps
    def disk_done(ev):
        if len(of(ev, "BlockStored", "STORAGE")) < 4:
            complete(engine, token_prompt(8, seed=502))
            return False
        return True
    sub.wait_for(disk_done, 120, "4 STORAGE BlockStored")
    assert sorted(map(str, hashes(of(sub.events, "BlockStored", "STORAGE")))) == \
        sorted(map(str, hashes(cpu)))
    assert sub.seqs == sorted(sub.seqs)


@pytest.mark.vllm
def test_a_prompts_tail_object_is_announced_as_its_blocks(engine):
    """700 tokens: 2 chunks and a tail object of one block (tokens 512-639), announced as
    that block, named as the paged cache names it, its parent the last chunk's last block."""
    sub = engine.subscriber
    prompt = token_prompt(700, seed=551)

    def mine(ev) -> list[dict]:
        return [e for e in of(ev, "BlockStored", "CPU")
                if e["token_ids"] in (prompt[:256], prompt[256:512], prompt[512:640])]

    complete(engine, prompt)
    sub.wait_for(lambda ev: len(mine(ev)) >= 3, 60, "2 chunks and a tail, CPU BlockStored")
    c0, c1, tail = mine(sub.events)
    assert [len(e["block_hashes"]) for e in (c0, c1, tail)] == [BPC, BPC, 1]
    assert tail["parent_block_hash"] == c1["block_hashes"][-1]
    gpu = hashes(of(sub.events, "BlockStored", "GPU"))
    assert all(h in gpu for h in hashes([c0, c1, tail]))


@pytest.mark.vllm
def test_cpu_tier_evictions_are_announced(engine):
    sub = engine.subscriber
    first = token_prompt(1100, seed=601)
    complete(engine, first)
    sub.wait_for(lambda ev: any(e["token_ids"] == first[:256]
                                for e in of(ev, "BlockStored", "CPU")), 60, "first prompt stored")
    first_hashes = next(e for e in of(sub.events, "BlockStored", "CPU")
                        if e["token_ids"] == first[:256])["block_hashes"]
    for seed in range(602, 602 + CPU_CHUNKS // 4 + 1):  # more than the cpu tier holds
        complete(engine, token_prompt(1100, seed=seed))

    def evicted(ev):
        if not any(e["block_hashes"] == first_hashes for e in of(ev, "BlockRemoved", "CPU")):
            complete(engine, token_prompt(8, seed=700))  # evictions are reported next step
            return False
        return True
    sub.wait_for(evicted, 120, "a CPU BlockRemoved of the first prompt's first chunk")
    # an eviction from the cpu tier is not one from the disk: that one still holds it
    assert not any(e["block_hashes"] == first_hashes for e in of(sub.events, "BlockRemoved", "STORAGE"))
    # every removed chunk had been announced before
    stored = {tuple(e["block_hashes"]) for e in of(sub.events, "BlockStored", "CPU")}
    assert all(tuple(e["block_hashes"]) in stored for e in of(sub.events, "BlockRemoved", "CPU"))
