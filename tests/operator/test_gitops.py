"""examples/gitops: the Argo CD Applications and the Flux objects install the chart and a pool.

Argo CD and Flux do not run here, and their CRD schemas are not available offline, so these
tests check what the manifests reference: chart and kustomize paths that exist, values that pass
the chart's values.schema.json and render with the real helm, source/dependency names that
resolve, pools that the operator's model, CRD schema and renderer accept. Kustomize directories
are built with the real `kubectl kustomize` (offline). `kubectl apply --dry-run=client` is not
used: it needs an API server for discovery even in client mode (checked: it fails on
"couldn't get current server API group list" without one).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvpool_operator import models
from kvpool_operator.render import render as render_pool
from kvpool_operator.settings import Settings
from tests.operator.chartkit import CHART, REPO, helm, load_sync_module, one, render, values_schema

GITOPS = REPO / "examples" / "gitops"
FILES = sorted(GITOPS.rglob("*.yaml"))


def docs_of(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def all_docs() -> list[tuple[Path, dict]]:
    return [(p, d) for p in FILES for d in docs_of(p)]


def of_kind(kind: str) -> list[dict]:
    return [d for _, d in all_docs() if d["kind"] == kind]


def kustomize(kubectl: Path, directory: Path) -> list[dict]:
    proc = subprocess.run([str(kubectl), "kustomize", str(directory)], capture_output=True, text=True, timeout=60,
                          env={"KUBECONFIG": "/dev/null", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def repo_path(path: str) -> Path:
    resolved = (REPO / path.removeprefix("./")).resolve()
    assert resolved.is_relative_to(REPO) and resolved.exists(), f"{path} does not exist in the repository"
    return resolved


def assert_chart_values_render(values: dict, tmp_path: Path) -> list[dict]:
    jsonschema.Draft7Validator(values_schema()).validate(values)
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    out = helm("template", "kvpool", str(CHART), "--namespace", "kvpool-system", "-f", str(values_file)).stdout
    return [d for d in yaml.safe_load_all(out) if d]


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(GITOPS)) for p in FILES])
def test_every_file_parses_into_named_objects(path):
    docs = docs_of(path)
    assert docs
    for doc in docs:
        assert doc["apiVersion"] and doc["kind"]
        if doc["apiVersion"] != "kustomize.config.k8s.io/v1beta1":  # kustomize's own file has no name
            assert doc["metadata"]["name"]


def test_api_versions_are_current():
    expected = {
        "Application": "argoproj.io/v1alpha1",
        "HelmRelease": "helm.toolkit.fluxcd.io/v2",
        "GitRepository": "source.toolkit.fluxcd.io/v1",
        "KVCachePool": models.API_VERSION,
    }
    for _, doc in all_docs():
        if doc["kind"] in expected:
            assert doc["apiVersion"] == expected[doc["kind"]], doc["kind"]
        elif doc["kind"] == "Kustomization":
            assert doc["apiVersion"] in ("kustomize.toolkit.fluxcd.io/v1", "kustomize.config.k8s.io/v1beta1")


# ---- Argo CD -----------------------------------------------------------------------------------

def _apps() -> dict[str, dict]:
    return {a["metadata"]["name"]: a for a in of_kind("Application")}


def _sources(app: dict) -> list[dict]:
    return app["spec"].get("sources") or [app["spec"]["source"]]


def _chart_source(app: dict) -> dict:
    (source,) = [s for s in _sources(app) if "helm" in s]
    return source


def watched_namespaces(docs: list[dict]) -> list[str]:
    """The namespaces the chart's operator watches (its Roles), from a rendered chart."""
    return sorted(d["metadata"]["namespace"] for d in docs if d["kind"] == "Role")


def test_argocd_operator_app_installs_the_chart_with_valid_values(tmp_path, kubectl):
    app = _apps()["kvpool-operator"]
    source = _chart_source(app)
    assert (repo_path(source["path"]) / "Chart.yaml").exists()
    assert repo_path(source["path"]) == CHART
    docs = assert_chart_values_render(source["helm"]["valuesObject"], tmp_path)
    assert any(d["kind"] == "Deployment" for d in docs)
    assert any(d["kind"] == "CustomResourceDefinition" for d in docs)
    assert "ServerSideApply=true" in app["spec"]["syncPolicy"]["syncOptions"]
    # the namespaces it watches come with it (a Role cannot go into a namespace that does not exist)
    created = [d["metadata"]["name"] for s in _sources(app) if "helm" not in s
               for d in kustomize(kubectl, repo_path(s["path"])) if d["kind"] == "Namespace"]
    assert watched_namespaces(docs) == sorted(created) == ["llm"]


def test_argocd_pools_app_syncs_after_the_operator(kubectl):
    apps = _apps()
    operator, pools = apps["kvpool-operator"], apps["kvpool-pools"]
    wave = lambda a: int(a["metadata"]["annotations"]["argocd.argoproj.io/sync-wave"])  # noqa: E731
    assert wave(operator) < wave(pools)
    assert "SkipDryRunOnMissingResource=true" in pools["spec"]["syncPolicy"]["syncOptions"]
    built = kustomize(kubectl, repo_path(pools["spec"]["source"]["path"]))
    kv_pools = [d for d in built if d["kind"] == "KVCachePool"]
    assert kv_pools and all(p["metadata"]["namespace"] == pools["spec"]["destination"]["namespace"] for p in kv_pools)
    for app in apps.values():
        assert {s["repoURL"] for s in _sources(app)} == {_chart_source(operator)["repoURL"]}


def test_argocd_health_patch_carries_the_shipped_lua():
    cm = next(d for d in of_kind("ConfigMap") if d["metadata"]["name"] == "argocd-cm")
    key = f"resource.customizations.health.{models.GROUP}_{models.KIND}"
    assert cm["data"] == {key: (CHART / "health" / "kvcachepool.lua").read_text()}
    sync = load_sync_module()
    path = GITOPS / "argocd" / "argocd-cm-health.yaml"
    assert path.read_text() == sync.expected_files()[path]


# ---- Flux -------------------------------------------------------------------------------------

def test_flux_helmrelease_installs_the_chart_from_the_git_source(tmp_path):
    (release,) = of_kind("HelmRelease")
    chart = release["spec"]["chart"]["spec"]
    assert repo_path(chart["chart"]) == CHART
    source = chart["sourceRef"]
    repos = {(g["metadata"]["name"], g["metadata"]["namespace"]) for g in of_kind("GitRepository")}
    assert source["kind"] == "GitRepository" and (source["name"], source["namespace"]) in repos
    docs = assert_chart_values_render(release["spec"]["values"], tmp_path)
    assert any(d["kind"] == "Deployment" for d in docs)
    assert watched_namespaces(docs) == ["llm"]


def test_flux_kustomizations_resolve_paths_sources_and_dependencies(kubectl):
    flux = [k for k in of_kind("Kustomization") if k["apiVersion"].startswith("kustomize.toolkit.fluxcd.io")]
    names = {k["metadata"]["name"] for k in flux}
    repos = {g["metadata"]["name"] for g in of_kind("GitRepository")}
    assert {"kvpool-operator", "kvpool-pools"} <= names
    built: dict[str, list[dict]] = {}
    for k in flux:
        assert k["spec"]["sourceRef"]["kind"] == "GitRepository" and k["spec"]["sourceRef"]["name"] in repos
        for dep in k["spec"].get("dependsOn", []):
            assert dep["name"] in names
        built[k["metadata"]["name"]] = kustomize(kubectl, repo_path(k["spec"]["path"]))
    assert any(d["kind"] == "HelmRelease" for d in built["kvpool-operator"])
    assert any(d["kind"] == "KVCachePool" for d in built["kvpool-pools"])
    # the watched namespace is created with the operator (before its chart's Role there), not the pools
    assert {"llm", "kvpool-system"} == {
        d["metadata"]["name"] for d in built["kvpool-operator"] if d["kind"] == "Namespace"
    }
    assert not [d for d in built["kvpool-pools"] if d["kind"] == "Namespace"]
    pools = next(k for k in flux if k["metadata"]["name"] == "kvpool-pools")
    assert {"name": "kvpool-operator"} in pools["spec"]["dependsOn"] and pools["spec"]["wait"] is True


def test_flux_git_source_keeps_the_paths_it_serves():
    (git,) = of_kind("GitRepository")
    ignore = git["spec"]["ignore"].split()
    assert ignore[0] == "/*"
    kept = {line.removeprefix("!/").rstrip("/") for line in ignore if line.startswith("!")}
    served = [CHART.relative_to(REPO).as_posix()] + [
        k["spec"]["path"].removeprefix("./") for k in of_kind("Kustomization") if "spec" in k and "path" in k["spec"]
    ]
    for path in served:
        assert any(path == k or path.startswith(k + "/") for k in kept), f"{path} is ignored by the GitRepository"


@pytest.mark.parametrize("directory", ["flux/cluster", "flux/operator", "namespaces", "pools"])
def test_kustomize_builds_offline_and_core_kinds_validate(kubectl, directory):
    for doc in kustomize(kubectl, GITOPS / directory):
        if "/" not in doc["apiVersion"] or doc["apiVersion"].split("/")[0].endswith("k8s.io"):
            kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


# ---- the pool ---------------------------------------------------------------------------------

def test_gitops_pool_is_accepted_by_model_crd_and_renderer():
    crd = yaml.safe_load((REPO / "crds" / "kvpool.dev_kvcachepools.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    pools = of_kind("KVCachePool")
    assert pools
    for pool in pools:
        models.KVCachePoolSpec.model_validate(pool["spec"])
        jsonschema.validate(pool, schema)
        for settings in gitops_operator_settings():  # what the operator installed by either tool admits
            children = render_pool(pool, settings, None)
            assert any(c["kind"] == "Deployment" for c in children)


def gitops_operator_settings() -> list[Settings]:
    """The operator Settings the Argo CD and Flux values give (chart env -> Settings.from_env)."""
    out = []
    for values in (of_kind("HelmRelease")[0]["spec"]["values"],
                   next(a for a in of_kind("Application") if a["metadata"]["name"] == "kvpool-operator")
                   ["spec"]["sources"][0]["helm"]["valuesObject"]):
        docs = render({"operator.settings": values["operator"]["settings"]})
        container = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
        out.append(Settings.from_env({e["name"]: e["value"] for e in container["env"] if "value" in e}))
    return out
