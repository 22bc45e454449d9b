"""`kvpool bench fleet --quick`: two real engines with kvpool (cpu tier + a shared Redis)
behind the real vllm-router binary, once per policy. Asserts the report's fields and what
the policies must do by construction (who gets which request), never timings."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvpool_dev.bench import fleet_bench
from kvpool_dev.testbed.router import router_args
from tests.e2e.conftest import dev_tool_env

METRICS = """\
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{engine="0",model_name="local"} 1000.0
# TYPE vllm:prompt_tokens_cached_by_source counter
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="local",source="host"} 512.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="local",source="device"} 128.0
# TYPE kvpool_tier_hit_chunks counter
kvpool_tier_hit_chunks_total{engine="0",tier="cpu"} 2.0
# TYPE kvpool_tier_miss_chunks counter
kvpool_tier_miss_chunks_total{engine="0",tier="cpu"} 2.0
kvpool_tier_miss_chunks_total{engine="0",tier="redis"} 1.0
"""


@pytest.mark.vllm
@pytest.mark.slow
def test_bench_fleet_quick(repo_root, tiny_model, tmp_path):
    report_path = tmp_path / "fleet.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvpool_cli", "bench", "fleet", "--quick",
         "--json", str(report_path)], cwd=repo_root, capture_output=True, text=True, env=dev_tool_env(), timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for line in ("TTFT p50", "TTFT p95", "throughput", "kvpool cpu", "kvpool redis",
                 "vLLM prefix cache", "cpu tokens vs rr", "goals:"):
        assert line in proc.stdout, line
    report = json.loads(report_path.read_text())
    s = report["settings"]
    n = s["conversations"] * s["turns"]
    assert list(report["runs"]) == list(fleet_bench.POLICIES)
    for name, r in report["runs"].items():
        assert r["requests"] == n and 0 < r["ttft_p50_s"] <= r["ttft_p95_s"], name
        assert r["requests_per_s"] > 0 and r["output_tokens_per_s"] > 0
        assert r["prompt_tokens"] > 0
        assert set(r["tokens_by_source"]) == {"device", "host", "external_unspecified", "computed"}
        assert sum(r["tokens_by_source"].values()) == pytest.approx(r["prompt_tokens"])
        routed = r["requests_per_engine"]  # engines the router never chose are absent
        assert 1 <= len(routed) <= s["engines"] and sum(routed.values()) == n, routed
    # cache_aware really matched token prefixes (the engines render chats for it)
    decisions = report["runs"]["cache_aware"]["router_decisions"]
    assert decisions.get("prefix_hit", 0) > 0 and not decisions.get("missing_tokens"), decisions
    # round robin alternates: every engine gets the same share
    rr = report["runs"]["round_robin"]["requests_per_engine"]
    assert len(rr) == s["engines"] and len(set(rr.values())) == 1, rr
    # with the quick run's fixed order, round robin moves conversations 1 and 3 to the other
    # engine for their second turn: their history comes from the shared Redis
    order = [fleet_bench.turn_order(s["conversations"], k) for k in range(2)]
    assert [c for c in range(4) if order[0].index(c) % 2 != order[1].index(c) % 2] == [1, 3]
    assert report["runs"]["round_robin"]["tokens_by_source"]["external_unspecified"] > 0
    ratios = report["comparison"]["ratios"]
    assert set(ratios) == {"cache_aware", "consistent_hash"}
    assert {g["goal"].split(":")[0] for g in report["comparison"]["goals"]} == set(ratios)


def test_counters_sum_engines_and_sources():
    c = fleet_bench.counters(METRICS)
    assert c == {"prompt_tokens": 1000.0, "cached:host": 512.0, "cached:device": 128.0,
                 "hit:cpu": 2.0, "miss:cpu": 2.0, "miss:redis": 1.0}
    assert fleet_bench.delta({"a": 5.0, "b": 1.0}, {"a": 2.0}) == {"a": 3.0, "b": 1.0}


def test_summary_and_comparison_against_round_robin():
    turns = [{"ttft_s": t, "completion_tokens": 10, "turn": i % 2}
             for i, t in enumerate((0.1, 0.2, 0.3, 0.4))]
    engines = fleet_bench.counters(METRICS)
    rr = fleet_bench.summarize("round_robin", turns, 2.0, engines, {"routed:a": 2, "routed:b": 2})
    assert rr["tokens_by_source"] == {"device": 128.0, "host": 512.0,
                                      "external_unspecified": 0.0, "computed": 360.0}
    assert rr["chunk_hit_rate_by_tier"] == {"cpu": 0.5, "redis": 0.0}
    assert rr["requests_per_s"] == 2.0 and rr["output_tokens_per_s"] == 20.0
    assert rr["ttft_p50_by_turn_s"] == [pytest.approx(0.2), pytest.approx(0.3)]
    fast = dict(rr, policy="cache_aware", ttft_p50_s=rr["ttft_p50_s"] / 2,
                tokens_by_source={**rr["tokens_by_source"], "host": 1024.0})
    cmp_ = fleet_bench.compare({"round_robin": rr, "cache_aware": fast})
    assert cmp_["ratios"]["cache_aware"]["cpu_tokens_x"] == 2.0
    assert cmp_["ratios"]["cache_aware"]["ttft_p50_x"] == pytest.approx(2.0)
    assert [g["met"] for g in cmp_["goals"]] == [True, True]
    text = fleet_bench.render({"settings": {**vars(fleet_bench.Settings())}, "shared": "redis",
                               "router_version": "0", "runs": {"round_robin": rr, "cache_aware": fast},
                               "comparison": cmp_})
    assert "cpu tokens vs rr" in text and "2.00x" in text and "[met ]" in text


def test_passes_of_a_policy_merge_into_one_run():
    a = ([{"ttft_s": 1.0}], 2.0, {"cached:host": 10.0}, {"routed:a": 1.0})
    b = ([{"ttft_s": 3.0}], 4.0, {"cached:host": 5.0, "prompt_tokens": 1.0}, {"routed:b": 1.0})
    assert fleet_bench.merge([a, b]) == ([{"ttft_s": 1.0}, {"ttft_s": 3.0}], 6.0,
                                         {"cached:host": 15.0, "prompt_tokens": 1.0},
                                         {"routed:a": 1.0, "routed:b": 1.0})


def test_turn_order_is_a_seeded_shuffle_shared_by_every_policy():
    a = fleet_bench.turn_order(9, 2, seed=0)
    assert sorted(a) == list(range(9)) and a == fleet_bench.turn_order(9, 2, seed=0)
    assert a != fleet_bench.turn_order(9, 3, seed=0)


def test_router_args_refuse_an_unknown_policy():
    args = router_args(["http://a:1", "http://b:2"], "consistent_hash", 3000, 29000)
    assert args[args.index("--policy") + 1] == "consistent_hash"
    assert args[args.index("--worker-urls") + 1:args.index("--policy")] == ["http://a:1", "http://b:2"]
    with pytest.raises(ValueError, match="policy"):
        router_args(["http://a:1"], "sideways", 3000, 29000)
