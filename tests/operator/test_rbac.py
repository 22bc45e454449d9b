"""RBAC_RULES cover everything the operator touches, with the verbs it uses."""

from __future__ import annotations

from kvpool_operator import models
from kvpool_operator.kube import PLURALS
from kvpool_operator.rbac import RBAC_RULES, allows
from kvpool_operator.render import CHILD_KINDS


def test_rules_are_policy_rules():
    for rule in RBAC_RULES:
        assert set(rule) == {"apiGroups", "resources", "verbs"}
        assert all(isinstance(rule[k], list) and rule[k] for k in rule)


def test_children_can_be_applied_listed_watched_and_pruned():
    for api_version, kind in CHILD_KINDS:
        group = api_version.rpartition("/")[0]
        for verb in ("get", "list", "watch", "patch", "create", "delete"):
            assert allows(group, PLURALS[(api_version, kind)], verb), (kind, verb)


def test_pools_events_and_kopf_needs():
    assert allows(models.GROUP, models.PLURAL, "watch") and allows(models.GROUP, models.PLURAL, "patch")
    assert allows(models.GROUP, f"{models.PLURAL}/status", "patch")
    assert allows("", "events", "create")
    assert allows("apiextensions.k8s.io", "customresourcedefinitions", "list")
    assert allows("kopf.dev", "kopfpeerings", "patch")
    assert not allows("", "pods", "delete")  # nothing beyond what the operator needs
