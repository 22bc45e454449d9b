"""Pure parts of reconciliation: subset comparison, planning, owner references, secrets."""

from __future__ import annotations

import base64

from kvpool_operator.reconcile.children import (
    HANDOVER_MANAGER,
    is_subset,
    key_of,
    owner_reference,
    plan,
    replicas_handover,
    with_owner,
)
from kvpool_operator.reconcile.secrets import SecretAction, generated_values, plan_secret
from kvpool_operator.render import render
from kvpool_operator.render.secrets import generate_keys, generated_secret_names
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
    """As the API would return the rendered children: generated Secrets hold their keys."""
    out = {}
    for m in manifests:
        obj = with_owner(m, {"uid": uid})
        if m["kind"] == "Secret":
            obj["data"] = {k: base64.b64encode(b"x" * 32).decode() for k in generate_keys(m)}
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


def _redis_secret(settings):
    secret = next(m for m in render(load_example("tiered-full"), settings) if m["kind"] == "Secret"
                  and m["metadata"]["name"] == "tiered-full-redis")
    return with_owner(secret, {"uid": "u1"})


def _labelled(secret, **fields):
    return {"metadata": {"name": secret["metadata"]["name"], "labels": dict(secret["metadata"]["labels"]),
                         "ownerReferences": [{"uid": "u1"}]}, **fields}


def test_generated_secret_is_created_only_when_absent_and_never_rewritten(settings):
    secret = _redis_secret(settings)
    keys = tuple(generate_keys(secret))
    assert plan_secret(secret, None, "tiered-full") == SecretAction(secret, create=True, add_keys=keys)
    complete = _labelled(secret, data={k: "b2xk" for k in keys})
    assert plan_secret(secret, complete, "tiered-full") is None  # values are never re-applied
    steps = plan([secret], {("v1", "Secret", "tiered-full-redis"): complete}, "u1")
    assert steps.apply == [] and steps.secrets == [] and steps.unchanged == [("v1", "Secret", "tiered-full-redis")]


def test_labelled_secret_is_adopted_and_completed_never_overwritten(settings):
    secret = _redis_secret(settings)
    keys = generate_keys(secret)
    partial = _labelled(secret, stringData={keys[0]: "kept"})
    partial["metadata"]["ownerReferences"] = []
    action = plan_secret(secret, partial, "tiered-full")
    assert action == SecretAction(secret, create=False, add_keys=tuple(keys[1:]), adopt=True)
    assert keys[0] not in action.add_keys  # the value someone set stays


def test_someone_elses_secret_is_a_conflict_and_left_alone(settings):
    secret = _redis_secret(settings)
    foreign = {"metadata": {"name": "tiered-full-redis", "labels": {"app": "mine"}}, "data": {"password": "eA=="}}
    message = plan_secret(secret, foreign, "tiered-full")
    assert isinstance(message, str) and "'tiered-full-redis' exists but is not labelled" in message
    other_pool = _labelled(secret, data={"password": "eA=="})
    other_pool["metadata"]["labels"]["kvpool.dev/pool"] = "another-pool"
    assert isinstance(plan_secret(secret, other_pool, "tiered-full"), str)
    steps = plan([secret], {("v1", "Secret", "tiered-full-redis"): foreign}, "u1")
    assert steps.conflicts and steps.apply == [] and steps.secrets == [] and steps.prune == []


def test_an_apply_goes_only_over_the_pools_own_objects(settings):
    """Someone else's object at a child's name is a conflict, never applied over (a forced
    server-side apply would take it over); one labelled as the pool's child and owned by nothing
    (restored from a backup, orphaned) is adopted."""
    rendered = render(load_example("tiered-full"), settings)
    desired = [with_owner(m, {"uid": "u1"}) for m in rendered]
    live = _live(rendered, "u1")
    key = ("v1", "ConfigMap", "tiered-full-kvpool")
    ours = live[key]

    live[key] = {"metadata": {"name": "tiered-full-kvpool"}, "data": {"mine": "1"}}
    steps = plan(desired, live, "u1")
    assert steps.conflicts == [
        "ConfigMap/tiered-full-kvpool exists and is not this pool's (not labelled kvpool.dev/pool=tiered-full, "
        "owned by nothing): the operator never takes over an object it did not create; delete or rename it"]
    assert key not in [key_of(m) for m in steps.apply]

    left_over = {"kind": "KVCachePool", "name": "tiered-full", "uid": "u0"}  # a deleted pool of the same name
    live[key] = {**ours, "metadata": {**ours["metadata"], "ownerReferences": [left_over]}}
    (conflict,) = plan(desired, live, "u1").conflicts
    assert conflict.startswith("ConfigMap/tiered-full-kvpool exists and is not this pool's (owned by "
                               "KVCachePool/tiered-full (uid u0))")

    live[key] = {**ours, "metadata": {k: v for k, v in ours["metadata"].items() if k != "ownerReferences"}}
    steps = plan(desired, live, "u1")
    assert steps.conflicts == [] and [key_of(m) for m in steps.apply] == [key]


def test_generated_values_have_the_form_their_consumers_need():
    first = generated_values(["password", "accessKey", "hashSeed"])
    assert len(first["password"]) >= 32 and first["accessKey"].startswith("kvpool-")
    assert 0 <= int(first["hashSeed"]) < 2**32 and first["hashSeed"] == str(int(first["hashSeed"]))
    assert generated_values(["password"])["password"] != first["password"]


def test_every_rendered_secret_has_a_name_the_operator_reads(settings):
    """The operator cannot list Secrets: each one it renders must be among the names it reads."""
    from tests.operator.conftest import example_ids

    for name in example_ids():
        pool = load_example(name)
        for m in render(pool, settings):
            if m["kind"] == "Secret":
                assert m["metadata"]["name"] in generated_secret_names(pool["metadata"]["name"])


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


def test_a_secret_the_spec_names_is_never_pruned(settings):
    """Switching to keysSecretRef: <name>-kvpool-keys keeps the generated Secret as the user's own."""
    pool = load_example("tiered-emptydir")
    live = _live(render(pool, settings), "u1")
    pool["spec"]["security"] = {"keysSecretRef": {"name": "tiered-emptydir-kvpool-keys"}}
    desired = [with_owner(m, {"uid": "u1"}) for m in render(pool, settings)]
    key = ("v1", "Secret", "tiered-emptydir-kvpool-keys")
    assert plan(desired, live, "u1").prune == [key]  # no longer rendered, owned: pruned...
    assert plan(desired, live, "u1", keep=frozenset({key})).prune == []  # ...unless the spec uses it


class _RacedKube(_ListingKube):
    """A cluster where every generated Secret appears between reading and creating it."""

    def __init__(self) -> None:
        super().__init__()
        self.applied: list[str] = []

    def get(self, api_version, kind, namespace, name):
        if name == "hf-token":  # the user's Secret tiered-full names (its Hugging Face token) exists
            return {"metadata": {"name": name}, "data": {"token": "aGZfeHh4"}}
        return None

    def create(self, manifest):
        from kubernetes.client import ApiException

        raise ApiException(status=409, reason="Conflict")

    def apply(self, manifest):
        self.applied.append(manifest["kind"])
        return manifest


def test_a_secret_created_meanwhile_is_not_an_error(settings):
    """The drift timer runs beside the create handler: both may try to create a Secret; the loser
    gets 409, which is neither an error (no Degraded, no ApplyFailed) nor a reason to overwrite."""
    from kvpool_operator.reconcile.children import reconcile

    pool = {**load_example("tiered-full"), "metadata": {"name": "tiered-full", "namespace": "ml", "uid": "u1",
                                                         "generation": 1}}
    kube = _RacedKube()
    outcome = reconcile(kube, pool, settings, "2026-01-01T00:00:00Z")
    assert outcome.errors == [] and not [a for a in outcome.applied if "Secret" in a]
    assert "Deployment" in kube.applied and outcome.status["phase"] != "Degraded"


def test_every_api_call_is_bounded_in_time():
    """A silent API server must not hold a handler thread (and kopf's shutdown) forever."""
    from kvpool_operator.kube import TIMEOUT, Kube

    seen = {}

    class Recorder:
        def call_api(self, *args, **kwargs):
            seen.update(kwargs)
            return {}

    Kube(Recorder()).get("v1", "Secret", "ml", "x")
    assert seen["_request_timeout"] == TIMEOUT and all(0 < t <= 30 for t in TIMEOUT)


def _managed(*managers: str) -> list[dict]:
    """metadata.managedFields as the API server writes them, each manager owning spec.replicas."""
    return [{"manager": m, "operation": "Apply" if m != "kube-controller-manager" else "Update",
             "apiVersion": "apps/v1", "fieldsType": "FieldsV1",
             "fieldsV1": {"f:spec": {"f:replicas": {}, "f:template": {}}}} for m in managers]


def test_replicas_are_handed_to_the_autoscaler_before_the_operator_stops_applying_them(settings):
    """spec.autoscaling turned on for a running pool: while the operator is the one owner of the
    Deployment's replicas, a co-owner (HANDOVER_MANAGER) applies the live count first, so that
    the operator's apply without replicas does not reset them to 1. Nothing to hand over when
    someone else owns them too, nor while the operator still applies replicas."""
    pool = load_example("tiered-autoscaling")
    (scaled,) = [m for m in render(pool, settings, "ml") if m["kind"] == "Deployment"]
    assert "replicas" not in scaled["spec"]
    live = {"metadata": {"name": scaled["metadata"]["name"], "managedFields": _managed("kvpool-operator")},
            "spec": {"replicas": 3}}
    assert replicas_handover(scaled, live) == {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "tiered-autoscaling", "namespace": "ml"}, "spec": {"replicas": 3}}
    for others in (_managed("kvpool-operator", HANDOVER_MANAGER), _managed(HANDOVER_MANAGER), [],
                   _managed("kvpool-operator", "kube-controller-manager")):
        assert replicas_handover(scaled, {**live, "metadata": {"managedFields": others}}) is None
    assert replicas_handover(scaled, None) is None  # created without replicas: nothing to keep
    pool["spec"].pop("autoscaling")
    (fixed,) = [m for m in render(pool, settings, "ml") if m["kind"] == "Deployment"]
    assert replicas_handover(fixed, live) is None  # the operator applies replicas itself
