"""RBAC_RULES: exactly the verbs the operator uses, pinned verbatim (the emulator test in
test_operator_e2e.py checks them against the requests the real operator sends)."""

from __future__ import annotations

from kvpool_operator import models
from kvpool_operator.kube import PLURALS
from kvpool_operator.rbac import RBAC_RULES, allows
from kvpool_operator.render import CHILD_KINDS

# (apiGroup, resource) -> verbs. A change here is a change of the operator's privileges: review it.
EXPECTED = {
    (models.GROUP, models.PLURAL): {"get", "list", "watch", "patch"},
    (models.GROUP, f"{models.PLURAL}/status"): {"patch"},
    ("", "secrets"): {"get", "create", "patch", "delete"},
    ("", "configmaps"): {"list", "create", "patch", "delete"},
    ("", "services"): {"list", "create", "patch", "delete"},
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


def grants(rules=RBAC_RULES) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in rules:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


def test_rules_are_policy_rules():
    for rule in RBAC_RULES:
        assert set(rule) == {"apiGroups", "resources", "verbs"}
        assert all(isinstance(rule[k], list) and rule[k] for k in rule)
        assert len(set(rule["verbs"])) == len(rule["verbs"])


def test_rules_grant_exactly_the_expected_verbs():
    assert grants() == EXPECTED


def test_secrets_are_never_listed_or_watched_and_nothing_is_updated():
    assert not allows("", "secrets", "list") and not allows("", "secrets", "watch")
    assert not any("update" in rule["verbs"] or "*" in rule["verbs"] for rule in RBAC_RULES)
    assert not any("*" in rule["resources"] or "*" in rule["apiGroups"] for rule in RBAC_RULES)
    assert not allows("", "pods", "delete")  # nothing beyond what the operator needs


def test_every_child_kind_can_be_applied_and_pruned():
    for api_version, kind in CHILD_KINDS:
        group = api_version.rpartition("/")[0]
        read = "get" if kind == "Secret" else "list"
        for verb in (read, "create", "patch", "delete"):
            assert allows(group, PLURALS[(api_version, kind)], verb), (kind, verb)
