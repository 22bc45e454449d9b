"""RBAC_RULES: exactly the verbs the operator uses, pinned verbatim (the emulator test in
test_operator_e2e.py checks them against the requests the real operator sends)."""

from __future__ import annotations

from kvpool_operator import models
from kvpool_operator.kinds import CHILD_KINDS, enabled
from kvpool_operator.kube import PLURALS
from kvpool_operator.rbac import (
    OPTIONAL_RULES,
    RBAC_RULES,
    ROUTER_DISCOVERY_RULES,
    allows,
    router_binding_rule,
    rules_for,
)
from kvpool_operator.render import render
from kvpool_operator.settings import Settings
from tests.operator.conftest import load_example

# (apiGroup, resource) -> verbs. A change here is a change of the operator's privileges: review it.
EXPECTED = {
    (models.GROUP, models.PLURAL): {"get", "list", "watch", "patch"},
    (models.GROUP, f"{models.PLURAL}/status"): {"patch"},
    ("", "secrets"): {"get", "create", "patch", "delete"},
    ("", "configmaps"): {"get", "list", "create", "patch", "delete"},
    ("", "services"): {"get", "list", "create", "patch", "delete"},
    ("", "serviceaccounts"): {"get", "list", "create", "patch", "delete"},
    ("rbac.authorization.k8s.io", "rolebindings"): {"get", "list", "create", "patch", "delete"},
    ("apps", "deployments"): {"get", "list", "watch", "create", "patch", "delete"},
    ("apps", "statefulsets"): {"get", "list", "watch", "create", "patch", "delete"},
    ("policy", "poddisruptionbudgets"): {"get", "list", "create", "patch", "delete"},
    ("networking.k8s.io", "networkpolicies"): {"get", "list", "create", "patch", "delete"},
    # the engines' HorizontalPodAutoscaler (spec.autoscaling without KEDA); listed in every pass so that
    # one left from before the operator's keda setting was turned on is pruned
    ("autoscaling", "horizontalpodautoscalers"): {"get", "list", "create", "patch", "delete"},
    ("", "events"): {"create"},
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
    ("", "namespaces"): {"list", "watch"},
    ("kopf.dev", "clusterkopfpeerings"): {"list", "watch", "patch"},
    ("kopf.dev", "kopfpeerings"): {"list", "watch", "patch"},
}
# Opt-in (chart operator.settings.<key>): granted only together with the setting that uses them.
EXPECTED_OPTIONAL = {
    "inference_pools": {("inference.networking.k8s.io", "inferencepools"): {"get", "list", "create", "patch",
                                                                            "delete"}},
    "keda": {("keda.sh", "scaledobjects"): {"get", "list", "create", "patch", "delete"}},
}


def grants(rules=RBAC_RULES) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in rules:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


# The one named grant: binding the routers' discovery ClusterRole (and no other) in a watched namespace.
BIND = {("rbac.authorization.k8s.io", "clusterroles"): {"bind"}}


def test_rules_are_policy_rules():
    for rule in RBAC_RULES + [r for rules in OPTIONAL_RULES.values() for r in rules]:
        assert set(rule) == {"apiGroups", "resources", "verbs"}
        assert all(isinstance(rule[k], list) and rule[k] for k in rule)
        assert len(set(rule["verbs"])) == len(rule["verbs"])
    assert router_binding_rule("r") == {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["clusterroles"],
                                        "verbs": ["bind"], "resourceNames": ["r"]}


def test_rules_grant_exactly_the_expected_verbs():
    assert grants() == EXPECTED
    assert {key: grants(rules) for key, rules in OPTIONAL_RULES.items()} == EXPECTED_OPTIONAL
    assert grants(rules_for(Settings())) == EXPECTED | BIND
    assert grants(rules_for(Settings(inference_pools=True))) == EXPECTED | BIND | EXPECTED_OPTIONAL["inference_pools"]
    assert grants(rules_for(Settings(keda=True))) == EXPECTED | BIND | EXPECTED_OPTIONAL["keda"]


def test_the_router_is_bound_to_the_one_clusterrole_the_operator_may_bind():
    """Kubernetes lets the operator create a RoleBinding only to a role whose permissions it holds
    itself, or one it may `bind`: the router's binding names exactly the role of that grant, and
    the operator holds none of the role's permissions (no pods access at all)."""
    settings = Settings(router_discovery_role="rel-router-discovery")
    pool = load_example("tiered-router")
    (binding,) = [m for m in render(pool, settings, "ml") if m["kind"] == "RoleBinding"]
    ref = binding["roleRef"]
    assert ref == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "rel-router-discovery"}
    rules = rules_for(settings)
    assert allows("rbac.authorization.k8s.io", "clusterroles", "bind", rules, name=ref["name"])
    assert not allows("rbac.authorization.k8s.io", "clusterroles", "bind", rules, name="admin")
    for rule in ROUTER_DISCOVERY_RULES:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    assert not allows(group, resource, verb, rules), (group, resource, verb)
    assert not [m for m in render(pool, settings, "ml") if m["kind"] in ("Role", "ClusterRole")]


def test_optional_kinds_follow_their_setting():
    always = {k for k in CHILD_KINDS if k.setting is None}
    optional = {k for k in CHILD_KINDS if k.setting is not None}
    assert optional and set(enabled(Settings())) == always
    assert set(enabled(Settings(inference_pools=True, keda=True))) == always | optional
    assert {k.setting for k in optional} == set(OPTIONAL_RULES)
    for kind in optional:  # every optional kind has the optional rule of its setting, and only that
        assert not allows(kind.group, kind.plural, "list")
        assert allows(kind.group, kind.plural, "list", OPTIONAL_RULES[kind.setting])
        assert PLURALS[kind.key] == kind.plural


def test_secrets_are_never_listed_or_watched_and_nothing_is_updated():
    assert not allows("", "secrets", "list") and not allows("", "secrets", "watch")
    assert not any("update" in rule["verbs"] or "*" in rule["verbs"] for rule in RBAC_RULES)
    assert not any("*" in rule["resources"] or "*" in rule["apiGroups"] for rule in RBAC_RULES)
    assert not any(allows("", "pods", verb, rules_for(Settings())) for verb in ("get", "list", "watch", "delete"))
    for resource in ("roles", "clusterroles"):
        assert not allows("rbac.authorization.k8s.io", resource, "escalate", rules_for(Settings()))
        assert not any(allows("rbac.authorization.k8s.io", resource, verb, rules_for(Settings()), name="x")
                       for verb in ("create", "patch", "bind"))
    assert not any(
        r in rule["resources"] for rule in RBAC_RULES for r in ("roles", "clusterroles", "clusterrolebindings")
    )


def test_every_child_kind_can_be_applied_and_pruned():
    everything = rules_for(Settings(inference_pools=True, keda=True))
    for kind in enabled(Settings(inference_pools=True, keda=True)):
        reads = ["get"] if kind.by_name else ["get", "list"]
        for verb in (*reads, "create", "patch", "delete", *(["watch"] if kind.watched else [])):
            assert allows(kind.group, kind.plural, verb, everything), (kind.kind, verb)


def test_every_kind_a_renderer_produces_is_a_child_kind():
    """A new rendered kind must enter kinds.CHILD_KINDS (its RBAC, listing and pruning follow)."""
    # inference_pools and keda on, or off where an example shows that
    from kvpool_dev.golden import golden_settings
    from tests.operator.conftest import example_ids

    rendered = {(m["apiVersion"], m["kind"]) for name in example_ids()
                for m in render(load_example(name), golden_settings(name))}
    assert rendered == {k.key for k in CHILD_KINDS}
