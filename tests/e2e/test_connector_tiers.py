"""Prefix hits from every tier, across engine processes, token-identical to recompute.

One engine writes through all tiers (cpu, disk, Redis, S3); fresh engine processes that
see only one tier then load the prefix from it. A second engine running at the same time
shares hits through Redis in both directions.
"""

from __future__ import annotations

import pytest

from .conftest import (
    PROMPTS,
    connector_engine,
    disk_files,
    full_chunk_tokens,
    redis_env,
    redis_keys,
    redis_tier,
    s3_keys,
    s3_tier,
    wait_until,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CPU = {"type": "cpu", "size": "256Mi"}
RESULTS: dict[str, list[int]] = {}


@pytest.fixture(scope="module")
def pool(tmp_path_factory, redis_server, s3_server):
    import uuid

    ns = "tiers-" + uuid.uuid4().hex[:8]
    disk = {"type": "disk", "path": str(tmp_path_factory.mktemp("disk")), "size": "2Gi"}
    env = {**redis_env(redis_server), **s3_server.env()}
    return {"ns": ns, "disk": disk, "redis": redis_tier(redis_server), "s3": s3_tier(s3_server),
            "env": env, "redis_server": redis_server, "s3_server": s3_server}


def _chunks(name: str) -> int:
    return len(PROMPTS[name]) // 256


def _wait_stored(pool, n: int) -> None:
    """Lower tiers are written behind the forward pass: wait until they hold `n` chunks."""
    wait_until(lambda: len(disk_files(pool["disk"]["path"])) >= n, what=f"{n} objects on disk")
    wait_until(lambda: len(redis_keys(pool["redis_server"], pool["ns"])) >= n,
               what=f"{n} objects in Redis")
    wait_until(lambda: len(s3_keys(pool["s3_server"], pool["ns"])) >= n, what=f"{n} objects in S3")


@pytest.fixture(scope="module")
def writer(tiny_model, pool):
    tiers = [CPU, pool["disk"], pool["redis"], pool["s3"]]
    eng = connector_engine(tiny_model, tiers, pool["ns"], env=pool["env"]).start()
    first = eng.generate([PROMPTS["a4k"], PROMPTS["b4k"]])
    _wait_stored(pool, _chunks("a4k") + _chunks("b4k"))
    pool["ab_files"] = disk_files(pool["disk"]["path"])  # the objects of a4k and b4k
    yield eng, first
    eng.stop()


def test_cold_run_matches_recompute_and_fills_every_tier(writer, pool, baseline):
    _, first = writer
    for name, out in zip(["a4k", "b4k"], first):
        assert out["num_cached_tokens"] == 0
        assert out["token_ids"] == baseline[name]
    # all layers of a chunk are one object: one object per complete chunk in each tier
    assert len(disk_files(pool["disk"]["path"])) == _chunks("a4k") + _chunks("b4k")


def test_cpu_tier_hit_in_the_same_engine(writer, baseline):
    eng, _ = writer
    out = eng.generate([PROMPTS["a4k"]])[0]
    assert out["num_cached_tokens"] == full_chunk_tokens(PROMPTS["a4k"]) == 3840
    assert out["token_ids"] == baseline["a4k"]


def test_two_engines_at_the_same_time_share_redis(writer, tiny_model, pool, baseline):
    eng, _ = writer
    with connector_engine(tiny_model, [CPU, pool["redis"]], pool["ns"], env=pool["env"]) as other:
        got = other.generate([PROMPTS["a4k"]])[0]  # computed by the writer
        assert got["num_cached_tokens"] == full_chunk_tokens(PROMPTS["a4k"])
        assert got["token_ids"] == baseline["a4k"]
        cold = other.generate([PROMPTS["y3k"]])[0]  # new here: the writer gets it next
        assert cold["num_cached_tokens"] == 0 and cold["token_ids"] == baseline["y3k"]
        wait_until(lambda: len(redis_keys(pool["redis_server"], pool["ns"]))
                   >= _chunks("a4k") + _chunks("b4k") + _chunks("y3k"), what="y3k in Redis")
        back = eng.generate([PROMPTS["y3k"]])[0]
        assert back["num_cached_tokens"] == full_chunk_tokens(PROMPTS["y3k"])
        assert back["token_ids"] == baseline["y3k"]


@pytest.fixture(scope="module")
def writer_stopped(writer):
    writer[0].stop()  # from here on, one engine at a time


def _check_hits(outs, baseline, label):
    for name, out in zip(["a4k", "b4k"], outs):
        assert out["num_cached_tokens"] == full_chunk_tokens(PROMPTS[name]), (label, name)
        assert out["token_ids"] == baseline[name], (label, name)
        RESULTS[f"{name}/{label}"] = out["token_ids"]


def test_fresh_engine_hits_from_disk_only_layerwise_and_recomputes_corrupt_objects(
        writer_stopped, tiny_model, pool, baseline):
    with connector_engine(tiny_model, [pool["disk"]], pool["ns"], env=pool["env"],
                          extra={"layerwise": True}) as eng:
        _check_hits(eng.generate([PROMPTS["a4k"], PROMPTS["b4k"]]), baseline, "disk/layerwise")

        corrupted = {}
        for f in pool["ab_files"][::2]:  # flip one payload byte in every other object
            data = bytearray(f.read_bytes())
            data[len(data) // 2] ^= 0xFF
            f.write_bytes(bytes(data))
            corrupted[f] = bytes(data)
        outs = eng.generate([PROMPTS["a4k"], PROMPTS["b4k"]])
        for name, out in zip(["a4k", "b4k"], outs):
            assert out["token_ids"] == baseline[name]
        # every corrupt object was rejected on read and replaced by the recomputed chunk
        wait_until(lambda: all(f.exists() and f.read_bytes() != bad
                               for f, bad in corrupted.items()),
                   what="recomputed chunks saved again")
        _check_hits(eng.generate([PROMPTS["a4k"], PROMPTS["b4k"]]), baseline,
                    "disk/after-corruption")


@pytest.mark.parametrize("tier", ["redis", "s3"])
def test_fresh_engine_hits_from_one_remote_tier(writer_stopped, tiny_model, pool, baseline, tier):
    with connector_engine(tiny_model, [pool[tier]], pool["ns"], env=pool["env"]) as eng:
        _check_hits(eng.generate([PROMPTS["a4k"], PROMPTS["b4k"]]), baseline, tier)


def test_layerwise_on_and_off_give_identical_outputs():
    for name in ("a4k", "b4k"):
        assert RESULTS[f"{name}/disk/layerwise"] == RESULTS[f"{name}/redis"]
