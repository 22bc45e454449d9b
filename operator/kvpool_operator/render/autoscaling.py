"""The engines' autoscaler `<name>`: a KEDA ScaledObject or an autoscaling/v2 HorizontalPodAutoscaler.

Rendered only with `spec.autoscaling`. Which kind depends on the operator's setting `keda` (KEDA
installed): a ScaledObject with one Prometheus trigger per target, querying the operator's
`kedaPrometheusAddress`, or else an HPA on Pods metrics, named as the prometheus-adapter rules in
docs/scaling.md expose them. Either targets the engine Deployment, whose rendering then carries
no `replicas` (`replicas_field`): the operator's field manager never owns that field, so its
applies never undo the autoscaler's writes.

Every trigger is a per-engine average (`AverageValue`): a query sums over the pool's engines and
the autoscaler divides by the replica count. `scaler` takes the target and its Autoscaling so that
each engine role can get its own.
"""

from __future__ import annotations

from typing import Any

from kvpool_operator import models
from kvpool_operator.naming import POOL_LABEL
from kvpool_operator.render.common import Pool

KEDA_API_VERSION = "keda.sh/v1alpha1"
HPA_API_VERSION = "autoscaling/v2"
# The pool label as Prometheus names it on the engines' series: the chart's PodMonitor copies the
# pod label kvpool.dev/pool (podTargetLabels) into kvpool_dev_pool.
SERIES_POOL_LABEL = "kvpool_dev_pool"
# KEDA copies a ScaledObject's labels onto the HPA it creates (keda-hpa-<name>); without these two
# that HPA would carry the pool's child labels and look like one of the operator's children.
KEDA_EXCLUDED_LABELS = "scaledobject.keda.sh/hpa-excluded-labels"

# trigger -> (KEDA trigger name, HPA Pods metric name as prometheus-adapter exposes it)
TRIGGERS = {
    "waiting_requests": ("waiting-requests", "vllm_num_requests_waiting"),
    "kv_cache_usage": ("kv-cache-usage", "vllm_kv_cache_usage_perc"),
    "prompt_tokens_computed": ("prompt-tokens-computed", "kvpool_prompt_tokens_computed_per_second"),
}


def replicas_field(replicas: int, autoscaling: models.Autoscaling | None) -> dict[str, int]:
    """A Deployment's `replicas`, or nothing when an autoscaler owns it."""
    return {} if autoscaling is not None else {"replicas": replicas}


def quantity(value: float) -> str:
    """A target as a Kubernetes quantity, to the thousandth (0.7 -> 700m, 3 -> 3)."""
    milli = round(value * 1000)
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def threshold(value: float) -> str:
    """A target as KEDA's metadata wants it: a decimal string (0.7, 3)."""
    return f"{round(value, 3):g}"


def query(pool: Pool, trigger: str, scaling: models.Autoscaling) -> str:
    """The PromQL sum over the pool's engines whose per-engine average is the trigger's target."""
    match = f'namespace="{pool.namespace}",{SERIES_POOL_LABEL}="{pool.name}"'
    if trigger == "waiting_requests":
        return f"sum(vllm:num_requests_waiting{{{match}}})"
    if trigger == "kv_cache_usage":
        return f"sum(vllm:kv_cache_usage_perc{{{match}}})"
    if pool.spec.connector == "native":  # vLLM's OffloadingConnector: kvpool's scheduler half does not run
        series = f'vllm:prompt_tokens_by_source_total{{{match},source="local_compute"}}'
    else:
        series = f"kvpool_prompt_tokens_computed_total{{{match}}}"
    return f"sum(rate({series}[{scaling.rate_window}]))"


def _targets(scaling: models.Autoscaling) -> list[tuple[str, float]]:
    triggers = scaling.triggers
    return [(name, value) for name in TRIGGERS if (value := getattr(triggers, name)) is not None]


def _scale_down(scaling: models.Autoscaling) -> dict[str, Any]:
    return {"scaleDown": {"stabilizationWindowSeconds": scaling.scale_down_stabilization_seconds}}


def scaled_object(pool: Pool, target: str, component: str, scaling: models.Autoscaling) -> dict[str, Any]:
    meta = pool.meta(target, component,
                     annotations={KEDA_EXCLUDED_LABELS: f"{POOL_LABEL},app.kubernetes.io/managed-by"})
    triggers = [
        {"type": "prometheus", "name": TRIGGERS[name][0], "metricType": "AverageValue",
         "metadata": {"serverAddress": pool.settings.keda_prometheus_address,
                      "query": query(pool, name, scaling), "threshold": threshold(value)}}
        for name, value in _targets(scaling)
    ]
    return {
        "apiVersion": KEDA_API_VERSION,
        "kind": "ScaledObject",
        "metadata": meta,
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": target},
            "minReplicaCount": scaling.min_replicas,
            "maxReplicaCount": scaling.max_replicas,
            # scale to zero: how long every trigger stays inactive before the last engine goes
            "cooldownPeriod": scaling.scale_down_stabilization_seconds,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _scale_down(scaling)}},
            "triggers": triggers,
        },
    }


def horizontal_pod_autoscaler(pool: Pool, target: str, component: str,
                              scaling: models.Autoscaling) -> dict[str, Any]:
    metrics = [
        {"type": "Pods", "pods": {"metric": {"name": TRIGGERS[name][1]},
                                  "target": {"type": "AverageValue", "averageValue": quantity(value)}}}
        for name, value in _targets(scaling)
    ]
    return {
        "apiVersion": HPA_API_VERSION,
        "kind": "HorizontalPodAutoscaler",
        "metadata": pool.meta(target, component),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": target},
            "minReplicas": scaling.min_replicas,
            "maxReplicas": scaling.max_replicas,
            "metrics": metrics,
            "behavior": _scale_down(scaling),
        },
    }


def scaler(pool: Pool, target: str, component: str, scaling: models.Autoscaling) -> dict[str, Any]:
    """The autoscaler of the Deployment `target` (its pods labelled `component`)."""
    build = scaled_object if pool.settings.keda else horizontal_pod_autoscaler
    return build(pool, target, component, scaling)


def render_autoscaling(pool: Pool) -> list[dict[str, Any]]:
    scaling = pool.spec.autoscaling
    if scaling is None:
        return []
    return [scaler(pool, pool.name, "engine", scaling)]
