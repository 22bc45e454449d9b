"""Pure parts of reconciliation: subset comparison, planning, owner references, secrets."""

from __future__ import annotations

from kvpool_operator.reconcile.children import fill_generated, is_subset, owner_reference, plan, with_owner
from kvpool_operator.render import render
from tests.operator.conftest import load_example


def test_is_subset_ignores_server_defaults_and_normalisation():
    want = {"spec": {"replicas": 2, "template": {"x": [{"a": 1}]}, "env": []},
            "limits": {"nvidia.com/gpu": 1, "memory": "1024Mi"}}
    have = {"spec": {"replicas": 2, "template": {"x": [{"a": 1, "b": 2}]}, "strategy": {}},
            "limits": {"nvidia.com/gpu": "1", "memory": "1Gi"}, "status": {}}
    assert is_subset(want, have)
    assert not is_subset({"spec": {"replicas": 3}}, have)
    assert not is_subset({"spec": {"template": {"x": [{"a": 1}, {"a": 2}]}}}, have)
    assert not is_subset({"a": True}, {"a": "True"})


def _live(manifests, uid):
    out = {}
    for m in manifests:
        obj = with_owner(m, {"uid": uid})
        out[(m["apiVersion"], m["kind"], m["metadata"]["name"])] = obj
    return out


def test_plan_applies_only_differences_and_prunes_owned_leftovers(settings):
    pool = load_example("tiered-full")
    desired = [with_owner(m, {"uid": "u1"}) for m in render(pool, settings)]
    live = _live(render(pool, settings), "u1")
    steps = plan(desired, live, "u1")
    assert steps.apply == [] and steps.prune == [] and len(steps.unchanged) == len(desired)

    del pool["spec"]["tiers"]["redis"]
    pool["spec"]["tiers"]["cpu"]["size"] = "8Gi"
    desired = [with_owner(m, {"uid": "u1"}) for m in render(pool, settings)]
    live[("v1", "ConfigMap", "someone-elses")] = {"metadata": {"name": "someone-elses", "ownerReferences": []}}
    steps = plan(desired, live, "u1")
    assert sorted((m["kind"], m["metadata"]["name"]) for m in steps.apply) == [
        ("ConfigMap", "tiered-full-kvpool"), ("Deployment", "tiered-full"), ("NetworkPolicy", "tiered-full-backends")]
    assert steps.prune == [("apps/v1", "StatefulSet", "tiered-full-redis"), ("v1", "Secret", "tiered-full-redis"),
                           ("v1", "Service", "tiered-full-redis")]


def test_existing_generated_secret_is_never_reapplied(settings):
    pool = load_example("tiered-full")
    desired = render(pool, settings)
    secret = next(m for m in desired if m["kind"] == "Secret")
    live = {("v1", "Secret", secret["metadata"]["name"]): {"metadata": {"name": "x"}, "data": {"password": "b2xk"}}}
    steps = plan([secret], live, "u1")
    assert steps.apply == []
    filled = fill_generated(secret)
    assert len(filled["stringData"]["password"]) >= 32
    assert fill_generated(secret)["stringData"] != filled["stringData"]


def test_owner_reference_shape():
    ref = owner_reference({"metadata": {"name": "p", "uid": "abc"}})
    assert ref == {"apiVersion": "kvpool.dev/v1alpha1", "kind": "KVCachePool", "name": "p", "uid": "abc",
                   "controller": True, "blockOwnerDeletion": True}


class _ListingKube:
    """Just enough of Kube for refresh_status: counts listings, has no children."""

    def __init__(self) -> None:
        self.listings = 0

    def list(self, api_version, kind, namespace, labels):
        self.listings += 1
        return []


def test_refresh_status_writes_nothing_before_the_first_reconcile(settings):
    from kvpool_operator.reconcile.children import refresh_status

    pool = {**load_example("tiered-full"), "metadata": {"name": "tiered-full", "namespace": "ml", "generation": 1}}
    kube = _ListingKube()
    assert refresh_status(kube, pool, settings, "2026-01-01T00:00:00Z") is None
    assert refresh_status(kube, {**pool, "status": {"conditions": []}}, settings, "2026-01-01T00:00:00Z") is None
    assert kube.listings == 0  # not even a read: the reconcile pass comes first

    reconciled = {**pool, "metadata": {**pool["metadata"], "generation": 2}, "status": {"observedGeneration": 1}}
    status = refresh_status(kube, reconciled, settings, "2026-01-01T00:00:00Z")
    assert status is not None and status["observedGeneration"] == 1  # the generation reconciled, not the new one
    assert {c["observedGeneration"] for c in status["conditions"]} == {1}
