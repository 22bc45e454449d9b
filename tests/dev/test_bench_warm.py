"""`kvpool bench warm`'s pure parts: the workload every arm shares, the arms' configs, the
figures read from a server's Prometheus text, and the verdict on issue 26's goals."""

from __future__ import annotations

import pytest

from kvpool_dev.bench.warm_bench import (
    QUICK,
    Workload,
    arm_figures,
    parse_metrics,
    prompts,
    render,
    transfer_config,
    verdict,
)

METRICS = """\
# TYPE kvpool_hit_objects counter
kvpool_hit_objects_total{engine="0",kind="prompt",model_name="local",tier="cpu"} %(cpu)s
kvpool_hit_objects_total{engine="0",kind="prompt",model_name="local",tier="redis"} %(redis)s
# TYPE kvpool_prewarm_bytes counter
kvpool_prewarm_bytes_total{engine="0",model_name="local"} 1048576.0
# TYPE kvpool_prewarm_objects counter
kvpool_prewarm_objects_total{engine="0",model_name="local"} 1.0
# TYPE kvpool_prewarm_seconds counter
kvpool_prewarm_seconds_total{engine="0",model_name="local"} 0.5
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="local"} %(local)s
# TYPE vllm:external_prefix_cache_hits counter
vllm:external_prefix_cache_hits_total{engine="0",model_name="local"} %(external)s
"""


def metrics(cpu=0, redis=0, local=0, external=0):
    return parse_metrics(METRICS % {"cpu": cpu, "redis": redis, "local": local,
                                    "external": external})


def test_every_arm_asks_the_same_prefixes_with_suffixes_of_its_own():
    w = Workload(prefixes=3, prefix_len=256, suffix_len=8)
    a, b = prompts(w, 6, suffix_seed=1), prompts(w, 6, suffix_seed=2)
    assert [p[:256] for p in a] == [p[:256] for p in b]
    assert a[0][:256] == a[3][:256] != a[1][:256]
    assert all(x[256:] != y[256:] for x, y in zip(a, b, strict=True))
    assert all(len(p) == 264 for p in a)


def test_arms_configs():
    w = QUICK
    assert transfer_config("plain", w, "ns", "redis://r") is None
    warm = transfer_config("warm", w, "ns", "redis://r")["kv_connector_extra_config"]
    cold = transfer_config("cold-shared", w, "ns", "redis://r")["kv_connector_extra_config"]
    assert [t["type"] for t in warm["tiers"]] == ["cpu", "redis"] == [t["type"] for t in cold["tiers"]]
    assert warm["warm_start"]["enabled"] and not cold["warm_start"]["enabled"]
    assert transfer_config("a", w, "ns", "redis://r")["kv_connector_extra_config"]["warm_start"]["enabled"]
    with pytest.raises(ValueError, match="--arms: unknown arm 'hot'"):
        transfer_config("hot", w, "ns", "redis://r")


def test_figures_and_verdict():
    w = Workload(b_requests=2, suffix_len=64, max_seconds=30)
    warm = arm_figures(metrics(), metrics(cpu=8, local=0, external=2048), [0.1, 0.3],
                       prompt_tokens=2 * (1024 + 64), start_s=20)
    assert warm["cpu_hit_share"] == 1.0 and warm["tokens_computed"] == 128
    assert warm["ttft_p50_ms"] == pytest.approx(200) and warm["prewarm_bytes"] == 1 << 20
    plain = arm_figures(metrics(), metrics(), [0.9, 0.9], prompt_tokens=2 * 1088, start_s=15)
    assert plain["cpu_hit_share"] is None and plain["tokens_computed"] == 2176
    shared = arm_figures(metrics(), metrics(cpu=1, redis=7, external=2048), [0.4, 0.4], 2176, 15)
    assert shared["cpu_hit_share"] == 1 / 8
    v = verdict({"warm": warm, "cold-shared": shared, "plain": plain}, w)
    assert v == {"cpu_share_at_least_90pct": True, "no_prefix_token_computed": True,
                 "warm_up_within_budget": True, "ttft_p50_3x_below_plain": True}
    assert not verdict({"warm": {**warm, "prewarm_objects": 0, "prewarm_seconds": 0.0},
                        "cold-shared": shared, "plain": plain}, w)["warm_up_within_budget"]
    slow = {**warm, "ttft_p50_ms": 400.0, "tokens_computed": 129}
    v = verdict({"warm": slow, "plain": plain}, w)
    assert not v["ttft_p50_3x_below_plain"] and not v["no_prefix_token_computed"]
    assert verdict({"warm": warm}, w)["ttft_p50_3x_below_plain"] is None
    text = render({"cpu": "EPYC", "dtype": "bfloat16", "model": "tiny", "workload": w.__dict__,
                   "arms": {"warm": warm, "plain": plain}, "verdict": v, "errors": {}})
    assert "plain / warm = 4.50x" in text and "ttft_p50_3x_below_plain: n/a" not in text
