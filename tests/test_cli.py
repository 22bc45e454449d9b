"""The umbrella CLI `kvpool` (package kvpool_cli): dispatch, help, `validate` and `render` (the
operator's renderer, offline)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvpool_cli import main as cli

REPO = Path(__file__).resolve().parents[1]


def test_help_lists_every_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("demo", "bench store", "bench e2e", "render", "validate", "model"):
        assert name in out


def test_unknown_command_fails_with_usage(capsys):
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err
    assert cli.main(["bench", "frobnicate"]) == 2
    assert "unknown command 'bench frobnicate'" in capsys.readouterr().err


def test_a_command_group_lists_its_commands(capsys):
    assert cli.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kvpool bench <command> [args]")
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("  ")]
    assert listed == ["store", "e2e", "fleet", "serve", "dtype", "chat", "warm", "copy", "pd"]
    assert cli.main(["bench"]) == 2  # a group alone is incomplete: its usage, on stderr
    assert capsys.readouterr().err.startswith("usage: kvpool bench <command> [args]")


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_every_commands_help_names_the_command_as_typed(name, capsys):
    """`kvpool <command> --help` prints the usage of `kvpool <command>`, no other program's."""
    with pytest.raises(SystemExit) as done:
        cli.main([*name.split(), "--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: kvpool {name} ")


def test_the_python_module_entry_is_the_cli():
    out = subprocess.run([sys.executable, "-m", "kvpool_cli", "--help"], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    assert out == cli.usage() + "\n"


def test_validate_accepts_every_example(capsys, monkeypatch):
    """Under the operator settings the examples name (hostPath under /mnt, InferencePools, KEDA)."""
    monkeypatch.setenv("KVPOOL_ALLOWED_HOST_PATH_PREFIXES", "/mnt")
    monkeypatch.setenv("KVPOOL_INFERENCE_POOLS", "true")
    monkeypatch.setenv("KVPOOL_KEDA", "true")
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
    ours = subprocess.run([sys.executable, "-m", "kvpool_cli", "render", "-f", example],
                          capture_output=True, text=True, check=True, env=env).stdout
    theirs = subprocess.run([bindir / "kvpool-operator", "render", "-f", example],
                            capture_output=True, text=True, check=True, env=env).stdout
    assert ours == theirs
    kinds = {d["kind"] for d in yaml.safe_load_all(ours) if d}
    assert {"Deployment", "Service", "StatefulSet", "ConfigMap"} <= kinds


PACKAGES = {"kvpool_connector": REPO / "connector", "kvpool_operator": REPO / "operator", "kvpool_cli": REPO / "cli"}


def _naming(package: str, pattern: str) -> list[str]:
    """Files of a package whose text names `pattern` (a regex)."""
    root = PACKAGES[package] / package
    return [str(p.relative_to(REPO)) for p in root.rglob("*.py") if re.search(pattern, p.read_text())]


def test_the_connector_names_neither_the_operator_nor_the_cli():
    """The connector stands alone (the engine image); only the umbrella CLI knows every part."""
    assert _naming("kvpool_connector", r"\bkvpool_(operator|cli)\b") == []
    assert _naming("kvpool_operator", r"\bkvpool_cli\b") == []


def test_the_product_never_imports_the_dev_tooling():
    """Only the CLIs' lazy tables name kvpool_dev (as strings, imported on use). The metric label
    kvpool_dev_pool (from the pod label kvpool.dev/pool) is another name."""
    clis = {"cli/kvpool_cli/main.py", "operator/kvpool_operator/cli.py"}
    for package in PACKAGES:
        assert set(_naming(package, r"\bkvpool_dev\b")) <= clis, package
    for path in clis:
        text = (REPO / path).read_text()
        assert "import kvpool_dev" not in text and "from kvpool_dev" not in text


# Run a CLI in a process where kvpool_dev cannot be imported: what an image or a plain
# `pip install kvpool` has (the dev distribution is dev/ in a checkout, never installed there).
WITHOUT_DEV = """
import sys
class NoDev:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == 'kvpool_dev':
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoDev())
from {module} import main
sys.exit(main(sys.argv[1:]))
"""


def run_without_dev(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT_DEV.replace("{module}", module), *args],
                          capture_output=True, text=True, timeout=120, cwd=REPO)


def test_dev_commands_without_kvpool_dev_fail_in_one_line():
    for args in (["demo"], ["bench", "store", "--help"], ["bench", "e2e"], ["bench", "fleet"], ["model"]):
        out = run_without_dev("kvpool_cli.main", *args)
        name = " ".join(args[:2]) if args[0] == "bench" else args[0]
        assert out.returncode == 2, out
        assert out.stderr == f"`kvpool {name}` is dev tooling: pip install -e ./dev from a kvpool checkout\n"
    # the product commands do not need it
    out = run_without_dev("kvpool_cli.main", "validate", str(REPO / "examples" / "tiered-cpu-only.yaml"))
    assert out.returncode == 0 and ": ok" in out.stdout, out.stderr


def test_operator_golden_without_kvpool_dev_fails_in_one_line(tmp_path):
    out = run_without_dev("kvpool_operator.cli", "golden", "--write", str(tmp_path / "golden"))
    assert out.returncode == 2, out
    assert out.stderr == "`kvpool-operator golden` is dev tooling: pip install -e ./dev from a kvpool checkout\n"
    assert not (tmp_path / "golden").exists()
    out = run_without_dev("kvpool_operator.cli", "crd")
    assert out.returncode == 0 and "CustomResourceDefinition" in out.stdout, out.stderr
