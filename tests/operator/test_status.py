"""status.compute_status: phases, kstatus conditions, stable transition times."""

from __future__ import annotations

from kvpool_operator.status import CONDITION_TYPES, Observation, compute_status

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def dep(ready: int, updated: int, generation: int = 2, observed: int = 2, conditions=()):
    return {
        "metadata": {"generation": generation},
        "status": {"replicas": updated, "readyReplicas": ready, "updatedReplicas": updated,
                   "observedGeneration": observed, "conditions": list(conditions)},
    }


def sts(ready: int):
    return {"spec": {"replicas": 1}, "status": {"readyReplicas": ready}}


def obs(**kw):
    base = dict(generation=5, desired_replicas=2, selector="s")
    return Observation(**{**base, **kw})


def conds(status):
    return {c["type"]: c for c in status["conditions"]}


def test_ready_when_engines_and_backends_are_ready():
    s = compute_status(obs(deployment=dep(2, 2), backends={"redis": sts(1)}), T0)
    assert s["phase"] == "Ready" and s["observedGeneration"] == 5 and s["readyReplicas"] == 2
    c = conds(s)
    assert set(c) == set(CONDITION_TYPES)
    assert c["Ready"]["status"] == "True" and c["Reconciling"]["status"] == "False"
    assert c["Stalled"]["status"] == "False" and c["BackendsReady"]["status"] == "True"
    assert all(x["observedGeneration"] == 5 for x in c.values())


def test_pending_then_progressing_then_ready():
    s = compute_status(obs(deployment=None), T0)
    assert s["phase"] == "Pending" and conds(s)["Reconciling"]["status"] == "True"
    s = compute_status(obs(deployment=dep(1, 2), previous=s), T1)
    assert s["phase"] == "Progressing" and "1/2 engines ready" in conds(s)["Progressing"]["message"]
    s = compute_status(obs(deployment=dep(2, 2), previous=s), T1)
    assert s["phase"] == "Ready"


def test_backends_not_ready_block_ready():
    s = compute_status(obs(deployment=dep(2, 2), backends={"redis": sts(0), "minio": None}), T0)
    assert s["phase"] != "Ready"
    assert conds(s)["BackendsReady"]["status"] == "False"
    assert "minio 0/1 ready" in conds(s)["BackendsReady"]["message"]


def test_degraded_after_ready_and_on_deadline():
    ready = compute_status(obs(deployment=dep(2, 2)), T0)
    s = compute_status(obs(deployment=dep(1, 2), previous=ready), T1)
    assert s["phase"] == "Degraded" and conds(s)["Degraded"]["status"] == "True"
    stuck = dep(1, 1, conditions=[{"type": "Progressing", "reason": "ProgressDeadlineExceeded"}])
    s = compute_status(obs(deployment=stuck), T1)
    assert s["phase"] == "Degraded" and conds(s)["Stalled"]["status"] == "True"


def test_stale_deployment_generation_is_not_ready():
    s = compute_status(obs(deployment=dep(2, 2, generation=3, observed=2)), T0)
    assert s["phase"] != "Ready"


def test_invalid_and_apply_errors():
    s = compute_status(obs(invalid="spec.tiers.cpu.size: must be a positive size"), T0)
    c = conds(s)
    assert s["phase"] == "Invalid" and c["ConfigValid"]["status"] == "False"
    assert c["ConfigValid"]["message"] == "spec.tiers.cpu.size: must be a positive size"
    assert c["Ready"]["reason"] == "InvalidSpec" and c["Stalled"]["status"] == "True"
    s = compute_status(obs(deployment=dep(2, 2), apply_errors=("StatefulSet/x: 422 Invalid",)), T0)
    assert s["phase"] == "Degraded" and conds(s)["Degraded"]["reason"] == "ApplyFailed"


def test_transition_time_kept_while_status_unchanged():
    first = compute_status(obs(deployment=dep(2, 2)), T0)
    again = compute_status(obs(deployment=dep(2, 2), previous=first), T1)
    assert conds(again)["Ready"]["lastTransitionTime"] == T0
    broken = compute_status(obs(deployment=dep(0, 2), previous=again), T1)
    assert conds(broken)["Ready"]["lastTransitionTime"] == T1


def test_zero_replicas_is_ready():
    s = compute_status(obs(desired_replicas=0, deployment=dep(0, 0)), T0)
    assert s["phase"] == "Ready"


def test_endpoints_in_status_never_carry_credentials_or_queries():
    from kvpool_operator.status import public_url

    s = compute_status(obs(endpoints={"redis": "rediss://u:pw@r.example:6380/1?password=pw#x", "s3": "", "openai":
                                      "http://p.ns.svc:8000"}), T0)
    assert s["endpoints"] == {"redis": "rediss://r.example:6380/1", "s3": "", "openai": "http://p.ns.svc:8000"}
    assert public_url("https://AKIA:secret@[::1]:9000/b?X-Amz-Signature=s") == "https://[::1]:9000/b"


def test_insecure_external_backends_are_a_warning_not_an_error():
    warning = "spec.tiers.redis.external.url: redis:// sends the cache and the password in cleartext; use rediss://"
    s = compute_status(obs(deployment=dep(2, 2), insecure=(warning,)), T0)
    c = conds(s)
    assert c["BackendsSecure"]["status"] == "False" and c["BackendsSecure"]["reason"] == "InsecureBackend"
    assert c["BackendsSecure"]["message"] == warning
    assert s["phase"] == "Ready"  # it works; the condition and an Event say it is exposed
    assert conds(compute_status(obs(deployment=dep(2, 2)), T0))["BackendsSecure"]["status"] == "True"


def test_insecure_backends_name_what_is_missing():
    from kvpool_operator.models import parse_spec
    from kvpool_operator.policy import insecure_backends
    from tests.operator.conftest import load_example

    spec = load_example("tiered-external")["spec"]
    assert [w.split(":")[0] for w in insecure_backends(parse_spec(spec))] == ["spec.tiers.redis.external.url"]
    spec["tiers"]["redis"]["external"] = {"url": "rediss://r:6380/0"}
    spec["tiers"]["s3"]["external"]["endpoint"] = "http://minio.infra:9000"
    assert [w.split(":")[0] for w in insecure_backends(parse_spec(spec))] == [
        "spec.tiers.redis.external", "spec.tiers.s3.external.endpoint"]
    spec["tiers"]["redis"]["external"]["passwordSecretRef"] = {"name": "r", "key": "p"}
    spec["tiers"]["s3"]["external"]["endpoint"] = "https://s3.example"
    assert insecure_backends(parse_spec(spec)) == []


def test_plaintext_managed_backends_are_flagged_too():
    """Managed Redis/MinIO without tls: the NetworkPolicy limits who connects, not who reads the pod
    network, so the cache (and the engines' credentials) travel in cleartext: BackendsSecure=False."""
    from kvpool_operator.models import parse_spec
    from kvpool_operator.policy import insecure_backends
    from tests.operator.conftest import load_example

    spec = load_example("tiered-full")["spec"]
    assert [w.split(":")[0] for w in insecure_backends(parse_spec(spec))] == [
        "spec.tiers.redis.managed", "spec.tiers.s3.managed"]
    for tier in ("redis", "s3"):
        spec["tiers"][tier]["managed"]["tls"] = {"secretName": f"{tier}-tls"}
    assert insecure_backends(parse_spec(spec)) == []


def test_an_api_outside_the_cluster_without_a_key_is_a_warning():
    from kvpool_operator.models import parse_spec
    from kvpool_operator.policy import exposure_warnings
    from tests.operator.conftest import load_example

    spec = load_example("tiered-emptydir")["spec"]
    assert exposure_warnings(parse_spec(spec)) == []  # ClusterIP
    for kind in ("LoadBalancer", "NodePort"):
        spec["service"] = {"type": kind}
        (warning,) = exposure_warnings(parse_spec(spec))
        assert warning.startswith(f"spec.service.type: {kind} without apiKeySecretRef")
    spec["service"]["apiKeySecretRef"] = {"name": "api", "key": "token"}
    assert exposure_warnings(parse_spec(spec)) == []


def test_a_size_no_node_holds_is_a_condition_not_a_phase():
    warning = "spec.tiers.cpu.size: Deployment/p requests 1.0Pi of memory per pod, more than any node has"
    s = compute_status(obs(deployment=dep(0, 2), sizes=(warning,)), T0)
    c = conds(s)
    assert c["SizesFit"]["status"] == "False" and c["SizesFit"]["reason"] == "ExceedsNodeMemory"
    assert c["SizesFit"]["message"] == warning and c["ConfigValid"]["status"] == "True"
    assert conds(compute_status(obs(deployment=dep(2, 2)), T0))["SizesFit"]["status"] == "True"


def test_the_reconciler_reports_sizes_no_node_holds(settings):
    """policy.size_warnings from the rendered pods: GPU pods against GPU nodes' memory."""
    from kvpool_operator import validation

    pool = {"apiVersion": "kvpool.dev/v1alpha1", "kind": "KVCachePool", "metadata": {"name": "p"},
            "spec": {"model": {"name": "m"}, "tiers": {"cpu": {"size": "5Ti"}}}}
    [warning] = validation.check(pool, settings).warnings
    assert warning.startswith("spec.tiers.cpu.size: Deployment/p requests 5.0Ti") and "a GPU node" in warning
    pool["spec"]["model"]["gpus"] = 0  # a CPU server may have that much
    assert validation.check(pool, settings).warnings == []
    pool["spec"]["tiers"]["redis"] = {"managed": {"memory": "64Ti"}}
    [warning] = validation.check(pool, settings).warnings
    assert warning.startswith("spec.tiers.redis.managed.memory: StatefulSet/p-redis requests 64.0Ti")


def test_a_reconcile_pass_reports_sizes_fit_and_still_applies(settings):
    """The reconciler runs validation.check: a 5Ti cpu tier on a GPU pool is applied, with
    SizesFit=False naming the field (the pod would stay Pending with nothing else saying why)."""
    from kvpool_operator.reconcile.children import reconcile
    from tests.operator.test_children import _RacedKube

    pool = {"apiVersion": "kvpool.dev/v1alpha1", "kind": "KVCachePool",
            "metadata": {"name": "p", "namespace": "ml", "uid": "u1", "generation": 1},
            "spec": {"model": {"name": "m"}, "tiers": {"cpu": {"size": "5Ti"}}}}
    kube = _RacedKube()
    outcome = reconcile(kube, pool, settings, T0)
    sizes = conds(outcome.status)["SizesFit"]
    assert sizes["status"] == "False"
    assert sizes["message"].startswith("spec.tiers.cpu.size: Deployment/p requests 5.0Ti")
    assert "Deployment" in kube.applied and outcome.invalid is None
