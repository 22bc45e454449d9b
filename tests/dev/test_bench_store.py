"""`kvpool bench store` on small sizes: every tier and variant measured against its raw
baseline in one run (a real redis-server and moto S3 started by the bench), and the bytes
read back checked by the bench itself. No timing thresholds: ratios are its output."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_store_reports_every_tier_and_variant(repo_root):
    proc = subprocess.run(
        [sys.executable, "-m", "kvpool_cli", "bench", "store", "--json",
         "--tiers", "cpu,disk,disk-cold,redis,s3", "--chunks", "4", "--s3-chunks", "2",
         "--chunk-size", "600Ki", "--batch", "2", "--rounds", "2", "--rebuild-objects", "50"],
        cwd=repo_root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    rows = {(r["tier"], r["op"]): r for r in report["results"]}
    assert set(rows) == {(t, op) for t in ("cpu", "disk", "redis", "s3")
                         for op in ("write", "read")} | {("disk-cold", "read")}
    for (tier, op), r in rows.items():
        assert r["raw_gbps"] > 0 and r["mac_gbps"] > 0, (tier, op)
        if tier != "cpu":  # the cpu tier seals nothing: no xxh3 or aes variant
            assert r["xxh3_gbps"] > 0 and r["aes_gbps"] > 0, (tier, op)
            assert r["mac_vs_xxh3"] > 0 and r["aes_vs_xxh3"] > 0
    assert set(report["contains_prefix_us"]) == {"cpu", "disk", "disk-cold", "redis", "s3"}
    assert report["disk_rebuild"] == {**report["disk_rebuild"], "objects": 50, "found": 50}


def test_bench_store_refuses_an_unknown_tier(repo_root):
    proc = subprocess.run(
        [sys.executable, "-m", "kvpool_cli", "bench", "store", "--tiers", "cpu,tape"],
        cwd=repo_root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "tape" in proc.stderr
