"""`kvpool render` and `kvpool validate` run the reconciler's validation (kvpool_operator.validation),
so they agree on every input, and fail in one line naming the field with the documented exit
codes (0 ok, 1 invalid, 2 cannot run) and never a traceback. Run as users run them: subprocesses."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
EXAMPLE_SETTINGS = {"KVPOOL_ALLOWED_HOST_PATH_PREFIXES": "/mnt", "KVPOOL_INFERENCE_POOLS": "true",
                    "KVPOOL_KEDA": "true"}
CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_") or k == "KVPOOL_DTYPE"}

POOL = {
    "apiVersion": "kvpool.dev/v1alpha1", "kind": "KVCachePool", "metadata": {"name": "p"},
    "spec": {"model": {"name": "m", "gpus": 0}, "tiers": {"cpu": {"size": "1Gi"}}},
}


def kvpool(*args: str, env: dict[str, str] | None = None, stdin: str | None = None) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "kvpool_cli", *args], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env={**CLEAN_ENV, **(env or {})}, input=stdin)
    assert "Traceback" not in out.stderr and "Traceback" not in out.stdout, out.stderr
    return out


def both(path: Path | str, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, ...]:
    return kvpool("render", "-f", str(path), env=env), kvpool("validate", str(path), env=env)


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


def write(tmp_path: Path, text: str, name: str = "pool.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def pool(**changes) -> dict:
    doc = json.loads(json.dumps(POOL))
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        node = doc
        for key in parents:
            node = node.setdefault(key, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    return doc


# --- files that are not pools: both commands, exit 1, one line naming file, line and problem

@pytest.mark.parametrize(("text", "expected"), [
    ("apiVersion: kvpool.dev/v1alpha1\nkind: [KVCachePool\n", r":3:1: YAML syntax error: "),
    ("spec:\n\tmodel: m\n", r":2:1: YAML syntax error: .*'\\t'.*never tabs"),
    ("", r": no document \(the file is empty\)"),
    ("# only a comment\n---\n", r": no document \(the file is empty\)"),
    ("- a\n- b\n", r"expected a (KVCachePool )?mapping.*got a list"),
])
def test_malformed_files_are_invalid_in_one_line(tmp_path, text, expected):
    path = write(tmp_path, text)
    render, validate = both(path)
    assert (render.returncode, validate.returncode) == (1, 1)
    assert render.stdout == ""
    assert re.search(expected, one_line(render.stderr)), render.stderr
    assert re.search(expected, one_line(validate.stdout)), validate.stdout
    assert str(path) in render.stderr and str(path) in validate.stdout


@pytest.mark.parametrize("where", ["missing", "directory"])
def test_a_path_that_cannot_be_read_is_a_usage_error(tmp_path, where):
    path = tmp_path / "nope.yaml" if where == "missing" else tmp_path
    render, validate = both(path)
    assert (render.returncode, validate.returncode) == (2, 2)
    message = "no such file" if where == "missing" else "is a directory"
    assert message in one_line(render.stderr) and message in one_line(validate.stderr)


def test_bad_settings_name_the_variable(tmp_path):
    path = write(tmp_path, yaml.safe_dump(POOL))
    render, validate = both(path, env={"KVPOOL_RETRY_DELAY": "soon"})
    assert (render.returncode, validate.returncode) == (2, 2)
    for out in (render, validate):
        assert "KVPOOL_RETRY_DELAY='soon'" in one_line(out.stderr)


def test_usage_errors_exit_2():
    assert kvpool("render").returncode == 2
    assert kvpool("validate").returncode == 2


# --- documents both must refuse, with the field named

REFUSED = {
    "wrong apiVersion": (pool(apiVersion="kvpool.dev/v1"), "apiVersion: 'kvpool.dev/v1' is not kvpool.dev/v1alpha1"),
    "no metadata.name": (pool(metadata__name=None), "metadata.name: required"),
    "name not a DNS label": (pool(metadata__name="My_Pool"), "metadata.name: 'My_Pool' must be a DNS label"),
    "hostPath without the setting": (
        pool(spec__tiers__disk={"size": "10Gi", "volume": {"hostPath": {"path": "/mnt/nvme"}}}),
        "spec.tiers.disk.volume.hostPath: refused by this operator"),
    "a bad size": (pool(spec__tiers__cpu={"size": "10Gb"}), "spec.tiers.cpu.size: '10Gb' must be a size"),
    "InferencePool without the setting": (pool(spec__inferencePool={"enabled": True, "endpointPickerRef": {
        "name": "epp", "port": {"number": 9002}}}), "spec.inferencePool.enabled: refused by this operator"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_render_and_validate_refuse_the_same_pools(tmp_path, case):
    doc, message = REFUSED[case]
    render, validate = both(write(tmp_path, yaml.safe_dump(doc)))
    assert (render.returncode, validate.returncode) == (1, 1)
    assert message in one_line(render.stderr)
    assert message in one_line(validate.stdout) and "INVALID" in validate.stdout
    assert render.stdout == ""


def test_a_typod_kind_is_named_as_such(tmp_path):
    path = write(tmp_path, yaml.safe_dump(pool(kind="KVCachePoool")))
    render, validate = both(path)
    assert (render.returncode, validate.returncode) == (1, 1)
    for text in (render.stderr, validate.stdout):
        assert "kind: 'KVCachePoool' is not" in one_line(text) and "did you mean KVCachePool?" in text
        assert "connector" not in text  # not read as a connector config with a misleading error


def test_render_needs_kind_and_apiversion_in_a_file(tmp_path):
    render = kvpool("render", "-f", str(write(tmp_path, yaml.safe_dump(pool(kind=None)))))
    assert render.returncode == 1 and "kind: required" in render.stderr
    render = kvpool("render", "-f", str(write(tmp_path, yaml.safe_dump(pool(apiVersion=None)))))
    assert render.returncode == 1 and "apiVersion: required" in render.stderr


def test_one_bad_document_renders_nothing(tmp_path):
    """A pipe into kubectl never applies half a file."""
    path = write(tmp_path, yaml.safe_dump_all([POOL, pool(metadata__name=None)]))
    render, validate = both(path)
    assert (render.returncode, validate.returncode) == (1, 1)
    assert render.stdout == "" and "(document 2)" in render.stderr
    assert validate.stdout.count(": ok") == 1 and "(document 2)" in validate.stdout


def test_stdin(tmp_path):
    out = kvpool("render", "-f", "-", stdin=yaml.safe_dump(POOL))
    assert out.returncode == 0 and "kind: Deployment" in out.stdout
    out = kvpool("validate", "-", stdin="a: [\n")
    assert out.returncode == 1 and out.stdout.startswith("-:2:1: YAML syntax error")


# --- the shipped examples: one verdict from both commands, under any settings

@pytest.mark.parametrize("settings", ["defaults", "examples"])
def test_every_example_gets_one_verdict(settings, monkeypatch, capsys):
    """In this process, through the CLI's own dispatch (the tests above run it as users do,
    with its exit codes and streams): as 48 subprocesses it took 44 s of the suite."""
    from kvpool_cli import main

    monkeypatch.setattr(main, "stop_cleanly_on_sigterm", lambda: None)  # pytest's own SIGTERM
    for name in [k for k in os.environ if k not in CLEAN_ENV]:
        monkeypatch.delenv(name)
    for name, value in (EXAMPLE_SETTINGS if settings == "examples" else {}).items():
        monkeypatch.setenv(name, value)

    def run(*args: str) -> tuple[int, str]:
        code = main.main(list(args))
        out = capsys.readouterr()
        return code, out.out + out.err

    for example in EXAMPLES:
        (render, render_out), (validate, validate_out) = (
            run("render", "-f", str(example)), run("validate", str(example)))
        assert render == validate, (example.name, render_out, validate_out)
        assert render in (0, 1) and "Traceback" not in render_out + validate_out
        if settings == "examples":
            assert render == 0, (example.name, render_out)


def test_the_reconciler_runs_the_same_check():
    """validation.check is what children.reconcile calls (no second path to drift apart)."""
    import inspect

    from kvpool_operator.reconcile import children

    source = inspect.getsource(children)
    assert "validation.check(" in source
    assert "render_pool(" not in source and "load_pool(" not in source


# --- connector configs (validate only)

def test_a_shared_tier_without_a_pool_key_is_invalid(tmp_path):
    cfg = {"namespace": "n", "tiers": [{"type": "cpu", "size": "1Gi"}, {"type": "disk", "path": "/tmp/kv",
                                                                         "size": "1Gi"}]}
    out = kvpool("validate", str(write(tmp_path, yaml.safe_dump(cfg), "kv.yaml")))
    assert out.returncode == 1
    assert "security.key_env or security.key_file: shared tiers" in one_line(out.stdout)
    cfg["security"] = {"key_env": "KVPOOL_POOL_KEY"}
    out = kvpool("validate", str(write(tmp_path, yaml.safe_dump(cfg), "kv.yaml")))
    assert out.returncode == 0 and "connector config (cpu, disk): ok" in out.stdout


def _readme_json(heading: str) -> dict:
    """The --kv-transfer-config JSON of a README section, as a user would paste it."""
    text = (REPO / "README.md").read_text()
    section = text[text.index(heading):]
    block = section[section.index("```bash"):]
    block = block[:block.index("```", 3)]
    return json.loads(block[block.index("'{") + 1:block.index("}'") + 1])


@pytest.mark.parametrize("heading", ["## Use the connector with vLLM", "### Native mode"])
def test_the_readmes_configs_validate(tmp_path, heading):
    path = write(tmp_path, json.dumps(_readme_json(heading)), "kv.json")
    out = kvpool("validate", str(path))
    assert out.returncode == 0, out.stdout
    assert one_line(out.stdout).endswith(": ok")


def test_native_configs_are_checked(tmp_path):
    cfg = _readme_json("### Native mode")
    tier = cfg["kv_connector_extra_config"]["secondary_tiers"][0]
    tier.pop("config_file")
    tier.update(namespace="n", tiers=[{"type": "cpu", "size": "1Gi"}])
    out = kvpool("validate", str(write(tmp_path, json.dumps(cfg), "kv.json")))
    assert out.returncode == 1 and "secondary_tiers.0: a cpu tier is not allowed here" in out.stdout
    tier["tiers"] = [{"type": "redis", "url": "redis://r:6379/0"}]
    out = kvpool("validate", str(write(tmp_path, json.dumps(cfg), "kv.json")))
    assert out.returncode == 1 and "secondary_tiers.0: security.key_env or security.key_file" in out.stdout
    tier["security"] = {"key_env": "K"}
    out = kvpool("validate", str(write(tmp_path, json.dumps(cfg), "kv.json")))
    assert out.returncode == 0 and "kvpool (redis)" in out.stdout


def test_a_kubernetes_object_of_another_kind_is_not_read_as_a_connector_config(tmp_path):
    out = kvpool("validate", str(write(tmp_path, yaml.safe_dump({"apiVersion": "v1", "kind": "ConfigMap"}))))
    assert out.returncode == 1 and "kind: 'ConfigMap' is not a kind kvpool validates" in one_line(out.stdout)


# --- warnings: a size no node holds

def test_a_size_no_node_holds_is_a_warning_not_an_error(tmp_path):
    path = write(tmp_path, yaml.safe_dump(pool(spec__tiers__cpu={"size": "1Pi"})))
    render, validate = both(path)
    assert (render.returncode, validate.returncode) == (0, 0)
    for text in (render.stderr, validate.stderr):
        line = one_line(text)
        assert "warning: " in line and "spec.tiers.cpu.size: Deployment/p requests 1.0Pi of memory per pod" in line
        assert "bound 32Ti" in line
    assert "kind: Deployment" in render.stdout
    ok = both(write(tmp_path, yaml.safe_dump(POOL)))
    assert ok[0].stderr == "" and ok[1].stderr == ""


def test_a_misspelled_setting_is_a_warning(tmp_path):
    """from_env ignores unknown variables: a typo would leave the setting at its default unseen."""
    path = write(tmp_path, yaml.safe_dump(POOL))
    render, validate = both(path, env={"KVPOOL_ALLOWED_HOSTPATH_PREFIXES": "/mnt", "KVPOOL_POOL_KEY": "x" * 40})
    assert (render.returncode, validate.returncode) == (0, 0)
    for text in (render.stderr, validate.stderr):
        assert "KVPOOL_ALLOWED_HOSTPATH_PREFIXES is not an operator setting (ignored); did you mean " \
               "KVPOOL_ALLOWED_HOST_PATH_PREFIXES?" in one_line(text)


def test_a_model_volume_the_engines_would_not_read_is_a_warning(tmp_path):
    doc = pool(spec__model__volume={"persistentVolumeClaim": {"claimName": "models"}})  # name "m": a hub id
    render, validate = both(write(tmp_path, yaml.safe_dump(doc)))
    assert (render.returncode, validate.returncode) == (0, 0)
    for text in (render.stderr, validate.stderr):
        assert "spec.model.name: 'm' is not under spec.model.volume.mountPath /models" in one_line(text)
