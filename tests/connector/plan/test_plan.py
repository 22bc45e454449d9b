"""`kvpool plan` (issue 60): trace formats, bad input, the replay against hand-computed
figures, sweeps, and the command on a slice of Mooncake's public conversation trace."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool_cli.plan import bytes_per_token, knee, parse_sweep, tiers_block, with_size
from kvpool_connector.plan.sim import PoolModel, Result, TierModel, chunk_keys, replay
from kvpool_connector.plan.trace import Request, Trace, TraceError, parse_lines

DATA = Path(__file__).parent / "data"
SLICE = DATA / "mooncake_conversation_300.jsonl"


def line(**rec) -> str:
    return json.dumps(rec)


# -- formats ----------------------------------------------------------------------------------


def test_mooncake_and_bailian_records_are_detected_and_timed():
    moon = parse_lines([line(timestamp=3000, input_length=600, output_length=5, hash_ids=[7, 8]),
                        line(timestamp=0, input_length=512, output_length=1, hash_ids=[7])])
    assert (moon.format, moon.block_tokens) == ("mooncake", 512)
    assert [r.t for r in moon.requests] == [0.0, 3.0]   # ms, sorted by arrival
    assert moon.requests[1] == Request(3.0, 600, 5, (7, 8)) and moon.duration_s == 3.0
    bail = parse_lines([line(chat_id=1, parent_chat_id=-1, timestamp=1.5, input_length=40,
                             output_length=3, type="text", turn=1, hash_ids=[1, 2, 3])])
    assert (bail.format, bail.block_tokens, bail.requests[0].t) == ("bailian", 16, 1.5)
    # a format that leaves a partial last block unhashed: floor(40 / 16) ids also read
    assert parse_lines([line(chat_id=1, timestamp=0, input_length=40, output_length=1,
                             hash_ids=[1, 2])]).requests[0].hash_ids == (1, 2)


@pytest.mark.parametrize("text, message", [
    ("{not json", "trace line 1: not JSON (Expecting property name enclosed in double quotes "
                  "at column 2)"),
    ("[1, 2]", "trace line 1: a request must be a JSON object, not list"),
    (line(timestamp=0, input_length=0, output_length=1, hash_ids=[]),
     "trace line 1: field 'input_length' must be an integer >= 1, not 0"),
    (line(timestamp=-1, input_length=5, output_length=1, hash_ids=[1]),
     "trace line 1: field 'timestamp' must be a number >= 0, not -1"),
    (line(timestamp=0, input_length=5, output_length=1, hash_ids=["a"]),
     "trace line 1: field 'hash_ids' must be a list of integers"),
    (line(timestamp=0, input_length=1500, output_length=1, hash_ids=[1]),
     "trace line 1: field 'hash_ids' has 1 blocks; input_length 1500 in 512-token blocks "
     "needs 3"),
    ("", "trace: no requests"),
])
def test_bad_input_is_one_error_naming_line_and_field(text, message):
    with pytest.raises(TraceError) as e:
        parse_lines(["\n", text] if text else [])
    assert str(e.value) == message.replace("line 1", "line 2")


def test_a_bad_line_after_good_ones_and_limits():
    good = line(timestamp=0, input_length=5, output_length=1, hash_ids=[1])
    with pytest.raises(TraceError, match=r"^trace line 3: field 'output_length'"):
        parse_lines([good, good, line(timestamp=0, input_length=5, hash_ids=[1])])
    with pytest.raises(TraceError, match="more than 2 requests; replay a slice"):
        parse_lines([good] * 3, max_requests=2)
    with pytest.raises(TraceError, match="--format 'csv': not one of mooncake, bailian"):
        parse_lines([good], fmt="csv")


# -- keys and the replay against hand-computed figures ----------------------------------------


def trace(*reqs: tuple[int, list[int]], block: int = 4) -> Trace:
    return Trace("mooncake", block, [Request(float(i), n, 1, tuple(ids))
                                     for i, (n, ids) in enumerate(reqs)])


def test_chunk_keys_are_prefix_chains_at_chunk_granularity():
    a, b = Request(0, 16, 1, (1, 2, 3, 4)), Request(0, 16, 1, (1, 2, 9, 4))
    ka, left = chunk_keys(a, 4, 8)          # two blocks per chunk
    kb, _ = chunk_keys(b, 4, 8)
    assert len(ka) == 2 and left == 0
    assert ka[0] == kb[0] and ka[1] != kb[1]  # the same last id after another prefix differs
    halves, left = chunk_keys(Request(0, 10, 1, (1, 2, 3)), 4, 2)  # half a block per chunk
    assert len(halves) == 5 and left == 0 and len(set(halves)) == 5
    assert chunk_keys(Request(0, 7, 1, (1, 2)), 4, 4) == (chunk_keys(
        Request(0, 4, 1, (1,)), 4, 4)[0], 3)   # a partial last chunk is not an object


# r0: blocks 1,2 (8 tokens); r1: 1,2,3 (12); r2: 1,9 (7: one whole chunk, 3 left over)
HAND = trace((8, [1, 2]), (12, [1, 2, 3]), (7, [1, 9]))
TOKENS = 8 + 12 + 7


def pool(**kw) -> PoolModel:
    return PoolModel(**{"engines": 1, "bytes_per_token": 1, "chunk_tokens": 4, **kw})


def test_the_bound_is_what_one_infinite_cache_serves():
    r = replay(HAND, pool())
    # r1 finds blocks 1,2 (8 tokens); r2 finds block 1 (4 tokens); nothing else
    assert (r.bound_tokens, r.bound) == (12, 12 / TOKENS)
    assert (r.chunks, r.bound_chunks, r.block_bound) == (2 + 3 + 1, 3, 3 / 6)
    assert r.hit_ratio == 0 and r.computed_tokens == TOKENS  # no cache at all


def test_an_engine_cache_that_holds_everything_reaches_the_bound():
    r = replay(HAND, pool(engine_cache_bytes=1 << 20))
    assert r.served == {"engine": 12} and r.hit_ratio == r.bound


def test_round_robin_engines_lose_what_a_shared_tier_keeps():
    local = replay(HAND, pool(engines=2, engine_cache_bytes=1 << 20))
    # r0 -> engine 0, r1 -> engine 1 (misses), r2 -> engine 0 (block 1: 4 tokens)
    assert local.served == {"engine": 4}
    shared = replay(HAND, pool(engines=2, engine_cache_bytes=1 << 20,
                               tiers=(TierModel("shared", 1 << 20, shared=True),)))
    assert shared.served == {"engine": 4, "shared": 8} and shared.hit_ratio == shared.bound
    # writes: r0 computes blocks 1, 2; r1 loads them and computes block 3
    assert shared.reads == {"shared": 2} and shared.writes == {"shared": 3}
    # cache-aware routing sends r1 where its prefix is: engine 0 serves everything
    aware = replay(HAND, pool(engines=2, engine_cache_bytes=1 << 20, routing="cache_aware"))
    assert aware.served == {"engine": 12}


def test_a_small_tier_evicts_with_the_cpu_tiers_own_policy_and_promotes_loads():
    # one-object cpu tier per engine over an unbounded shared tier
    tiers = (TierModel("cpu", 4, shared=False), TierModel("shared", 1 << 20, shared=True))
    r = replay(HAND, pool(tiers=tiers))
    # r0 computes blocks 1, 2 and writes both to both tiers (the cpu tier keeps only 2).
    # r1: block 1 from the shared tier, block 2 from the cpu tier (each object from the first
    # tier holding it), block 3 computed; block 1 is promoted into the cpu tier (evicting 2),
    # then block 3 written to both (evicting 1). r2: block 1 from the shared tier, promoted.
    assert r.served == {"engine": 0, "cpu": 4, "shared": 8}
    assert r.reads == {"cpu": 1, "shared": 2}
    assert r.writes == {"cpu": 2 + 2 + 1, "shared": 2 + 1}


def test_granularity_must_divide():
    with pytest.raises(ValueError, match="must divide one another"):
        replay(HAND, pool(chunk_tokens=6))


# -- sizing -----------------------------------------------------------------------------------


def test_sweep_spec_knee_and_tiers_block():
    assert parse_sweep("cpu=8Gi..64Gi") == ("cpu", [8 << 30, 16 << 30, 32 << 30, 64 << 30])
    assert parse_sweep("shared=1Gi..3Gi") == ("shared", [1 << 30, 2 << 30, 3 << 30])
    assert parse_sweep("redis=1Gi..1Gi") == ("redis", [1 << 30])
    for bad in ("cpu", "gpu=1Gi..2Gi", "cpu=2Gi..1Gi", "cpu=0..1Gi"):
        with pytest.raises(ValueError, match="--sweep"):
            parse_sweep(bad)
    p = pool(tiers=(TierModel("cpu", 1, shared=False),))
    with pytest.raises(ValueError, match="the pool has no shared tier"):
        with_size(p, "shared", 5)
    assert with_size(p, "cpu", 5).tiers[0].size == 5
    assert with_size(p, "engine", 7).engine_cache_bytes == 7

    def res(hits: int) -> Result:
        return Result(prompt_tokens=100, served={"cpu": hits})

    assert knee([(1, res(10)), (2, res(30)), (4, res(39.5)), (8, res(40))]) == 4  # type: ignore[arg-type]
    block = tiers_block(pool(tiers=(TierModel("cpu", 8 << 30, False, "arc"),
                                    TierModel("shared", 64 << 30, True))), "redis")
    # a managed Redis's maxmemory is 85% of its memory: 64 GiB of objects need 76 GiB
    assert block == "tiers:\n  cpu: {size: 8Gi, evictionPolicy: arc}\n  redis:\n    managed: {memory: 76Gi}"
    s3 = tiers_block(pool(tiers=(TierModel("s3", 90 << 30, True),)))
    assert s3 == "tiers:\n  s3:\n    managed: {storage: 100Gi}"


def test_bytes_per_token_from_a_models_config():
    llama8b = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
               "hidden_size": 4096}
    assert bytes_per_token(llama8b) == 2 * 32 * 8 * 128 * 2 == 131072
    assert bytes_per_token(llama8b, "fp8") == 65536
    deepseek = {"num_hidden_layers": 27, "num_attention_heads": 16, "hidden_size": 2048,
                "kv_lora_rank": 512, "qk_rope_head_dim": 64}
    assert bytes_per_token(deepseek) == 27 * (512 + 64) * 2
    with pytest.raises(ValueError, match="lacks a usable 'num_hidden_layers'"):
        bytes_per_token({})
    with pytest.raises(ValueError, match="--kv-dtype 'int3'"):
        bytes_per_token(llama8b, "int3")


# -- the command ------------------------------------------------------------------------------


def plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpool_cli", "plan", *args],
                          capture_output=True, text=True, timeout=120)


def test_plan_on_a_public_trace_slice_with_a_sweep(tmp_path):
    out = tmp_path / "plan.json"
    p = plan(str(SLICE), "--engines", "2", "--cpu", "1Gi", "--shared", "256Gi",
             "--sweep", "cpu=1Gi..8Gi", "--json", str(out))
    assert p.returncode == 0, p.stderr
    for text in ("mooncake, 300 requests, 512-token blocks", "hit ratio = prompt tokens served "
                 "from any cache / prompt tokens", "sweep of the cpu tier", "<- knee",
                 "from shared tier", "tiers:\n  cpu: {size: ", "  redis:\n    managed: {memory: 302Gi}"):
        assert text in p.stdout, text
    data = json.loads(out.read_text())
    assert 0 < data["hit_ratio"] <= data["bound"] < 1
    assert [pt["size"] for pt in data["sweeps"][0]["points"]] == [1 << 30, 2 << 30, 4 << 30, 8 << 30]
    assert data["sweeps"][0]["knee"] in {pt["size"] for pt in data["sweeps"][0]["points"]}
    # a bigger cpu tier never serves less on this trace (LRU, same order of requests)
    ratios = [pt["hit_ratio"] for pt in data["sweeps"][0]["points"]]
    assert ratios == sorted(ratios)
    assert data["trace"]["requests"] == 300 and data["served_tokens"]["shared"] > 0


def test_the_recommended_tiers_block_is_a_valid_pool(tmp_path):
    p = plan(str(SLICE), "--cpu", "2Gi", "--shared", "64Gi", "--sweep", "cpu=1Gi..2Gi")
    assert p.returncode == 0, p.stderr
    block = p.stdout[p.stdout.index("tiers:\n"):].split("\n\n")[0]
    manifest = tmp_path / "pool.yaml"
    manifest.write_text("apiVersion: kvpool.dev/v1alpha1\nkind: KVCachePool\nmetadata:\n"
                        "  name: planned\nspec:\n  model:\n    name: m/m\n"
                        + "".join(f"  {ln}\n" for ln in block.splitlines()))
    v = subprocess.run([sys.executable, "-m", "kvpool_cli", "validate", str(manifest)],
                       capture_output=True, text=True, timeout=120)
    assert v.returncode == 0, v.stdout + v.stderr


@pytest.mark.parametrize("args, message", [
    (["--engines", "0"], "--engines must be >= 1, not 0"),
    (["--sweep", "shared=1Gi..2Gi"], "--sweep shared: the pool has no shared tier"),
    (["--cpu", "lots"], "invalid size 'lots'"),
    (["--chunk-tokens", "384"], "chunk_tokens 384 and the trace's 512-token blocks must divide"),
    (["--model", "/nonexistent/config.json"], "--model /nonexistent/config.json: No such file"),
    (["--model", str(SLICE.parent / "README.md")], "README.md: not a JSON config.json"),
    (["--cpu", "1Gi", "--sweep", "cpu=1Gi..2Gi", "--sweep", "cpu=1Gi..2Gi"], "each tier once"),
])
def test_bad_arguments_are_one_line(args, message):
    p = plan(str(SLICE), *args)
    assert p.returncode == 2 and message in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_a_malformed_trace_line_is_one_line_naming_it(tmp_path):
    bad = tmp_path / "t.jsonl"
    bad.write_text(SLICE.read_text().splitlines()[0] + "\n{\"timestamp\": 1}\n")
    p = plan(str(bad))
    assert p.returncode == 2 and p.stderr.strip() == (
        "kvpool plan: t.jsonl line 2: field 'input_length' must be an integer >= 1, not None")
    p = plan(str(tmp_path / "missing.jsonl"))
    assert p.returncode == 2 and "No such file or directory" in p.stderr


# -- -f POOL.yaml -----------------------------------------------------------------------------

POOL = """\
apiVersion: kvpool.dev/v1alpha1
kind: KVCachePool
metadata: {name: planned}
spec:
  replicas: 3
  chunkTokens: 512
  model: {name: m/m}
  router: {policy: cache_aware}
  tiers:
    cpu: {size: 2Gi, evictionPolicy: arc}
    disk:
      size: 8Gi
      volume:
        persistentVolumeClaim: {claimName: shared-kv}
    redis:
      managed: {memory: 20Gi}
"""


def test_a_pool_manifest_is_the_model(tmp_path):
    from kvpool_cli.plan_pool import read_pool

    f = tmp_path / "pool.yaml"
    f.write_text(POOL)
    planned = read_pool(str(f), bytes_per_token=1024)
    p = planned.pool
    assert (p.engines, p.routing, p.chunk_tokens, planned.name) == (3, "cache_aware", 512, "planned")
    assert p.tiers == (TierModel("cpu", 2 << 30, shared=False, eviction="arc"),
                       TierModel("disk", 8 << 30, shared=True),       # on a claim: shared
                       TierModel("redis", int(20 * 0.85 * (1 << 30)), shared=True))  # maxmemory
    assert planned.notes == ["disk on a claim: one tier every engine shares, evicting at its size"]
    local = read_pool(str(f), bytes_per_token=1024, engines=5,
                      routing="round_robin")
    assert (local.pool.engines, local.pool.routing) == (5, "round_robin")

    out = tmp_path / "p.json"
    r = plan(str(SLICE), "-f", str(f), "--sweep", "redis=1Gi..4Gi", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "pool: 3 engine(s), cache_aware" in r.stdout and "from disk tier" in r.stdout
    assert "note: disk on a claim" in r.stdout and "sweep of the redis tier" in r.stdout
    assert "  redis:\n    managed: {memory: " in r.stdout
    assert json.loads(out.read_text())["sweeps"][0]["tier"] == "redis"


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace("managed: {memory: 20Gi}", "external: {url: 'redis://r:6379/0'}"),
     "spec.tiers.redis.external: its capacity is not in the manifest; --shared SIZE gives it"),
    (lambda t: t.replace("chunkTokens: 512", "chunkTokens: 100"), "chunkTokens must be a multiple of 16"),
    (lambda t: t.replace("kind: KVCachePool", "kind: ConfigMap"), "no KVCachePool document"),
    (lambda t: t + "  bogus: [\n", "pool.yaml"),
])
def test_a_pool_the_planner_or_the_validator_refuses_is_one_line(tmp_path, edit, message):
    f = tmp_path / "pool.yaml"
    f.write_text(edit(POOL))
    r = plan(str(SLICE), "-f", str(f))
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert plan(str(SLICE), "-f", str(f), "--cpu", "1Gi").returncode == 2


# -- routing by session -----------------------------------------------------------------------


def bailian(chat: int, parent: int, ids: list[int], t: float) -> str:
    return line(chat_id=chat, parent_chat_id=parent, timestamp=t, input_length=16 * len(ids),
                output_length=1, type="text", turn=1, hash_ids=ids)


def test_sticky_routing_keeps_a_conversation_on_its_engine():
    # conversations A (chats 1 -> 2) and B (chats 3 -> 4), each turn resending the last
    t = parse_lines([bailian(1, -1, [1, 2], 0), bailian(2, 1, [1, 2, 3], 1),
                     bailian(3, -1, [7, 8], 2), bailian(4, 3, [7, 8, 9], 3)])
    assert [r.session for r in t.requests] == [1, 1, 3, 3]
    p = pool(engines=2, engine_cache_bytes=1 << 20, chunk_tokens=16)
    rr = replay(t, p)                                           # A2 and B2 land elsewhere
    sticky = replay(t, PoolModel(**{**p.__dict__, "routing": "consistent_hash"}))
    assert rr.served["engine"] == 0 and sticky.served["engine"] == 32 + 32 == sticky.bound_tokens
    with pytest.raises(ValueError, match="consistent_hash needs sessions"):
        replay(HAND, pool(routing="consistent_hash"))


def test_power_of_two_is_seeded_and_spreads_load():
    many = trace(*[(4, [i]) for i in range(400)])
    a = replay(many, pool(engines=4, engine_cache_bytes=1 << 20, routing="power_of_two"))
    b = replay(many, pool(engines=4, engine_cache_bytes=1 << 20, routing="power_of_two"))
    assert a == b
    from kvpool_connector.plan.sim import Fleet

    fleet = Fleet(pool(engines=4, routing="power_of_two"))
    for _ in range(400):
        fleet.assigned[fleet.route([])] += 1
    assert max(fleet.assigned) - min(fleet.assigned) <= 10   # two choices balance closely


def test_the_sweep_is_drawn(tmp_path):
    png = tmp_path / "plan.png"
    r = plan(str(SLICE), "--engines", "2", "--cpu", "1Gi", "--shared", "8Gi",
             "--sweep", "shared=8Gi..64Gi", "--png", str(png))
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    r = plan(str(SLICE), "--png", str(png))
    assert r.returncode == 2 and "--png draws a sweep's curve" in r.stderr


def test_a_hybrid_models_windows_keep_their_last_blocks_per_chunk():
    from kvpool_cli.plan import KVShape, kv_shape

    # Gemma-3-shaped: 1 layer in 6 full attention, a 1024-token window
    gemma = {"num_hidden_layers": 12, "num_attention_heads": 8, "num_key_value_heads": 4,
             "head_dim": 256, "hidden_size": 2048, "sliding_window": 1024,
             "sliding_window_pattern": 6}
    per_layer = 2 * 4 * 256 * 2
    assert kv_shape(gemma) == KVShape(2 * per_layer, 10 * per_layer, 1024)
    typed = {**gemma, "sliding_window_pattern": None,
             "layer_types": ["sliding_attention", "full_attention"] * 6}
    assert kv_shape(typed) == KVShape(6 * per_layer, 6 * per_layer, 1024)
    assert bytes_per_token(gemma) == 12 * per_layer   # before the windows
    # a 256-token chunk: all of it for full layers; a 1024 window needs every block of it
    p = pool(bytes_per_token=2, window_bytes_per_token=10, window_tokens=1024, chunk_tokens=256)
    assert p.object_bytes() == 256 * 2 + 256 * 10
    # a 100-token window keeps cdiv(99, 16) = 7 blocks of each chunk
    p = pool(bytes_per_token=2, window_bytes_per_token=10, window_tokens=100, chunk_tokens=256)
    assert p.object_bytes() == 256 * 2 + 7 * 16 * 10
    assert pool(bytes_per_token=2, chunk_tokens=256).object_bytes() == 512  # dense: unchanged


def test_plan_with_a_hybrid_models_config(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 4, "num_attention_heads": 2,
                               "num_key_value_heads": 2, "head_dim": 32, "hidden_size": 64,
                               "sliding_window": 64,
                               "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}))
    r = plan(str(SLICE), "--model", str(cfg), "--cpu", "1Gi")
    assert r.returncode == 0, r.stderr
    # full layer: 256 x 256 B; 3 window layers: cdiv(63, 16) = 4 blocks = 64 tokens x 768 B
    assert "(112Ki objects; sliding-window layers, 768 B/token, keep their 64-token window's" in r.stdout


def test_vllms_own_cache_from_blocks_gpu_memory_or_a_cpu_pool(tmp_path):
    from kvpool_cli.plan import KVShape, engine_cache, weights_bytes

    shape = KVShape(1000, 24, 64)
    assert engine_cache(5 << 30, shape, num_gpu_blocks=9)[0] == 5 << 30   # given wins
    assert engine_cache(0, shape, num_gpu_blocks=10, block_size=16) == (
        10 * 16 * 1024, "--num-gpu-blocks 10 of 16 tokens")
    cache, how = engine_cache(0, shape, gpu_memory=80 << 30, utilization=0.9, gpus=2,
                              weights=16 << 30)
    assert cache == int(2 * (80 << 30) * 0.9) - (16 << 30) and "upper bound" in how
    with pytest.raises(ValueError, match="leaves nothing for the KV cache after 16Gi"):
        engine_cache(0, shape, gpu_memory=8 << 30, weights=16 << 30)
    assert engine_cache(0, shape, manifest=4 << 30)[0] == 4 << 30
    assert engine_cache(0, shape) == (0, "none modelled (--engine-cache, --num-gpu-blocks or "
                                         "--gpu-memory)")
    (tmp_path / "model-00001.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "config.json").write_text("{}")
    assert weights_bytes(tmp_path) == 1000 and weights_bytes(tmp_path / "config.json") == 0


def test_a_cpu_pools_manifest_gives_vllms_cache(tmp_path):
    f = tmp_path / "pool.yaml"
    f.write_text(POOL.replace("  model: {name: m/m}",
                              "  model: {name: m/m, gpus: 0, cpuKvCacheGiB: 6}"))
    r = plan(str(SLICE), "-f", str(f))
    assert r.returncode == 0, r.stderr
    assert "note: vLLM's own cache: 6Gi per engine, the manifest's cpuKvCacheGiB" in r.stdout
    r = plan(str(SLICE), "--num-gpu-blocks", "1000", "--bytes-per-token", "1024")
    assert "note: vLLM's own cache: 15.6Mi per engine, --num-gpu-blocks 1000 of 16" in r.stdout


def test_several_tiers_swept_each_with_the_others_as_given(tmp_path):
    out, png = tmp_path / "p.json", tmp_path / "p.png"
    r = plan(str(SLICE), "--engines", "2", "--cpu", "1Gi", "--shared", "8Gi",
             "--sweep", "cpu=1Gi..4Gi", "--sweep", "shared=8Gi..32Gi", "--json", str(out),
             "--png", str(png))
    assert r.returncode == 0, r.stderr
    assert "sweep of the cpu tier" in r.stdout and "sweep of the shared tier" in r.stdout
    data = json.loads(out.read_text())
    cpu, shared = data["sweeps"]
    assert [pt["size"] for pt in cpu["points"]] == [1 << 30, 2 << 30, 4 << 30]
    assert [pt["size"] for pt in shared["points"]] == [8 << 30, 16 << 30, 32 << 30]
    # the summary is the set of knees, replayed: both tiers at their knee in the block
    assert f"cpu: {{size: {cpu['knee'] >> 30}Gi" in r.stdout
    assert "(2,100 requests replayed" in r.stdout   # 300 x (3 + 3 sizes + the set of knees)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = plan(str(SLICE), "--cpu", "1Gi", "--sweep", "cpu=1Gi..2Gi", "--sweep", "cpu=4Gi..8Gi")
    assert r.returncode == 2 and "--sweep: each tier once (cpu, cpu)" in r.stderr


def test_recommended_sizes_are_exact_and_never_rounded_down():
    from kvpool_cli.plan_pool import managed_memory
    from kvpool_connector.config import format_size as exact

    assert exact(4 << 40) == "4Ti" and exact(4819 << 30) == "4819Gi" and exact(1536) == "1536"
    assert exact(1 << 20) == "1Mi"
    # 4 TiB of objects need 4819 GiB of managed Redis memory (maxmemory 85%), not "4.7Ti"
    assert managed_memory(4 << 40) == 4819 << 30
    block = tiers_block(pool(tiers=(TierModel("shared", 4 << 40, True),)), "redis")
    assert block == "tiers:\n  redis:\n    managed: {memory: 4819Gi}"


def test_tail_objects_serve_a_repeated_prompts_blocks_past_its_last_chunk():
    # 10 tokens in 4-token chunks: 2 chunks, then 2 tokens = one whole 2-token vLLM block
    twice = trace((10, [1, 2, 3]), (10, [1, 2, 3]), (10, [1, 2, 4]))
    p = pool(engines=2, block_tokens=2, tiers=(TierModel("shared", 1 << 20, shared=True),))
    r = replay(twice, p)
    # the repeat loads both chunks and the tail; the third request only the chunks (its
    # tail's ids differ)
    assert r.served == {"engine": 0, "shared": 8 + 2 + 8} and r.bound_tokens == 18
    assert r.hit_ratio == r.bound
    off = replay(twice, PoolModel(**{**p.__dict__, "tails": False}))
    assert off.served == {"engine": 0, "shared": 16} and off.bound_tokens == 16
    from kvpool_connector.plan.sim import tail_object

    assert tail_object(twice.requests[0], 4, 4, 2, 2) == tail_object(twice.requests[1], 4, 4, 2, 2)
    assert tail_object(twice.requests[0], 4, 4, 2, 4) is None   # no whole 4-token block left
