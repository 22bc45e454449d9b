"""The user CLI: dispatch, `validate` and `render` (the operator's renderer, offline)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from kvpool_connector import cli

REPO = Path(__file__).resolve().parents[1]


def test_help_lists_every_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("demo", "bench store", "bench e2e", "render", "validate", "model"):
        assert name in out


def test_unknown_command_fails_with_usage(capsys):
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_validate_accepts_every_example(capsys):
    examples = sorted(str(p) for p in (REPO / "examples").glob("*.yaml"))
    assert examples
    assert cli.main(["validate", *examples]) == 0
    out = capsys.readouterr().out
    assert out.count(": ok") == len(examples)


def test_validate_names_the_bad_field(tmp_path, capsys):
    bad = tmp_path / "connector.yaml"
    bad.write_text(yaml.safe_dump({"namespace": "a", "tiers": [{"type": "cpu", "size": "lots"}]}))
    assert cli.main(["validate", str(bad)]) == 1
    assert "tiers.0.cpu.size" in capsys.readouterr().out


def test_validate_rejects_a_bad_pool(tmp_path, capsys):
    pool = yaml.safe_load((REPO / "examples" / "tiered-full.yaml").read_text())
    pool["spec"]["connector"] = "sideways"
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump(pool))
    assert cli.main(["validate", str(path)]) == 1
    assert "spec.connector" in capsys.readouterr().out


def test_validate_reads_a_whole_kv_transfer_config(tmp_path, capsys):
    path = tmp_path / "kv.json"
    path.write_text('{"kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool_connector.vllm",'
                    ' "kv_connector_extra_config": {"namespace": "n", "tiers": [{"type": "cpu", "size": "1Gi"}]}}')
    assert cli.main(["validate", str(path)]) == 0
    assert "connector config (cpu)" in capsys.readouterr().out


def test_render_is_the_operator_renderer():
    example = str(REPO / "examples" / "tiered-full.yaml")
    bindir = Path(sys.executable).parent
    env = {**os.environ, "KVPOOL_ALLOWED_HOST_PATH_PREFIXES": "/mnt"}  # the operator setting its hostPath needs
    ours = subprocess.run([bindir / "kvpool", "render", "-f", example],
                          capture_output=True, text=True, check=True, env=env).stdout
    theirs = subprocess.run([bindir / "kvpool-operator", "render", "-f", example],
                            capture_output=True, text=True, check=True, env=env).stdout
    assert ours == theirs
    kinds = {d["kind"] for d in yaml.safe_load_all(ours) if d}
    assert {"Deployment", "Service", "StatefulSet", "ConfigMap"} <= kinds


def test_the_connector_never_imports_the_operator():
    """Only the CLI's lazy tables name kvpool_operator (as strings, imported on use)."""
    package = REPO / "connector" / "kvpool_connector"
    offenders = [str(p.relative_to(package)) for p in package.rglob("*.py")
                 if "kvpool_operator" in p.read_text() and p.name != "cli.py"]
    assert offenders == []
    cli_text = (package / "cli.py").read_text()
    assert "import kvpool_operator" not in cli_text and "from kvpool_operator" not in cli_text
