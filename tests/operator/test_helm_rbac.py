"""The chart's RBAC is exactly the operator's one list, kvpool_operator.rbac.rules_for(settings),
and docs/helm.md's table says what it is.

Namespaced mode (the default) splits the list: the cluster-scoped resources (kopf's CRD discovery,
namespaces, cluster peering) stay in a ClusterRole, the rest goes into a Role in each watched
namespace (the release namespace when none is listed), and together they grant exactly the list.
Cluster-wide mode (opt-in) renders it verbatim into one ClusterRole. Either way the chart ships the
routers' discovery ClusterRole, which the operator may `bind` and nothing else.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from kvpool_dev.golden import GOLDEN_SETTINGS
from kvpool_operator import rbac
from kvpool_operator.render import render as render_pool
from kvpool_operator.settings import Settings
from tests.operator.chartkit import CHART, REPO, by_kind, load_sync_module, one, render

WATCHED = ["team-a", "team-b"]
CLUSTER_WIDE = {"watch.allNamespaces": True}
DISCOVERY_ROLE = "kvpool-router-discovery"  # <fullname>-router-discovery of release `kvpool`
CHART_SETTINGS = Settings(router_discovery_role=DISCOVERY_ROLE)


def triples(rules: list[dict]) -> set[tuple]:
    """(apiGroup, resource, verb, resourceNames or None) grants of a rule list."""
    return {(g, r, v, tuple(rule["resourceNames"]) if "resourceNames" in rule else None)
            for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def test_chart_rbac_file_is_generated_from_the_operator_list():
    sync = load_sync_module()
    want = sync.rbac_yaml(rbac.RBAC_RULES, rbac.CLUSTER_SCOPED, rbac.USER_ROLES, rbac.OPTIONAL_RULES,
                          rbac.ROUTER_DISCOVERY_RULES, rbac.router_binding_rule(sync.ROUTER_ROLE_PLACEHOLDER))
    assert (CHART / "files" / "rbac.yaml").read_text() == want, "run `python charts/kvpool/hack/sync.py --write`"


def operator_role(docs: list[dict]) -> dict:
    (role,) = [d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["labels"].get(
        "app.kubernetes.io/component") == "operator"]
    return role


def test_cluster_wide_mode_grants_exactly_the_operator_rules():
    docs = render(CLUSTER_WIDE)
    role = operator_role(docs)
    assert role["rules"] == rbac.rules_for(CHART_SETTINGS)
    assert not by_kind(docs, "Role") and not by_kind(docs, "RoleBinding")
    binding = one(docs, "ClusterRoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    sa = one(docs, "ServiceAccount")["metadata"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["name"], "namespace": sa["namespace"]}]
    assert one(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == sa["name"]


@pytest.mark.parametrize("values,watched", [({"watch.namespaces": WATCHED}, WATCHED), ({}, ["kvpool-system"])],
                         ids=["listed", "default-release-namespace"])
def test_namespaced_mode_splits_the_list_without_adding_or_losing_a_grant(values, watched):
    docs = render(values)
    cluster_role = operator_role(docs)
    roles = by_kind(docs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == watched
    for role in roles:
        assert role["rules"] == roles[0]["rules"]
        assert not {(g, r) for g, r, _, _ in triples(role["rules"])} & rbac.CLUSTER_SCOPED
    assert {(g, r) for g, r, _, _ in triples(cluster_role["rules"])} <= rbac.CLUSTER_SCOPED
    assert triples(cluster_role["rules"]) | triples(roles[0]["rules"]) == triples(rbac.rules_for(CHART_SETTINGS))
    assert not triples(cluster_role["rules"]) & triples(roles[0]["rules"])
    sa = one(docs, "ServiceAccount")["metadata"]
    for binding in by_kind(docs, "RoleBinding"):
        assert binding["roleRef"]["kind"] == "Role"
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["name"], "namespace": sa["namespace"]}]
    assert sorted(b["metadata"]["namespace"] for b in by_kind(docs, "RoleBinding")) == watched


@pytest.mark.parametrize("values", [{}, CLUSTER_WIDE], ids=["namespaced", "cluster-wide"])
def test_the_routers_discovery_role_is_shipped_and_the_operator_may_bind_only_it(values):
    """The ClusterRole holds exactly what vllm-router's discovery uses; the operator is told its name
    (KVPOOL_ROUTER_DISCOVERY_ROLE) and may `bind` it, and no other role, wherever it reconciles."""
    docs = render(values, release="ml")
    (discovery,) = [d for d in by_kind(docs, "ClusterRole") if d["metadata"]["name"] == "ml-kvpool-router-discovery"]
    assert discovery["rules"] == rbac.ROUTER_DISCOVERY_RULES
    env = {
        e["name"]: e.get("value") for e in one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["KVPOOL_ROUTER_DISCOVERY_ROLE"] == "ml-kvpool-router-discovery"
    holders = by_kind(docs, "Role") or [operator_role(docs)]
    for role in holders:
        binds = [t for t in triples(role["rules"]) if t[2] in ("bind", "escalate")]
        assert binds == [("rbac.authorization.k8s.io", "clusterroles", "bind", ("ml-kvpool-router-discovery",))]


def test_split_rules_splits_a_mixed_rule():
    split_rules = load_sync_module().split_rules
    rule = {"apiGroups": ["kopf.dev"], "resources": ["clusterkopfpeerings", "kopfpeerings"], "verbs": ["get", "patch"]}
    cluster, namespaced = split_rules([rule], {("kopf.dev", "clusterkopfpeerings")})
    assert cluster == [{"apiGroups": ["kopf.dev"], "resources": ["clusterkopfpeerings"], "verbs": ["get", "patch"]}]
    assert namespaced == [{"apiGroups": ["kopf.dev"], "resources": ["kopfpeerings"], "verbs": ["get", "patch"]}]


def test_rbac_create_false_renders_no_rbac():
    docs = render({"rbac.create": False, "rbac.aggregateRoles": False})
    assert not [d for d in docs if d["apiVersion"].startswith("rbac.authorization.k8s.io")]
    docs = render({"rbac.create": False})  # the people's roles do not depend on the operator's
    assert sorted(d["metadata"]["name"] for d in docs if d["kind"] == "ClusterRole") == [
        "kvpool-pools-admin", "kvpool-pools-view"]


@pytest.mark.parametrize("values", [CLUSTER_WIDE, {"watch.namespaces": WATCHED}], ids=["cluster-wide", "namespaced"])
def test_people_get_pools_through_admin_and_view_never_edit(values):
    roles = {d["metadata"]["name"]: d for d in render(values) if d["kind"] == "ClusterRole"}
    admin, view = roles["kvpool-pools-admin"], roles["kvpool-pools-view"]
    aggregation = "rbac.authorization.k8s.io/aggregate-to-"
    assert {k: v for k, v in admin["metadata"]["labels"].items() if k.startswith(aggregation)} == {
        aggregation + "admin": "true"}
    assert {k: v for k, v in view["metadata"]["labels"].items() if k.startswith(aggregation)} == {
        aggregation + "view": "true"}
    assert not [r for r in roles.values() if aggregation + "edit" in r["metadata"]["labels"]]
    assert admin["rules"] == rbac.POOL_ADMIN_RULES and view["rules"] == rbac.POOL_VIEWER_RULES
    assert triples(admin["rules"]) == {("kvpool.dev", "kvcachepools", v, None) for v in (
        "get", "list", "watch", "create", "update", "patch", "delete", "deletecollection")} | {
        ("kvpool.dev", "kvcachepools/scale", v, None) for v in ("get", "update", "patch")} | {
        ("kvpool.dev", "kvcachepools/status", "get", None)}
    assert {v for _, _, v, _ in triples(view["rules"])} == {"get", "list", "watch"}  # read only
    assert {g for g, _, _, _ in triples(admin["rules"] + view["rules"])} == {"kvpool.dev"}  # pools, nothing else


def _plural(kind: str) -> str:
    low = kind.lower()
    return low[:-1] + "ies" if low.endswith("y") else low + "s"


EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_watched_namespace_role_covers_every_child_the_operator_renders(example: Path):
    """What the operator server-side applies and prunes in a watched namespace, the Role allows."""
    # the chart's opt-in rules follow the operator setting that lets pools render those kinds
    values = {"watch.namespaces": WATCHED, "operator.settings.inferencePools": GOLDEN_SETTINGS.inference_pools,
              "operator.settings.keda": GOLDEN_SETTINGS.keda}
    role = by_kind(render(values), "Role")[0]
    grants = triples(role["rules"])
    for pool in yaml.safe_load_all(example.read_text()):
        if not pool:
            continue
        for child in render_pool(pool, GOLDEN_SETTINGS, "team-a"):
            group = child["apiVersion"].rpartition("/")[0]
            read = "get" if child["kind"] == "Secret" else "list"  # Secrets by name, the rest by label
            for verb in (read, "create", "patch", "delete"):
                assert (group, _plural(child["kind"]), verb, None) in grants, f"{child['kind']} {verb}"


def test_examples_exist_for_the_coverage_check():
    assert len(EXAMPLES) >= 5


@pytest.mark.parametrize("namespaced", [False, True], ids=["cluster-wide", "namespaced"])
def test_opt_in_rules_only_with_their_setting(namespaced: bool):
    """inferencepools: granted when operator.settings.inferencePools is on, absent otherwise."""
    base = {"watch.namespaces": WATCHED} if namespaced else CLUSTER_WIDE
    kind = "Role" if namespaced else "ClusterRole"

    def grants(values: dict) -> set:
        roles = [r for r in by_kind(render(values), kind) if "rules" in r and "aggregate" not in r["metadata"]["name"]]
        return {t for r in roles for t in triples(r["rules"])}

    ip = {t for t in grants({**base, "operator.settings.inferencePools": True})
          if t[1] == "inferencepools"}
    assert ip == {("inference.networking.k8s.io", "inferencepools", v, None)
                  for v in ("get", "list", "create", "patch", "delete")}
    assert not {t for t in grants(base) if t[1] == "inferencepools"}


def docs_rbac_table() -> dict[str, tuple[set[str], str]]:
    """docs/helm.md's table of the operator's verbs: resource -> (verbs, the verbs cell)."""
    text = (REPO / "docs" / "helm.md").read_text()
    table = text.split("| resource | verbs | why |", 1)[1].split("\n\n", 1)[0]
    out: dict[str, tuple[set[str], str]] = {}
    for line in table.strip().splitlines()[1:]:  # below the header's separator
        resources, verbs, _why = [cell.strip() for cell in line.strip().strip("|").split("|")]
        for resource in re.findall(r"`([^`]+)`", resources):
            assert resource not in out, f"{resource} is in two rows"
            out[resource] = ({v.strip() for v in verbs.split("(")[0].split(",")}, verbs)
    return out


def test_docs_rbac_table_is_what_the_operator_is_granted():
    """Every resource and verb docs/helm.md lists is granted, and every grant is listed; the one
    named grant says which name, the opt-in one which setting."""
    table = docs_rbac_table()
    rules = rbac.rules_for(Settings(inference_pools=True, keda=True))
    granted: dict[str, set[str]] = {}
    for _, resource, verb, _ in triples(rules):
        granted.setdefault(resource, set()).add(verb)
    assert {r: verbs for r, (verbs, _) in table.items()} == granted
    for _, resource, _, names in triples(rules):
        if names:
            assert "resourceNames" in table[resource][1] and "<fullname>-router-discovery" in table[resource][1]
    for rule in [r for rules in rbac.OPTIONAL_RULES.values() for r in rules]:
        for resource in rule["resources"]:
            assert "operator.settings." in table[resource][1], resource
