"""Prefill/decode disaggregation through the pool (connector/handover.py) in real vLLM
engines sharing a real redis-server: a prefill engine (asked the way vllm-router's P/D mode
and llm-d's nixlv2 sidecar ask: `max_tokens=1`, `do_remote_decode: true`) returns a
handover only once its chunks and tail are in Redis and on a disk volume; a decode engine
given that handover (one reading Redis, one the disk volume) loads them and computes only
what vLLM must (less than one block), bit for bit (KV audit), with outputs logprob-close to
an engine without connector. A decode request without a handover (llm-d's shared-storage
protocol: the prefill engine runs with `handover_always`, its request carries no params)
finds the written-through chunks and tail by an ordinary lookup. Decode asked
before the tail landed waits and never loads the partial prefix; Redis killed between the
two means recompute, never an error.
"""

from __future__ import annotations

import threading
import time

import pytest

from kvpool_dev.testbed.engine import metric_total
from kvpool_dev.testbed.oracle import check_logprobs_close

from .conftest import connector_engine, redis_client, redis_env, redis_tier, token_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 128  # vLLM's block size on the CPU platform
CPU = {"type": "cpu", "size": "256Mi"}
WAIT_S = 4.0  # the decode engines' handover_wait_seconds
# 1000: 3 chunks + a 1-block tail + 103 tokens of block 7 (all but the last prompt token);
# 1024: 3 chunks + a 1-block tail + 127 tokens of block 7; 1700: 6 chunks + a 1-block tail
# + 35 tokens of block 13. The decode engine computes only the last prompt token.
PROMPTS = {"p1000": token_prompt(1000, 900), "p1024": token_prompt(1024, 901),
           "p1700": token_prompt(1700, 902), "race": token_prompt(1500, 903),
           "killed": token_prompt(1200, 904), "down": token_prompt(1100, 905),
           # the same shapes, new to the pool, for the disk volume's decode engine
           "disk-p1000": token_prompt(1000, 906), "disk-p1700": token_prompt(1700, 907),
           "shared": token_prompt(1450, 908)}
# what vllm-router (vllm_pd_router.rs) and llm-d's sidecar (connector_nixlv2.go) send
ROUTER_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


@pytest.fixture(autouse=True)
def kv_audit(audit):
    yield
    audit.check()


@pytest.fixture(scope="module")
def engines(tiny_model, redis_server, namespace, audit, tmp_path_factory):
    """The prefill engine writes through to a disk volume and Redis; one decode engine reads
    Redis only, the other the disk volume only (the same directory: a volume both mount).
    The prefill engine has `handover_always` (llm-d's shared-storage protocol sends no params);
    every other prefill here asks for its handover as the routers do, which a prefill engine
    with `handover_requests` (what the operator renders for spec.prefill) gets as well."""
    redis = redis_tier(redis_server)
    disk = {"type": "disk", "path": str(tmp_path_factory.mktemp("pd-disk")), "size": "1Gi"}
    # a small paged cache (96 blocks, 12k tokens): three engines at once stay in memory
    common = {"env": redis_env(redis_server), "audit_dir": audit.directory,
              "disable_log_stats": False, "max_model_len": 4096, "num_gpu_blocks_override": 96}
    wait = {"extra": {"handover_wait_seconds": WAIT_S}}
    always = {"extra": {"handover_always": True}}
    started = [connector_engine(tiny_model, [CPU, disk, redis], namespace, **always,
                                **common).launch(),
               connector_engine(tiny_model, [CPU, redis], namespace, **wait, **common).launch(),
               connector_engine(tiny_model, [CPU, disk], namespace, **wait, **common).launch()]
    try:
        yield tuple(e.wait_ready() for e in started)
    finally:  # each stop waits for its engine to shut down: all at once
        stops = [threading.Thread(target=e.stop) for e in started]
        for t in stops:
            t.start()
        for t in stops:
            t.join()


def _prefill(engine, names):
    outs = engine.generate([{"prompt_token_ids": PROMPTS[n], "kv_transfer_params": ROUTER_PREFILL}
                            for n in names], max_tokens=1)
    return [o["kv_transfer_params"] for o in outs]


def _decode(engine, names, params):
    return engine.generate([{"prompt_token_ids": PROMPTS[n], "kv_transfer_params": p}
                            for n, p in zip(names, params, strict=True)])


def _blocks(tokens: list[int]) -> int:
    """Blocks loaded for these hits: whole blocks, and the partial block of each."""
    return sum(-(-t // BLOCK) for t in tokens)


def _counter(engine, name: str) -> float:
    return metric_total(engine.metric_samples(), name)


def _redis_has(redis_server, namespace: str, name_hex: str) -> bool:
    r = redis_client(redis_server)
    try:
        return any(True for _ in r.scan_iter(match=f"*{namespace}:{name_hex}"))
    finally:
        r.close()


def test_one_prefill_one_decode_through_redis(engines, redis_server, namespace, audit,
                                              plain_engine):
    prefill, decode, _ = engines
    names = ["p1000", "p1024", "p1700"]
    params = _prefill(prefill, names)
    for n, p in zip(names, params, strict=True):
        hv = p["kvpool"]["handover"]
        assert hv["tokens"] == len(PROMPTS[n]) - 1, (n, p)
        # durable before the handover: the prefix's last object is in Redis already
        assert _redis_has(redis_server, namespace, hv["name"]), n
    hits, before = _counter(decode, "kvpool_handover_hits"), audit.check()
    outs = _decode(decode, names, params)
    claim = [len(PROMPTS[n]) - 1 for n in names]  # decode computes one token of each
    assert [o["num_cached_tokens"] for o in outs] == claim
    assert _counter(decode, "kvpool_handover_hits") - hits == len(names)
    assert audit.check() - before == _blocks(claim)  # every block equals the one saved
    check_logprobs_close(outs, plain_engine.generate([PROMPTS[n] for n in names]), names=names,
                         label="decode after a prefill through Redis")


def test_one_prefill_one_decode_through_a_shared_disk_volume(engines, audit, plain_engine):
    prefill, _, decode = engines
    names = ["p1000", "p1700"]
    params = _prefill(prefill, [f"disk-{n}" for n in names])
    before = audit.check()
    outs = _decode(decode, [f"disk-{n}" for n in names], params)
    claim = [len(PROMPTS[n]) - 1 for n in names]
    assert [o["num_cached_tokens"] for o in outs] == claim
    assert audit.check() - before == _blocks(claim)
    check_logprobs_close(outs, plain_engine.generate([PROMPTS[f"disk-{n}"] for n in names]),
                         names=names, label="decode after a prefill through a disk volume")


def test_shared_storage_decode_finds_the_prompt_without_a_handover(engines, redis_server,
                                                                  namespace, audit,
                                                                  plain_engine):
    """llm-d's shared-storage protocol: the prefill request is `max_tokens: 1` with no
    kv_transfer_params, the decode request carries nothing from the prefill. The prefill
    engine's `handover_always` writes the prompt through before its response (the tail, the
    prefix's last object, is in Redis when the response arrives), and the decode engine's
    ordinary lookup finds the chunks, the tail and the partial block."""
    prefill, decode, _ = engines
    handovers = _counter(prefill, "kvpool_handovers")
    (pre,) = prefill.generate([{"prompt_token_ids": PROMPTS["shared"]}], max_tokens=1)
    hv = pre["kv_transfer_params"]["kvpool"]["handover"]  # asked for none, handed over all
    assert hv["tokens"] == 1449
    assert _redis_has(redis_server, namespace, hv["name"])  # durable before the response
    assert _counter(prefill, "kvpool_handovers") - handovers == 1
    before = audit.check()
    (out,) = decode.generate([PROMPTS["shared"]])
    assert out["num_cached_tokens"] == 1449
    assert audit.check() - before == _blocks([1449])
    check_logprobs_close([out], plain_engine.generate([PROMPTS["shared"]]), names=["shared"],
                         label="shared-storage decode")


def test_decode_asked_before_the_tail_landed_waits_for_it(engines, redis_server, namespace,
                                                          audit, plain_engine):
    prefill, decode, _ = engines
    (params,) = _prefill(prefill, ["race"])
    name = params["kvpool"]["handover"]["name"]
    r = redis_client(redis_server)
    try:  # the chunks and the tail are visible, the last object is not (yet)
        (tail,) = r.scan_iter(match=f"*{namespace}:{name}")
        sealed = r.get(tail)
        assert r.delete(tail) == 1
        got: dict = {}
        worker = threading.Thread(
            target=lambda: got.update(out=_decode(decode, ["race"], [params])))
        worker.start()
        time.sleep(0.5)  # decode polls meanwhile (no timing asserted: the outcome is)
        assert not got
        r.set(tail, sealed)  # the tail's write lands now
        worker.join(timeout=300)
    finally:
        r.close()
    (out,) = got["out"]
    # the whole handover, its last object included: the shorter prefix was never loaded
    assert out["num_cached_tokens"] == 1500 - 1
    check_logprobs_close([out], plain_engine.generate([PROMPTS["race"]]), names=["race"],
                         label="decode that waited for the handover")


def test_redis_killed_mid_handover_means_recompute(engines, redis_server, plain_engine):
    prefill, decode, _ = engines
    (params,) = _prefill(prefill, ["killed"])
    assert params["kvpool"]["handover"]["tokens"] == 1200 - 1
    timeouts = _counter(decode, "kvpool_handover_timeouts")
    redis_server.stop()
    try:
        (out,) = _decode(decode, ["killed"], [params])  # waits WAIT_S, then computes
        assert out["num_cached_tokens"] == 0
        assert _counter(decode, "kvpool_handover_timeouts") - timeouts == 1
        # a prefill with Redis down hands nothing over, and no error reaches the client
        (down,) = _prefill(prefill, ["down"])
        assert not down
        (after,) = _decode(decode, ["down"], [down])
        assert after["num_cached_tokens"] == 0
    finally:
        redis_server.start()  # an empty Redis on the same port, for the modules after this
    base = plain_engine.generate([PROMPTS["killed"], PROMPTS["down"]])
    check_logprobs_close([out, after], base, names=["killed", "down"], label="Redis killed")
