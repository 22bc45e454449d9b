"""`kvpool-operator` subcommands, run as the Makefile and users run them (a real subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from kvpool_operator import crd
from kvpool_operator.cli import main
from kvpool_operator.render import render
from kvpool_operator.settings import Settings
from tests.operator.conftest import GOLDEN_DIR

REPO = Path(__file__).resolve().parents[2]


ALLOW_MNT = {"KVPOOL_ALLOWED_HOST_PATH_PREFIXES": "/mnt"}  # the examples' hostPath tiers live there


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpool_operator.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


def test_render_prints_multi_document_yaml():
    out = cli("render", "-f", "examples/tiered-full.yaml", "--namespace", "team-a", env=ALLOW_MNT)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    pool = yaml.safe_load((REPO / "examples" / "tiered-full.yaml").read_text())
    assert docs == render(pool, Settings.from_env(ALLOW_MNT), "team-a")  # the operator's render function
    assert len(docs) >= 11 and {d["metadata"]["namespace"] for d in docs} == {"team-a"}


def test_render_bad_file_exits_1_naming_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"apiVersion": "kvpool.dev/v1alpha1", "kind": "KVCachePool",
                                   "metadata": {"name": "x"}, "spec": {"model": {"name": "m"}, "tiers": {}}}))
    out = cli("render", "-f", str(bad))
    assert out.returncode == 1 and "spec.tiers: at least one tier is required" in out.stderr
    assert out.stdout == ""


def test_crd_and_golden_write(tmp_path):
    assert main(["crd", "--write", str(tmp_path / "crds")]) == 0
    assert (tmp_path / "crds" / crd.CRD_FILENAME).read_text() == crd.crd_yaml()
    assert main(["golden", "--write", str(tmp_path / "golden")]) == 0
    for path in (tmp_path / "golden").iterdir():
        assert path.read_text() == (GOLDEN_DIR / path.name).read_text()


def test_run_help_lists_flags():
    out = cli("run", "--help")
    assert out.returncode == 0
    for flag in ("--namespace", "--all-namespaces", "--liveness", "--peering"):
        assert flag in out.stdout


def test_peering_priority_is_distinct_per_pod_and_stable():
    from kvpool_operator.cli import peering_priority

    a1 = peering_priority(None, "kvpool-operator-7d9f-abcde")
    a2 = peering_priority(None, "kvpool-operator-7d9f-abcde")
    b = peering_priority(None, "kvpool-operator-7d9f-fghij")
    assert a1 == a2 and a1 != b  # equal priorities would make every replica active
    assert peering_priority(42, "anything") == 42


def test_render_refuses_host_path_unless_the_operator_allows_it():
    """The CLI renders with the operator's settings from the environment, as the operator would."""
    out = cli("render", "-f", "examples/tiered-full.yaml", env={"KVPOOL_ALLOWED_HOST_PATH_PREFIXES": ""})
    assert out.returncode == 1
    assert "spec.tiers.disk.volume.hostPath: refused by this operator" in out.stderr
    out = cli("render", "-f", "examples/tiered-full.yaml", env={"KVPOOL_ALLOWED_HOST_PATH_PREFIXES": "/data"})
    assert out.returncode == 1 and "/mnt/nvme0 is not under an allowed prefix" in out.stderr
