"""`kvpool demo --quick` through the module entry point `make demo` uses: two real vLLM
OpenAI-compatible servers, the openai client, kvpool cpu + disk tiers, a PNG chart."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.e2e.conftest import dev_tool_env


@pytest.mark.vllm
@pytest.mark.slow
def test_demo_quick(repo_root, tiny_model, tmp_path):
    png, report = tmp_path / "demo.png", tmp_path / "demo.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvpool_cli", "demo", "--quick",
         "--out", str(png), "--json", str(report)],
        cwd=repo_root, capture_output=True, text=True, env=dev_tool_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]

    out = proc.stdout
    for line in ("TTFT p50", "TTFT p95", "TTFT p50, turn 1", "nothing cached yet", "throughput",
                 "kvpool (external)", "kvpool cpu tier", "kvpool disk tier", f"chart: {png}",
                 "took turns round by round", "tiny model (2 layers, hidden 128)"):
        assert line in out, line
    assert "turn 3/3 with kvpool" in proc.stderr  # the progress bar names round and arm
    assert "engine dtype:" in proc.stderr and "prefill tokens/s" in proc.stderr

    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000

    data = json.loads(report.read_text())
    assert data["tiers"] == ["cpu", "disk"]
    s = data["settings"]
    n = s["conversations"] * s["turns"]
    for run in ("without", "with"):
        r = data[run]
        assert r["requests"] == n
        assert 0 < r["ttft_p50_s"] <= r["ttft_p95_s"]
        assert r["requests_per_s"] > 0 and r["output_tokens_per_s"] > 0
        assert len(r["ttft_by_turn_s"]) == s["turns"]
    # The engine's own KV cache is too small for every conversation: without kvpool later
    # turns recompute their history; with kvpool it comes back from the pool's cpu tier.
    without, with_ = data["without"], data["with"]
    assert without["metrics"]["external_hit_rate"] is None
    assert with_["metrics"]["external_hit_rate"] > 0.3
    assert with_["cached_token_share"] > without["cached_token_share"]
    # every configured tier serves something: the cpu tier holds about 1.5 conversations,
    # the disk tier the rest
    assert with_["metrics"]["tiers"]["cpu"]["hit_chunks"] > 0
    assert with_["metrics"]["tiers"]["disk"]["hit_chunks"] > 0
    assert data["dtype"] in ("float32", "bfloat16") and data["dtype"] in data["machine"]
    # the server's /metrics: tokens from kvpool, split by vLLM's hit sources, and the
    # connector's own counters
    m = with_["metrics"]
    assert m["external_hit_tokens"] > 0 and with_["cached_tokens"] > 0
    assert m["cached_tokens_by_source"].get("host", 0) > 0  # vLLM's split: the cpu tier
    c = m["connector"]
    assert c["saved_chunks"] > 0 and c["loaded_chunks"] > 0 and c["lookups"] >= n
    assert c["load_error_chunks"] == 0


# -- the pure parts (no engine) --------------------------------------------------------------

METRICS_TEXT = """\
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="local"} 1000.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="local"} 250.0
# TYPE vllm:external_prefix_cache_queries counter
vllm:external_prefix_cache_queries_total{engine="0",model_name="local"} 750.0
# TYPE vllm:external_prefix_cache_hits counter
vllm:external_prefix_cache_hits_total{engine="0",model_name="local"} 600.0
# TYPE vllm:prompt_tokens_cached_by_source counter
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="local",source="host"} 512.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="local",source="disk"} 88.0
# TYPE kvpool_loaded_chunks counter
kvpool_loaded_chunks_total{engine="0",model_name="local"} 10.0
# TYPE kvpool_tier_hit_chunks counter
kvpool_tier_hit_chunks_total{engine="0",model_name="local",tier="cpu"} 9.0
kvpool_tier_hit_chunks_total{engine="0",model_name="local",tier="disk"} 1.0
# TYPE kvpool_tier_miss_chunks counter
kvpool_tier_miss_chunks_total{engine="0",model_name="local",tier="cpu"} 1.0
"""


def test_parse_metrics_hit_rates_per_tier():
    from kvpool_dev.demo import parse_metrics

    m = parse_metrics(METRICS_TEXT)
    assert m["local_hit_rate"] == 0.25 and m["external_hit_rate"] == 0.8
    assert m["tiers"]["cpu"] == {"hit_chunks": 9.0, "miss_chunks": 1.0, "hit_rate": 0.9}
    assert m["tiers"]["disk"]["hit_rate"] == 1.0
    assert m["external_hit_tokens"] == 600.0
    assert m["cached_tokens_by_source"] == {"host": 512.0, "disk": 88.0}
    assert m["connector"] == {"saved_chunks": 0.0, "loaded_chunks": 10.0,
                              "load_error_chunks": 0.0, "lookups": 0.0}
    assert parse_metrics("")["external_hit_rate"] is None


def test_percentile_and_workload_are_deterministic():
    from kvpool_dev.demo import Settings, build_workload, percentile

    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5 and percentile([1.0], 95) == 1.0
    s = Settings.quick()
    count = lambda text: len(text.split())  # noqa: E731
    a, b = build_workload(s, count), build_workload(s, count)
    assert a == b and len(a) == s.conversations
    assert all(len(c["questions"]) == s.turns for c in a)
    assert all(count(c["system"]) >= s.doc_tokens for c in a)
    assert len({c["system"] for c in a}) == s.conversations  # every user has its own document


def test_redis_url_password_moves_to_the_environment():
    from kvpool_dev.demo import REDIS_PASSWORD_ENV, redis_from_env

    tier, env = redis_from_env("redis://:s3cret@cache.local:6380/2")
    assert tier == {"type": "redis", "url": "redis://cache.local:6380/2",
                    "password_env": REDIS_PASSWORD_ENV}
    assert env == {REDIS_PASSWORD_ENV: "s3cret"}
    assert redis_from_env(None) is None


def test_the_workload_shrinks_only_on_a_slow_machine():
    from kvpool_dev.demo import (
        MIN_CONVERSATIONS,
        MIN_TURNS,
        Settings,
        estimate_seconds,
        fit_workload,
    )

    s = Settings()
    fast = fit_workload(s, prefill_tps=5000, decode_s=0.005, budget_s=200)
    assert fast == s
    est = estimate_seconds(s, 500, 0.02)
    assert est["with"] < est["without"]  # kvpool's turns after the first compute less
    slow = fit_workload(s, prefill_tps=500, decode_s=0.02, budget_s=120)
    assert (MIN_CONVERSATIONS, MIN_TURNS) <= (slow.conversations, slow.turns) < (8, 4)
    assert sum(estimate_seconds(slow, 500, 0.02).values()) <= 120
    hopeless = fit_workload(s, prefill_tps=5, decode_s=1, budget_s=10)
    assert (hopeless.conversations, hopeless.turns) == (MIN_CONVERSATIONS, MIN_TURNS)


def test_rounds_alternate_arms_and_direction():
    from kvpool_dev.demo import arm_order, visit_order

    assert [arm_order(k) for k in range(4)] == [(0, 1), (1, 0), (0, 1), (1, 0)]
    assert visit_order(4, 0) == [0, 1, 2, 3] and visit_order(4, 1) == [3, 2, 1, 0]


def test_cpu_tier_is_sized_below_the_working_set():
    from kvpool_dev.demo import Settings, cpu_tier_bytes
    from kvpool_dev.testbed.localmodel import kv_bytes_per_token

    bench = {"num_attention_heads": 16, "hidden_size": 1024, "num_key_value_heads": 4,
             "num_hidden_layers": 8}
    assert kv_bytes_per_token(bench, "float32") == 2 * 8 * 4 * 64 * 4
    assert kv_bytes_per_token(bench, "bfloat16") == 2 * 8 * 4 * 64 * 2
    s = Settings()
    per_conversation = -(-s.conversation_tokens() // 256) * 256 * 16384
    size = cpu_tier_bytes(s, 16384)
    assert 3 * per_conversation < size < 4 * per_conversation < s.conversations * per_conversation
