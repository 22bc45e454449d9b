"""RBAC_RULES: exactly the verbs the operator uses, pinned verbatim (the emulator test in
test_operator_e2e.py checks them against the requests the real operator sends)."""

from __future__ import annotations

from kvpool_operator import models
from kvpool_operator.kube import PLURALS
from kvpool_operator.rbac import OPTIONAL_RULES, RBAC_RULES, allows, rules_for
from kvpool_operator.render import CHILD_KINDS, OPTIONAL_KINDS, child_kinds
from kvpool_operator.render.router import DISCOVERY_RULES
from kvpool_operator.settings import Settings

# (apiGroup, resource) -> verbs. A change here is a change of the operator's privileges: review it.
EXPECTED = {
    (models.GROUP, models.PLURAL): {"get", "list", "watch", "patch"},
    (models.GROUP, f"{models.PLURAL}/status"): {"patch"},
    ("", "secrets"): {"get", "create", "patch", "delete"},
    ("", "configmaps"): {"list", "create", "patch", "delete"},
    ("", "services"): {"list", "create", "patch", "delete"},
    ("", "serviceaccounts"): {"list", "create", "patch", "delete"},
    ("rbac.authorization.k8s.io", "roles"): {"list", "create", "patch", "delete"},
    ("rbac.authorization.k8s.io", "rolebindings"): {"list", "create", "patch", "delete"},
    ("", "pods"): {"list", "watch"},  # never used: held to grant them to a pool's router (RBAC escalation)
    ("apps", "deployments"): {"list", "watch", "create", "patch", "delete"},
    ("apps", "statefulsets"): {"list", "watch", "create", "patch", "delete"},
    ("policy", "poddisruptionbudgets"): {"list", "create", "patch", "delete"},
    ("networking.k8s.io", "networkpolicies"): {"list", "create", "patch", "delete"},
    ("", "events"): {"create"},
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
    ("", "namespaces"): {"list", "watch"},
    ("kopf.dev", "clusterkopfpeerings"): {"list", "watch", "patch"},
    ("kopf.dev", "kopfpeerings"): {"list", "watch", "patch"},
}
# Opt-in (chart operator.settings.<key>): granted only together with the setting that uses them.
EXPECTED_OPTIONAL = {
    "inference_pools": {("inference.networking.k8s.io", "inferencepools"): {"list", "create", "patch", "delete"}},
}


def grants(rules=RBAC_RULES) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in rules:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


def test_rules_are_policy_rules():
    for rule in RBAC_RULES + [r for rules in OPTIONAL_RULES.values() for r in rules]:
        assert set(rule) == {"apiGroups", "resources", "verbs"}
        assert all(isinstance(rule[k], list) and rule[k] for k in rule)
        assert len(set(rule["verbs"])) == len(rule["verbs"])


def test_rules_grant_exactly_the_expected_verbs():
    assert grants() == EXPECTED
    assert {key: grants(rules) for key, rules in OPTIONAL_RULES.items()} == EXPECTED_OPTIONAL
    assert grants(rules_for(Settings())) == EXPECTED
    assert grants(rules_for(Settings(inference_pools=True))) == EXPECTED | EXPECTED_OPTIONAL["inference_pools"]


def test_the_operator_holds_every_permission_of_the_roles_it_creates():
    """Kubernetes refuses to create (or bind) a Role granting what its creator lacks."""
    for rule in DISCOVERY_RULES:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    assert allows(group, resource, verb), (group, resource, verb)


def test_optional_kinds_follow_their_setting():
    assert set(child_kinds(Settings())) == set(CHILD_KINDS)
    optional = {kind for kinds in OPTIONAL_KINDS.values() for kind in kinds}
    assert set(child_kinds(Settings(inference_pools=True))) == set(CHILD_KINDS) | optional
    assert set(OPTIONAL_KINDS) == set(OPTIONAL_RULES)
    for setting, kinds in OPTIONAL_KINDS.items():  # every optional kind has the optional rule of its setting
        for api_version, kind in kinds:
            group = api_version.rpartition("/")[0]
            assert not allows(group, PLURALS[(api_version, kind)], "list")
            assert allows(group, PLURALS[(api_version, kind)], "list", OPTIONAL_RULES[setting])


def test_secrets_are_never_listed_or_watched_and_nothing_is_updated():
    assert not allows("", "secrets", "list") and not allows("", "secrets", "watch")
    assert not any("update" in rule["verbs"] or "*" in rule["verbs"] for rule in RBAC_RULES)
    assert not any("*" in rule["resources"] or "*" in rule["apiGroups"] for rule in RBAC_RULES)
    assert not allows("", "pods", "delete") and not allows("", "pods", "get")  # nothing beyond what is needed
    assert not allows("rbac.authorization.k8s.io", "roles", "escalate")
    assert not allows("rbac.authorization.k8s.io", "roles", "bind")
    assert not any(r in rule["resources"] for rule in RBAC_RULES for r in ("clusterroles", "clusterrolebindings"))


def test_every_child_kind_can_be_applied_and_pruned():
    everything = rules_for(Settings(inference_pools=True))
    for api_version, kind in child_kinds(Settings(inference_pools=True)):
        group = api_version.rpartition("/")[0]
        read = "get" if kind == "Secret" else "list"
        for verb in (read, "create", "patch", "delete"):
            assert allows(group, PLURALS[(api_version, kind)], verb, everything), (kind, verb)
