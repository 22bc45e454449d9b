"""Failures never change outputs: corrupt objects in Redis and a Redis server stopped while
requests run. Every request succeeds with the recompute output, the engine keeps serving,
and saving resumes once Redis is back."""

from __future__ import annotations

import threading

import pytest

from .conftest import (
    PROMPTS,
    connector_engine,
    full_chunk_tokens,
    redis_env,
    redis_keys,
    redis_tier,
    wait_until,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

NAMES = [f"fault{i}" for i in range(4)]


@pytest.fixture(scope="module")
def engine(tiny_model, redis_server, baseline, namespace):  # baseline first: one engine at a time
    with connector_engine(tiny_model, [redis_tier(redis_server)], namespace,
                          env=redis_env(redis_server)) as eng:
        yield eng


def _redis(redis_server):
    import redis

    return redis.Redis.from_url(redis_server.url, password=redis_server.password)


def test_corrupt_redis_values_are_recomputed(engine, redis_server, namespace, baseline):
    cold = engine.generate([PROMPTS["fault0"], PROMPTS["fault1"]])
    assert [o["token_ids"] for o in cold] == [baseline["fault0"], baseline["fault1"]]
    n = 2 * (4000 // 256)
    keys = wait_until(lambda: (lambda k: k if len(k) >= n else None)(redis_keys(redis_server, namespace)),
                      what="chunks in Redis")
    r = _redis(redis_server)
    corrupted = {}
    for k in keys:  # flip one byte in the middle of every stored value
        v = bytearray(r.get(k))
        v[len(v) // 2] ^= 0x5A
        r.set(k, bytes(v))
        corrupted[k] = bytes(v)
    outs = engine.generate([PROMPTS["fault0"], PROMPTS["fault1"]], timeout=300)
    assert [o["token_ids"] for o in outs] == [baseline["fault0"], baseline["fault1"]]
    # each corrupt value was rejected, and the recomputed chunk stored again
    wait_until(lambda: all(r.get(k) not in (None, bad) for k, bad in corrupted.items()),
               what="recomputed chunks written back to Redis")
    hot = engine.generate([PROMPTS["fault0"]])[0]
    assert hot["num_cached_tokens"] == full_chunk_tokens(PROMPTS["fault0"])
    assert hot["token_ids"] == baseline["fault0"]
    r.close()


def test_redis_stopped_while_requests_run(engine, redis_server, namespace, baseline):
    stopper = threading.Timer(0.2, redis_server.stop)
    stopper.start()
    try:
        outs = engine.generate([PROMPTS[n] for n in NAMES], timeout=300)
        assert [o["token_ids"] for o in outs] == [baseline[n] for n in NAMES]
        stopper.join()
        assert redis_server.proc is None
        # with Redis down the engine keeps serving (all misses, nothing raises or hangs)
        down = engine.generate([PROMPTS["fault2"]], timeout=120)[0]
        assert down["token_ids"] == baseline["fault2"] and down["num_cached_tokens"] == 0
    finally:
        stopper.join()
        redis_server.start()  # an empty Redis on the same port
    # recovery: the tier comes back after its backoff and hits return
    def hit():
        out = engine.generate([PROMPTS["fault3"]], timeout=120)[0]
        assert out["token_ids"] == baseline["fault3"]
        return out["num_cached_tokens"] == full_chunk_tokens(PROMPTS["fault3"])
    wait_until(hit, timeout=90, what="hits from the restarted Redis")
