"""`kvpool bench copy` on this machine's CPU (the CUDA run is in docs/benchmarks.md): it
times the connector's real gather/scatter against a plain copy and reports both, and bad
input is one line naming the option."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvpool_dev.bench import copy_bench


def test_rate_is_bytes_over_the_median_time():
    assert copy_bench.rate(2_000_000_000, [1.0, 4.0, 2.0]) == 1.0


def test_chunk_bytes_match_the_layout_the_run_builds():
    from kvpool_connector.connector.layout import KVLayout

    kv = copy_bench.caches("cpu", 16, layers=3)
    assert KVLayout(kv, list(kv), 16).chunk_nbytes(4) == copy_bench.chunk_bytes(64, 3)


def test_a_cpu_run_reports_both_arms_in_both_directions(capsys):
    assert copy_bench.main(["--device", "cpu", "--layers", "2", "--reps", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["device"] == "cpu" and report["chunk_bytes"] == 2 * 16 * 8 * 16 * 256 * 2
    for direction in ("save (cache -> host)", "load (host -> cache)"):
        arms = report["gbps"][direction]
        assert arms["bound"] > 0 and arms["kvpool"] > 0
    assert copy_bench.main(["--device", "cpu", "--layers", "1", "--reps", "1"]) == 0
    assert "kvpool / bound" in capsys.readouterr().out


@pytest.mark.parametrize("args,message", [
    (["--chunk-tokens", "10"], "--chunk-tokens must be a positive number of whole 16-token blocks"),
    (["--reps", "0"], "--reps must be a positive number"),
    (["--device", "tpu"], "--device tpu: not available here"),
    (["--device", "cpu", "--chunk-tokens", "16000000"],
     "--chunk-tokens/--layers: the run needs 19531.2 GiB, cpu has"),
])
def test_bad_input_is_one_line(repo_root, args, message):
    proc = subprocess.run([sys.executable, "-m", "kvpool_cli", "bench", "copy", *args],
                          cwd=repo_root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().startswith(f"kvpool bench copy: {message}")
    assert len(proc.stderr.strip().splitlines()) == 1
