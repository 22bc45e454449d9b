"""The README's Kubernetes quick start, run offline as a script: the real helm installs with
`--dry-run=client`, the real kubectl creates with `--dry-run=client`, every `kvpool` command runs;
what would reach a cluster is checked instead: the pushed images are the Dockerfile's targets, the
operator the chart renders gets settings that admit the applied pool (kvpool_operator.validation),
and every manifest validates against the Kubernetes schema."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kvpool_operator import __version__
from kvpool_operator.settings import Settings
from kvpool_operator.validation import check_document

REPO = Path(__file__).resolve().parents[2]
BIN = REPO / "bin"

# Stand-ins put first on PATH: the offline half of each tool runs for real, the rest is logged.
HELM = """#!/bin/bash
echo "helm $*" >> "$QS_LOG"
if [ "$1" = install ]; then
  "$QS_BIN/helm" "$@" --dry-run=client > "$QS_OUT/helm-install.txt"
else
  exec "$QS_BIN/helm" "$@"
fi
"""
KUBECTL = """#!/bin/bash
echo "kubectl $*" >> "$QS_LOG"
args=("$@"); verb=""; file=""
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[$i]}" in
    -n|--namespace) i=$((i + 1));;
    -f) file="${args[$((i + 1))]}"; i=$((i + 1));;
    -*) ;;
    *) [ -z "$verb" ] && verb="${args[$i]}";;
  esac
done
case "$verb" in
  create) "$QS_BIN/kubectl" "$@" --dry-run=client -o yaml >> "$QS_OUT/created.yaml"
          echo --- >> "$QS_OUT/created.yaml";;
  apply) echo "$file" >> "$QS_OUT/applied.txt";;
  *) ;;  # get, wait: read a cluster there is none of
esac
"""
LOGGED = """#!/bin/bash
echo "$(basename "$0") $*" >> "$QS_LOG"
"""


def quick_start() -> str:
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Kubernetes quick start"):]
    block = section[section.index("```bash\n") + len("```bash\n"):]
    return block[:block.index("```")]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("quickstart")
    fake = tmp / "bin"
    fake.mkdir()
    for name, body in (("helm", HELM), ("kubectl", KUBECTL), ("buildah", LOGGED), ("make", LOGGED)):
        (fake / name).write_text(body)
        (fake / name).chmod(0o755)
    out = tmp / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_") or k == "KVPOOL_DTYPE"}
    env.update(PATH=f"{fake}:{Path(sys.executable).parent}:{env['PATH']}", QS_BIN=str(BIN), QS_OUT=str(out),
               QS_LOG=str(tmp / "log"), HF_TOKEN="hf_quickstart-token",
               HELM_CACHE_HOME=str(tmp / "helm" / "cache"), HELM_CONFIG_HOME=str(tmp / "helm" / "config"),
               HELM_DATA_HOME=str(tmp / "helm" / "data"))
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", quick_start()], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return {"stdout": proc.stdout, "stderr": proc.stderr, "out": out, "log": (tmp / "log").read_text()}


def test_the_pushed_images_are_the_ones_make_images_builds(run):
    from kvpool_dev.images.dockerfile import documented_tags

    built = set(documented_tags((REPO / "Dockerfile").read_text()).values())
    pushed = re.findall(r"^buildah push (\S+) docker://registry\.example/kvpool/(\S+)$", run["log"], re.M)
    assert "make images" in run["log"]
    assert {source for source, _ in pushed} == built  # every image, under the names make images tags
    assert all(source.rsplit("/", 1)[1] == target for source, target in pushed)
    assert all(source.endswith(f":{__version__}") for source, _ in pushed)


def _operator_settings(run: dict) -> tuple[Settings, dict]:
    text = (run["out"] / "helm-install.txt").read_text()
    manifest = text[text.index("MANIFEST:") + len("MANIFEST:"):text.index("NOTES:")]
    docs = [d for d in yaml.safe_load_all(manifest) if d]
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    return Settings.from_env(env), container


def test_the_chart_runs_the_pushed_operator_with_the_pushed_engine_image(run):
    settings, container = _operator_settings(run)
    assert container["image"].startswith("registry.example/kvpool/kvpool-operator")
    assert settings.connector_image == f"registry.example/kvpool/kvpool-vllm:{__version__}"
    assert settings.router_image == f"registry.example/kvpool/kvpool-router:{__version__}"
    assert settings.namespaces == ("llm",)


def test_the_applied_pool_is_valid_under_the_operators_settings(run):
    """What `kubectl apply` would hand the operator the chart installed: accepted, and every child
    and every created object schema-valid (what the API server would check)."""
    settings, _ = _operator_settings(run)
    applied = (run["out"] / "applied.txt").read_text().split()
    assert "examples/tiered-full.yaml" in applied
    created = [d for d in yaml.safe_load_all((run["out"] / "created.yaml").read_text()) if d]
    assert {(d["kind"], d["metadata"]["name"]) for d in created} == {("Namespace", "llm"), ("Secret", "hf-token")}
    objects = created
    for path in applied:
        for doc in yaml.safe_load_all((REPO / path).read_text()):
            if doc.get("kind") == "KVCachePool":
                checked = check_document(doc, settings, "llm")
                objects += checked.manifests
                spec = checked.pool.spec
                names = {d["metadata"]["name"] for d in created if d["kind"] == "Secret"}
                if spec.model.hf_token_secret_ref is not None:  # the token Secret the quick start created
                    assert spec.model.hf_token_secret_ref.name in names
            else:
                objects.append(doc)
    claims = {d["metadata"]["name"] for d in objects if d["kind"] == "PersistentVolumeClaim"}
    assert "hf-cache" in claims  # tiered-full's hfCache claim is among what the quick start applies
    for obj in objects:
        kubernetes_validate.validate(obj, kubernetes_validate.utils.latest_version(), strict=True)


def test_the_kvpool_commands_ran(run):
    assert "examples/tiered-full.yaml: KVCachePool tiered-full: ok" in run["stdout"]
    assert "kind: Deployment" in run["stdout"] and "namespace: llm" in run["stdout"]
