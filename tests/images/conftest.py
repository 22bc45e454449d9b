"""The built images, run with podman (`make test-images`, which builds them first).

Collected only when KVPOOL_IMAGES names the manifest that `python -m kvpool_dev.images.build`
wrote (out/images/build.json): building takes minutes and needs root, buildah and podman, so
these are not part of `make test` (README, "Images"). Each image runs the way the chart or the
operator renders its pod: same user, read-only root filesystem where the manifest sets one, the
emptyDirs as the only writable paths, dropped capabilities (kvpool_dev.images.podman). Containers
sit on podman's default bridge network, publish their ports on 127.0.0.1 and reach the API
emulator on the bridge's gateway address.
"""

from __future__ import annotations

import json
import os
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpool_dev.images import dockerfile, podman

REPO = Path(__file__).resolve().parents[2]
_, _, STAGES = dockerfile.load(REPO / "Dockerfile")
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
collect_ignore_glob = [] if os.environ.get("KVPOOL_IMAGES") else ["test_*.py"]

ROWS: dict[str, dict[str, Any]] = {}  # target -> what test_contents measured, for the report
REPORT = REPO / "out" / "images" / "report.md"


@pytest.fixture(scope="session")
def manifest() -> dict[str, Any]:
    return json.loads(Path(os.environ["KVPOOL_IMAGES"]).read_text())


@pytest.fixture(scope="session")
def built(manifest) -> dict[str, str]:
    """target -> image reference, for the targets the build produced."""
    return {t: e["ref"] for t, e in manifest["targets"].items() if "id" in e}


@pytest.fixture(scope="session")
def image(manifest, built):
    """image(target): its reference; skips, with the build's reason, a target it did not build."""
    def get(target: str) -> str:
        if target not in built:
            entry = manifest["targets"].get(target)
            pytest.skip(f"{target} not built: {entry['reason'] if entry else 'not requested'}")
        return built[target]
    return get


@pytest.fixture(scope="session")
def runtime(built) -> podman.Runtime:
    assert built, "the build produced no image"
    return podman.probe_runtime(next(iter(built.values())))


@pytest.fixture(scope="session")
def gateway(runtime) -> str:
    """The host's address on podman's default network: what containers reach the host at."""
    out = subprocess.run(runtime.podman("network", "inspect", "podman"), capture_output=True, text=True, check=True)
    return json.loads(out.stdout)[0]["subnets"][0]["gateway"]


def write_kubeconfig(path: Path, server: str, namespace: str) -> Path:
    """What stands in for the pod's service account token: a kubeconfig for the emulator."""
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emu",
        "clusters": [{"name": "emu", "cluster": {"server": server}}],
        "users": [{"name": "emu", "user": {"token": "smoke-sa-token"}}],
        "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "emu", "namespace": namespace}}]}))
    path.chmod(0o644)
    return path


def pytest_terminal_summary(terminalreporter) -> None:
    if not ROWS:
        return
    head = (
        "| target | image | size | layers | build | user | entrypoint | contents |\n|---|---|---|---|---|---|---|---|\n"
    )
    lines = [f"| {t} | `{r['ref']}` | {r['size_mb']} MB | {r['layers']} | {r['build']} | {r['user'] or 'root'} | "
             f"`{' '.join(r['entrypoint'])}` | {r['contents']} |" for t, r in ROWS.items()]
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(head + "\n".join(lines) + "\n")
    terminalreporter.write_sep("-", f"images (also in {REPORT.relative_to(REPO)})")
    for line in (head + "\n".join(lines)).splitlines():
        terminalreporter.write_line(line)
