"""Helpers for the chart, image and GitOps tests: run the real helm binary, split and index output.

Not a test module (no `test_` prefix); imported by test_helm*.py, test_images.py, test_gitops*.py.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvpool"
HELM = REPO / "bin" / "helm"

# Kinds whose schema is a CRD, not part of the Kubernetes OpenAPI that kubernetes-validate ships.
CRD_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("kvpool.dev/v1alpha1", "KVCachePool"),
    ("kopf.dev/v1", "KopfPeering"),
    ("kopf.dev/v1", "ClusterKopfPeering"),
}


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run bin/helm with an isolated, empty config (no repositories, no cluster needed)."""
    env = {
        "HOME": str(REPO / ".pytest_cache" / "helm-home"),
        "HELM_CACHE_HOME": str(REPO / ".pytest_cache" / "helm-home" / "cache"),
        "HELM_CONFIG_HOME": str(REPO / ".pytest_cache" / "helm-home" / "config"),
        "HELM_DATA_HOME": str(REPO / ".pytest_cache" / "helm-home" / "data"),
        "KUBECONFIG": "/dev/null",
        "PATH": "/usr/bin:/bin",
    }
    proc = subprocess.run([str(HELM), *args], capture_output=True, text=True, env=env, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}{proc.stdout}")
    return proc


def set_args(values: dict[str, Any] | None) -> list[str]:
    """Values as `--set-json` arguments (exact types, no --set string coercion)."""
    out: list[str] = []
    for key, value in (values or {}).items():
        out += ["--set-json", f"{key}={json.dumps(value)}"]
    return out


@lru_cache(maxsize=64)
def _template(values_json: str, namespace: str, release: str) -> str:
    values = json.loads(values_json)
    return helm("template", release, str(CHART), "--namespace", namespace, *set_args(values)).stdout


def render(
    values: dict[str, Any] | None = None, namespace: str = "kvpool-system", release: str = "kvpool"
) -> list[dict]:
    """`helm template` output as a list of manifests (cached per distinct input)."""
    text = _template(json.dumps(values or {}, sort_keys=True), namespace, release)
    return [doc for doc in yaml.safe_load_all(text) if doc]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str) -> dict:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def load_sync_module():
    """charts/kvpool/hack/sync.py (a script, not a package)."""
    spec = importlib.util.spec_from_file_location("kvpool_chart_sync", CHART / "hack" / "sync.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def chart_values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def values_schema() -> dict:
    return json.loads((CHART / "values.schema.json").read_text())
