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
