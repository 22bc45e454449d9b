"""Smoke test of `kvpool bench e2e --quick --json`: real engines, numbers present and sane.

No timing thresholds: the benchmark prints ratios; this only checks that every measurement
exists, hits cover the prompt and outputs are logprob-close to the baseline.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest


def bench_report(repo_root, *args: str, timeout: float) -> dict:
    """`kvpool bench e2e --json ARGS` in a subprocess; fails with its log tail on an error."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvpool_cli", "bench", "e2e", "--json", *args],
        cwd=repo_root, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


@pytest.mark.vllm
@pytest.mark.slow
def test_bench_e2e_quick_json(repo_root, tiny_model):
    """The smoke run: kvpool's seed engine (cold pass, then a cpu-tier hit), a fresh engine
    hitting the disk tier, and vLLM's OffloadingConnector with kvpool's spec (cold, then a
    host-tier hit)."""
    from kvpool_dev.bench.e2e_bench import GOAL_SCHED_SHARE, evaluate_goals

    report = bench_report(repo_root, "--quick", timeout=600)

    assert [e["name"] for e in report["engines"]] == ["kvpool-seed", "kvpool-disk",
                                                      "native-seed"]
    assert report["errors"] == {} and report["host_bytes"] == 256 << 20
    summary = report["summary"]
    assert summary["baseline"] == "kvpool-cold"
    assert [r["tokens"] for r in summary["rows"]] == report["sizes"] == [512, 2048]
    for row in summary["rows"]:
        n = row["tokens"]
        assert set(row["configs"]) == {"kvpool-cold", "cpu", "disk", "native-cold",
                                       "native-cpu"}
        for name, entry in row["configs"].items():
            assert 0 < entry["ttft_s"] < 120 and math.isfinite(entry["x_recompute"]), name
            assert entry["outputs_close"] is True, name
            if name.endswith("cold"):
                assert entry["num_cached_tokens"] == 0, name
            elif name.startswith("native"):
                # every whole 256-token chunk came back
                assert entry["num_cached_tokens"] >= n // 256 * 256 > 0, name
            else:
                # a hit covers every whole vLLM block but the one holding the last token
                assert n - 256 < entry["num_cached_tokens"] < n, name

    for name in ("kvpool-seed", "kvpool-disk", "native-seed"):
        sched = report["scheduler"][name]
        assert sched["steps"] > 0 and sched["us_per_step"] > 0 and 0 < sched["share"] < 1, name
    # the goals follow from the report's own numbers; a quick run has no recompute baseline
    # and no ExampleConnector, so the scheduler-side cost is the one goal it can judge
    assert report["goals"] == evaluate_goals(summary, report["scheduler"])
    [judged] = [g for g in report["goals"] if g["met"] is not None]
    assert judged["goal"].startswith("kvpool scheduler-side cost")
    assert judged["value"] == max(report["scheduler"][name]["share"]
                                  for name in ("kvpool-seed", "kvpool-disk"))
    assert judged["met"] is (judged["value"] < GOAL_SCHED_SHARE)


# -- the pure parts (no engine) --------------------------------------------------------------


def test_plan_starts_one_engine_per_fresh_tier():
    from kvpool_dev.bench.e2e_bench import ALL_CONFIGS, plan

    full = plan(list(ALL_CONFIGS))
    assert [e.name for e in full] == ["recompute", "kvpool-seed", "kvpool-disk", "kvpool-redis",
                                      "kvpool-s3", "native-seed", "native-redis", "example"]
    seed = full[1]
    assert seed.tiers == ["cpu", "disk", "redis", "s3"] and seed.passes == ["kvpool-cold", "cpu"]
    assert [e.tiers for e in full[2:5]] == [["disk"], ["redis"], ["s3"]]
    assert plan(["redis"])[0].passes == ["kvpool-cold"]   # no cpu tier: no same-process hit
    with pytest.raises(ValueError, match="--configs"):
        plan(["cpu", "nvme"])


def test_plan_native_rows_seed_redis_through_the_kvpool_tier():
    from kvpool_dev.bench.e2e_bench import backend_tiers, plan

    both = plan(["native-cpu", "native-redis"])
    assert [(e.name, e.kind, e.passes, e.tiers) for e in both] == [
        ("native-seed", "native", ["native-cold", "native-cpu"], ["redis"]),
        ("native-redis", "native", ["native-redis"], ["redis"])]
    assert both[0].seeds_lower_tiers and not plan(["native-cpu"])[0].seeds_lower_tiers
    assert plan(["native-cpu"])[0].tiers == []
    assert backend_tiers(["native-redis", "disk"]) == {"redis", "disk"}
    assert backend_tiers(["native-cpu", "cpu"]) == {"cpu"}


def test_native_engines_get_kvpools_spec_and_tier(tmp_path):
    from kvpool_dev.bench import kv_configs
    from kvpool_dev.bench.e2e_bench import Backends, EngineSpec, transfer_config

    backends = Backends({"redis"}, tmp_path)  # a real redis-server: its URL goes in the tier
    try:
        cfg = transfer_config(EngineSpec("native-redis", "native", ["native-redis"], ["redis"]),
                              backends)
        seed = transfer_config(EngineSpec("native-seed", "native", ["native-cold"], []),
                               backends)
    finally:
        backends.close()
    extra = cfg["kv_connector_extra_config"]
    assert cfg["kv_connector"] == "TimedOffloadingConnector"
    assert cfg["kv_connector_module_path"] == kv_configs.TIMED_MODULE
    assert {k: extra[k] for k in ("spec_name", "spec_module_path", "block_size")} == {
        "spec_name": "KVPoolOffloadingSpec", "spec_module_path": "kvpool_connector.native",
        "block_size": 256}
    [tier] = extra["secondary_tiers"]
    assert tier["type"] == "kvpool" and tier["module_path"] == "kvpool_connector.vllm_tiers"
    assert tier["namespace"] == backends.namespace
    assert tier["security"] == {"key_env": kv_configs.POOL_KEY_ENV}
    assert tier["tiers"] == [backends.tier("redis")]
    assert "secondary_tiers" not in seed["kv_connector_extra_config"]


def _m(config, tokens, ttft, tokens_out=(1, 2)):
    from kvpool_dev.bench.e2e_bench import Measurement

    top = [[[t, -0.1], [t + 100, -2.0]] for t in tokens_out]  # each token first, one runner-up
    return Measurement(config, tokens, ttft, 0 if config == "recompute" else tokens - 128,
                       list(tokens_out), config, logprobs=top)


def test_summary_ratios_goals_and_table():
    from kvpool_dev.bench.e2e_bench import evaluate_goals, render, summarize

    results = [_m("recompute", 8192, 10.0), _m("cpu", 8192, 0.4), _m("disk", 8192, 2.0),
               _m("example", 8192, 4.0), _m("redis", 8192, 0.5, tokens_out=(9, 9))]
    summary = summarize(results, [8192])
    row = summary["rows"][0]["configs"]
    assert summary["baseline"] == "recompute"
    assert row["cpu"]["x_recompute"] == pytest.approx(0.04)
    assert row["cpu"]["speedup_vs_example"] == pytest.approx(10.0)
    assert row["redis"]["outputs_close"] is False and row["disk"]["outputs_close"] is True
    # a swap at a near tie (each token in the other's top-k) is close, not a mismatch
    tie = _m("example", 8192, 4.0, tokens_out=(101, 5))
    tie.logprobs[0] = [[101, -0.1], [1, -0.11]]
    assert summarize([results[0], tie], [8192])["rows"][0]["configs"]["example"]["outputs_close"]
    sched = {"kvpool-seed": {"steps": 10, "us_per_step": 50.0, "share": 0.002}}
    goals = {g["goal"].split()[0] + (" ex" if "Example" in g["goal"] else ""): g["met"]
             for g in evaluate_goals(summary, sched)}
    assert goals["cpu"] is True and goals["disk"] is False and goals["redis"] is True
    assert goals["cpu ex"] is True and goals["disk ex"] is False and goals["s3 ex"] is None
    assert goals["kvpool"] is True
    report = {"model": "m", "summary": summary, "scheduler": sched,
              "goals": evaluate_goals(summary, sched)}
    text = render(report)
    assert "0.400s (0.040x)" in text and "NO: redis@8192" in text and "50.0 us/step" in text
