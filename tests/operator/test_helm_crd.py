"""The KVCachePool CRD in the chart: a template (so upgrades upgrade it), kept on uninstall, and a
byte-for-byte copy of the generated crds/ (Helm cannot read files outside the chart).

Upgrade story under test: the chart has no crds/ directory (which Helm installs once and never
upgrades, and skips with --skip-crds); the CRD is an ordinary release manifest, so it is part of
every `helm upgrade` and of the release manifest, while `helm.sh/resource-policy: keep` stops
`helm uninstall` from deleting it (and with it every pool and fleet).
"""

from __future__ import annotations

import copy
import shutil

import yaml

from tests.operator.chartkit import CHART, REPO, helm, load_sync_module, one, render

CRD_FILE = "kvpool.dev_kvcachepools.yaml"


def _rendered_crd(values: dict | None = None) -> dict:
    crds = [d for d in render(values) if d["kind"] == "CustomResourceDefinition" and d["spec"]["group"] == "kvpool.dev"]
    assert len(crds) == 1
    return crds[0]


def test_chart_copy_equals_generated_crd():
    sync = load_sync_module()
    assert (REPO / "crds" / CRD_FILE).exists(), "crds/ has no KVCachePool CRD: run `make crds`"
    assert sync.stale() == [], "chart copies are stale: run `python charts/kvpool/hack/sync.py --write`"
    assert (CHART / "files" / "crds" / CRD_FILE).read_bytes() == (REPO / "crds" / CRD_FILE).read_bytes()


def test_sync_check_detects_a_stale_copy(tmp_path):
    """The guard itself: a changed crds/ file makes --check report the chart copy."""
    sync = load_sync_module()
    repo = tmp_path / "repo"
    (repo / "crds").mkdir(parents=True)
    (repo / "charts" / "kvpool" / "files" / "crds").mkdir(parents=True)
    (repo / "charts" / "kvpool" / "health").mkdir(parents=True)
    (repo / "charts" / "kvpool" / "health" / "kvcachepool.lua").write_text("return {}\n")
    (repo / "crds" / CRD_FILE).write_text("new: 1\n")
    (repo / "charts" / "kvpool" / "files" / "crds" / CRD_FILE).write_text("old: 1\n")
    (repo / "charts" / "kvpool" / "files" / "crds" / "gone.yaml").write_text("orphan: 1\n")
    (repo / "charts" / "kvpool" / "values.schema.json").write_text('{"properties": {"examplePool": {"properties": '
                                                                    '{"spec": {"type": "object"}}}}}\n')
    stale = {p.relative_to(repo).as_posix() for p in sync.stale(repo)}
    assert "charts/kvpool/values.schema.json" in stale  # examplePool.spec not checked against the CRD
    assert f"charts/kvpool/files/crds/{CRD_FILE}" in stale
    assert "charts/kvpool/files/crds/gone.yaml" in stale
    assert "examples/gitops/argocd/argocd-cm-health.yaml" in stale


def test_rendered_crd_is_the_generated_crd_plus_release_metadata():
    generated = yaml.safe_load((REPO / "crds" / CRD_FILE).read_text())
    rendered = _rendered_crd()
    assert rendered["spec"] == generated["spec"]
    assert rendered["metadata"]["name"] == generated["metadata"]["name"]
    labels = rendered["metadata"]["labels"]
    assert labels["app.kubernetes.io/managed-by"] == "Helm"
    assert generated["metadata"].get("labels", {}).items() <= labels.items()
    annotations = rendered["metadata"]["annotations"]
    assert annotations["helm.sh/resource-policy"] == "keep"
    assert set(annotations["argocd.argoproj.io/sync-options"].split(",")) == {"Prune=false", "Delete=false"}


def test_crd_keep_can_be_turned_off_and_install_skipped():
    meta = _rendered_crd({"crds.keep": False})["metadata"]
    assert "helm.sh/resource-policy" not in meta.get("annotations", {})
    assert not [d for d in render({"crds.install": False}) if d["kind"] == "CustomResourceDefinition"]


def test_crd_is_an_upgradable_release_manifest_not_a_crds_dir_file():
    assert not (CHART / "crds").exists(), "files in a chart's crds/ are never upgraded by Helm"
    # --skip-crds only affects crds/: the CRD still renders, including for upgrades.
    upgrade = helm("template", "kvpool", str(CHART), "--is-upgrade", "--skip-crds").stdout
    docs = [d for d in yaml.safe_load_all(upgrade) if d]
    assert one([d for d in docs if d["kind"] == "CustomResourceDefinition"], "CustomResourceDefinition")
    # It is in the release manifest (what helm upgrade diffs and applies), not a hook.
    install = helm("install", "kvpool", str(CHART), "--dry-run=client", "--namespace", "kvpool-system").stdout
    manifest = install.split("MANIFEST:", 1)[1].split("NOTES:", 1)[0]
    assert "name: kvcachepools.kvpool.dev" in manifest
    assert "helm.sh/hook" not in yaml.safe_dump(_rendered_crd())


def test_a_changed_crd_changes_the_rendered_upgrade(tmp_path):
    """Regenerating the CRD (new field) flows into the next `helm upgrade` render."""
    chart = tmp_path / "kvpool"
    shutil.copytree(CHART, chart)
    crd_path = chart / "files" / "crds" / CRD_FILE
    crd = yaml.safe_load(crd_path.read_text())
    changed = copy.deepcopy(crd)
    spec_props = changed["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    spec_props["newField"] = {"type": "string", "description": "added in the next release"}
    crd_path.write_text(yaml.safe_dump(changed))
    out = helm("template", "kvpool", str(chart), "--is-upgrade", "-s", "templates/crd.yaml").stdout
    rendered = yaml.safe_load(out)
    props = rendered["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert props["newField"]["description"] == "added in the next release"
