"""Smoke test of `kvpool bench serve --quick`: real OpenAI servers driven by vLLM's own
bench serve client; every arm completes every request (prefix_repetition sends
num_prompts // num_prefixes per prefix: 8 of 4 prefixes) and the report has its figures.
No timing thresholds: the bench prints ratios. A twin arm (an A/A pair) is a third server
like the native one (~25 s here): its summary is tested on given runs
(tests/dev/test_bench_serve.py), not started in this smoke."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.e2e.conftest import dev_tool_env


@pytest.mark.vllm
@pytest.mark.slow
def test_bench_serve_quick(repo_root, tiny_model, tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvpool_cli", "bench", "serve", "--quick", "--arms",
         "kvpool,native", "--num-prompts", "8", "--json-out", str(out)],
        cwd=repo_root, capture_output=True, text=True, env=dev_tool_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["errors"] == {} and report["dtype"] in ("bfloat16", "float32")
    assert report["server_args"][:4] == ["--block-size", "32", "--max-num-seqs", "4"]
    assert [(r["arm"], r["pass"]) for r in report["runs"]] == [("kvpool", 1), ("native", 1)]
    for r in report["runs"]:
        f = r["figures"]
        assert f["completed"] == 8 and f["failed"] == 0, r
        assert 0 < f["mean_ttft_ms"] <= f["p99_ttft_ms"] and f["request_throughput"] > 0, r
    row = report["summary"]["prefix_repetition"]["passes"][0]
    assert set(row["kvpool_vs_native"]) == {"mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                                            "request_throughput"}
    assert "kvpool/native" in proc.stdout
    assert all("exposed_requests" in r["figures"] for r in report["runs"])
    assert report["summary"]["prefix_repetition"]["aa_spread"] is None  # no twin asked for
