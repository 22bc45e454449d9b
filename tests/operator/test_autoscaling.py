"""spec.autoscaling: the HorizontalPodAutoscaler (no KEDA) and the KEDA ScaledObject, each
validated against its real schema (Kubernetes' autoscaling/v2 OpenAPI; KEDA's CRD of a pinned
release, tests/operator/crds/), the engine Deployment left without replicas, the policy on
scaling to zero."""

from __future__ import annotations

import copy

import jsonschema
import pytest

from kvpool_dev.golden import GOLDEN_SETTINGS
from kvpool_operator.render import InvalidPool, render
from kvpool_operator.render.autoscaling import quantity, threshold
from tests.operator.conftest import load_example
from tests.operator.schema_check import validate_child, validate_scaled_object

NO_KEDA = GOLDEN_SETTINGS.model_copy(update={"keda": False})


def one(manifests, kind):
    (found,) = [m for m in manifests if m["kind"] == kind]
    return found


def kinds(manifests):
    return {m["kind"] for m in manifests}


def test_without_keda_an_hpa_on_pods_metrics_owns_the_engines_replicas():
    manifests = render(load_example("tiered-autoscaling"), NO_KEDA, "ml")
    hpa = one(manifests, "HorizontalPodAutoscaler")
    validate_child(hpa)  # Kubernetes' autoscaling/v2 schema, strict
    assert "ScaledObject" not in kinds(manifests)
    target = {"apiVersion": "apps/v1", "kind": "Deployment", "name": "tiered-autoscaling"}
    assert hpa["spec"]["scaleTargetRef"] == target
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 8)
    # named as the prometheus-adapter rules of docs/scaling.md expose them, per-engine averages
    assert [(m["type"], m["pods"]["metric"]["name"], m["pods"]["target"]) for m in hpa["spec"]["metrics"]] == [
        ("Pods", "vllm_num_requests_waiting", {"type": "AverageValue", "averageValue": "3"}),
        ("Pods", "vllm_kv_cache_usage_perc", {"type": "AverageValue", "averageValue": "700m"}),
    ]
    assert "replicas" not in one(manifests, "Deployment")["spec"]  # never applied: the autoscaler's field
    assert "PodDisruptionBudget" in kinds(manifests)  # up to maxReplicas engines


def test_with_keda_a_scaled_object_with_prometheus_triggers():
    manifests = render(load_example("tiered-keda"), GOLDEN_SETTINGS, "ml")
    so = one(manifests, "ScaledObject")
    validate_child(so)  # KEDA v2.20.2's CRD, closed, its CEL rule, its Prometheus scaler's keys
    assert "HorizontalPodAutoscaler" not in kinds(manifests)
    spec = so["spec"]
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (0, 4)
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "tiered-keda"}
    queries = {t["name"]: (t["metadata"]["query"], t["metadata"]["threshold"]) for t in spec["triggers"]}
    pool = 'namespace="ml",kvpool_dev_pool="tiered-keda"'
    assert queries == {
        "waiting-requests": (f"sum(vllm:num_requests_waiting{{{pool}}})", "3"),
        "kv-cache-usage": (f"sum(vllm:kv_cache_usage_perc{{{pool}}})", "0.7"),
        "prompt-tokens-computed": (f"sum(rate(kvpool_prompt_tokens_computed_total{{{pool}}}[2m]))", "2000"),
    }
    assert {t["metadata"]["serverAddress"] for t in spec["triggers"]} == {GOLDEN_SETTINGS.keda_prometheus_address}
    assert all(t["metricType"] == "AverageValue" for t in spec["triggers"])
    # KEDA copies these labels onto its HPA unless excluded: that HPA must not look like a pool child
    excluded = so["metadata"]["annotations"]["scaledobject.keda.sh/hpa-excluded-labels"].split(",")
    assert {"kvpool.dev/pool", "app.kubernetes.io/managed-by"} == set(excluded)
    assert "replicas" not in one(manifests, "Deployment")["spec"]


def test_the_keda_schema_check_is_strict():
    """The vendored CRD check fails on a misspelled field (which the API server would prune), on
    KEDA's own CEL rule and on trigger metadata KEDA's Prometheus scaler does not read."""
    so = one(render(load_example("tiered-keda"), GOLDEN_SETTINGS, "ml"), "ScaledObject")
    typo = copy.deepcopy(so)
    typo["spec"]["minReplicas"] = typo["spec"].pop("minReplicaCount")
    with pytest.raises(jsonschema.ValidationError):
        validate_scaled_object(typo)
    inverted = copy.deepcopy(so)
    inverted["spec"]["minReplicaCount"] = 9
    with pytest.raises(AssertionError, match="minReplicaCount must be less than or equal to maxReplicaCount"):
        validate_scaled_object(inverted)
    unknown = copy.deepcopy(so)
    unknown["spec"]["triggers"][0]["metadata"]["metricName"] = "x"  # removed from KEDA's Prometheus scaler
    with pytest.raises(AssertionError):
        validate_scaled_object(unknown)


def test_native_mode_scales_on_vllms_own_count_of_computed_prompt_tokens():
    pool = load_example("native-shared")
    pool["spec"]["autoscaling"] = {"maxReplicas": 3, "triggers": {"promptTokensComputed": 1500}, "rateWindow": "1m"}
    so = one(render(pool, GOLDEN_SETTINGS, "ml"), "ScaledObject")
    validate_child(so)
    (trigger,) = so["spec"]["triggers"]
    assert trigger["metadata"]["query"] == (
        'sum(rate(vllm:prompt_tokens_by_source_total{namespace="ml",kvpool_dev_pool="native-shared",'
        'source="local_compute"}[1m]))')


def test_scale_to_zero_needs_keda():
    with pytest.raises(InvalidPool, match=r"^spec\.autoscaling\.minReplicas: 0 needs KEDA"):
        render(load_example("tiered-keda"), NO_KEDA, "ml")


def test_without_autoscaling_the_deployment_carries_replicas():
    manifests = render(load_example("tiered-external"), GOLDEN_SETTINGS, "ml")
    assert one(manifests, "Deployment")["spec"]["replicas"] == 3
    assert not kinds(manifests) & {"HorizontalPodAutoscaler", "ScaledObject"}


@pytest.mark.parametrize("value,hpa,keda", [(3, "3", "3"), (0.7, "700m", "0.7"), (2000.5, "2000500m", "2000.5"),
                                            (0.001, "1m", "0.001")])
def test_targets_as_quantities_and_keda_thresholds(value, hpa, keda):
    assert (quantity(value), threshold(value)) == (hpa, keda)


def _by_name(manifests, kind):
    return {m["metadata"]["name"]: m for m in manifests if m["kind"] == kind}


def test_each_pd_role_has_its_own_scaled_object_on_its_own_engines_series():
    manifests = render(load_example("tiered-pd-keda"), GOLDEN_SETTINGS, "ml")
    scalers = _by_name(manifests, "ScaledObject")
    assert set(scalers) == {"tiered-pd-keda", "tiered-pd-keda-prefill"}
    for so in scalers.values():
        validate_child(so)
    pool = 'namespace="ml",kvpool_dev_pool="tiered-pd-keda"'
    # arrivals at the router: served ones and, at zero engines, the ones refused for want of one
    router = (f"(sum(rate(vllm_router_requests_total{{{pool}}}[2m])) or vector(0)) + "
              f'(sum(rate(vllm_router_request_errors_total{{{pool},error_type="no_available_workers"}}[2m])) '
              "or vector(0))")
    decode, prefill = scalers["tiered-pd-keda"]["spec"], scalers["tiered-pd-keda-prefill"]["spec"]
    assert decode["scaleTargetRef"]["name"] == "tiered-pd-keda"
    assert {t["name"]: t["metadata"]["query"] for t in decode["triggers"]} == {
        "waiting-requests": f'sum(vllm:num_requests_waiting{{{pool},llm_d_ai_role="decode"}})',
        "kv-cache-usage": f'sum(vllm:kv_cache_usage_perc{{{pool},llm_d_ai_role="decode"}})',
        "router-requests": router}  # the router's series: no role, and still there at zero engines
    assert prefill["scaleTargetRef"]["name"] == "tiered-pd-keda-prefill"
    assert (prefill["minReplicaCount"], prefill["maxReplicaCount"]) == (0, 4)
    assert {t["name"]: t["metadata"]["query"] for t in prefill["triggers"]} == {
        "prompt-tokens-computed": f'sum(rate(kvpool_prompt_tokens_computed_total{{{pool},'
                                  f'llm_d_ai_role="prefill"}}[1m]))',
        "router-requests": router.replace("[2m]", "[1m]")}
    # KEDA's Prometheus scaler sends the query as written: PromQL's parser would reject an unbalanced one
    assert router.count("(") == router.count(")")
    # neither Deployment carries replicas: each role's autoscaler owns its own
    deployments = _by_name(manifests, "Deployment")
    assert all("replicas" not in deployments[n]["spec"] for n in scalers)
    assert set(_by_name(manifests, "PodDisruptionBudget")) == {"tiered-pd-keda", "tiered-pd-keda-prefill"}


def test_without_keda_the_prefill_role_gets_an_hpa_and_the_router_trigger_an_object_metric():
    pool = load_example("tiered-pd-keda")
    for scaling in (pool["spec"]["autoscaling"], pool["spec"]["prefill"]["autoscaling"]):
        scaling["minReplicas"] = 1
    hpas = _by_name(render(pool, NO_KEDA, "ml"), "HorizontalPodAutoscaler")
    assert set(hpas) == {"tiered-pd-keda", "tiered-pd-keda-prefill"}
    for hpa in hpas.values():
        validate_child(hpa)
    metrics = hpas["tiered-pd-keda-prefill"]["spec"]["metrics"]
    assert metrics[0]["pods"]["metric"]["name"] == "kvpool_prompt_tokens_computed_per_second"
    assert metrics[1] == {"type": "Object", "object": {
        "describedObject": {"apiVersion": "v1", "kind": "Service", "name": "tiered-pd-keda-router"},
        "metric": {"name": "vllm_router_requests_per_second"},
        "target": {"type": "AverageValue", "averageValue": "4"}}}
    # and the prefill role's scale to zero needs KEDA like the engines'
    pool["spec"]["prefill"]["autoscaling"]["minReplicas"] = 0
    with pytest.raises(InvalidPool, match=r"^spec\.prefill\.autoscaling\.minReplicas: 0 needs KEDA"):
        render(pool, NO_KEDA, "ml")


def test_a_plain_pool_queries_all_its_engines_and_pd_without_prefill_autoscaling_has_one_scaler():
    pool = load_example("tiered-pd-keda")
    del pool["spec"]["prefill"]["autoscaling"]
    manifests = render(pool, GOLDEN_SETTINGS, "ml")
    assert set(_by_name(manifests, "ScaledObject")) == {"tiered-pd-keda"}
    assert _by_name(manifests, "Deployment")["tiered-pd-keda-prefill"]["spec"]["replicas"] == 1


def test_a_role_scaled_to_zero_needs_redis_or_s3_in_the_crd_and_the_models_alike():
    """A shared disk claim carries the P/D handover, but zero engines need Redis or S3 to keep the
    cache: refused at spec.prefill.autoscaling.minReplicas by the API server and the models."""
    from kvpool_operator.render import load_pool
    from tests.operator.schema_check import api_server_errors

    pool = load_example("tiered-pd-keda")
    pool["spec"]["tiers"] = {"cpu": {"size": "8Gi"}, "disk": {
        "size": "50Gi", "volume": {"persistentVolumeClaim": {"claimName": "shared-kv"}}}}
    pool["spec"]["autoscaling"]["minReplicas"] = 1
    message = "prefill.autoscaling.minReplicas 0 (scale to zero) needs a shared tier"
    assert any(message in e for e in api_server_errors(pool))
    with pytest.raises(InvalidPool, match=r"^spec: prefill\.autoscaling\.minReplicas 0"):
        load_pool(pool, GOLDEN_SETTINGS)
    pool["spec"]["prefill"]["autoscaling"]["minReplicas"] = 1
    assert api_server_errors(pool) == [] and load_pool(pool, GOLDEN_SETTINGS)
