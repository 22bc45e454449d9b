"""The engines' autoscaler `<name>`: a KEDA ScaledObject or an autoscaling/v2 HorizontalPodAutoscaler.

Rendered only with `spec.autoscaling`. Which kind depends on the operator's setting `keda` (KEDA
installed): a ScaledObject with one Prometheus trigger per target, querying the operator's
`kedaPrometheusAddress`, or else an HPA on Pods metrics, named as the prometheus-adapter rules in
docs/scaling.md expose them. Either targets the engine Deployment, whose rendering then carries
no `replicas` (`replicas_field`): the operator's field manager never owns that field, so its
applies never undo the autoscaler's writes.

Every trigger is a per-engine average (`AverageValue`): a query sums over the pool's engines and
the autoscaler divides by the replica count. Each engine role has its own autoscaler: with
spec.prefill, `<name>-prefill` scales on spec.prefill.autoscaling and the decode engines `<name>`
on spec.autoscaling, each querying only its own role's series (the pods' label llm-d.ai/role,
which the chart's monitors copy as llm_d_ai_role); an HPA's Pods metrics are its target's pods
already. The router trigger counts the requests reaching the pool's router, the same series for
both roles, and the one that still reads at zero engines (what wakes a pool scaled to zero).
"""

from __future__ import annotations

import re
from typing import Any

from kvpool_operator import models
from kvpool_operator.naming import POOL_LABEL
from kvpool_operator.render.common import Pool
from kvpool_operator.render.roles import DECODE, PREFILL, ROLE_LABEL, prefill_name
from kvpool_operator.render.router import router_name

KEDA_API_VERSION = "keda.sh/v1alpha1"
HPA_API_VERSION = "autoscaling/v2"
# The pool label as Prometheus names it on the engines' series: the chart's PodMonitor copies the
# pod label kvpool.dev/pool (podTargetLabels) into kvpool_dev_pool.
SERIES_POOL_LABEL = "kvpool_dev_pool"
# The role label (llm-d.ai/role) as Prometheus names it: the chart's monitors copy it too.
SERIES_ROLE_LABEL = re.sub(r"[^A-Za-z0-9_]", "_", ROLE_LABEL)  # llm_d_ai_role
# KEDA copies a ScaledObject's labels onto the HPA it creates (keda-hpa-<name>); without these two
# that HPA would carry the pool's child labels and look like one of the operator's children.
KEDA_EXCLUDED_LABELS = "scaledobject.keda.sh/hpa-excluded-labels"

NO_WORKERS_ERROR = "no_available_workers"  # vllm-router's error_type for a request no engine can take

# trigger -> (KEDA trigger name, HPA Pods metric name as prometheus-adapter exposes it)
TRIGGERS = {
    "waiting_requests": ("waiting-requests", "vllm_num_requests_waiting"),
    "kv_cache_usage": ("kv-cache-usage", "vllm_kv_cache_usage_perc"),
    "prompt_tokens_computed": ("prompt-tokens-computed", "kvpool_prompt_tokens_computed_per_second"),
    "router_requests": ("router-requests", "vllm_router_requests_per_second"),
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


def query(pool: Pool, trigger: str, scaling: models.Autoscaling, role: str | None = None) -> str:
    """The PromQL sum over the pool's engines of `role` (all of them: None) whose per-engine average
    is the trigger's target."""
    pool_match = f'namespace="{pool.namespace}",{SERIES_POOL_LABEL}="{pool.name}"'
    if trigger == "router_requests":  # the router's series: no role (it serves both)
        # With no worker, vllm-router (0.1.17, measured) answers 503 and counts the request only in
        # its errors (no_available_workers), not in vllm_router_requests_total: both make the arrivals
        # that wake a pool from zero. `or vector(0)`: a counter not yet incremented has no series.
        window = scaling.rate_window
        errors = f'{pool_match},error_type="{NO_WORKERS_ERROR}"'
        return (f"(sum(rate(vllm_router_requests_total{{{pool_match}}}[{window}])) or vector(0)) + "
                f"(sum(rate(vllm_router_request_errors_total{{{errors}}}[{window}])) or vector(0))")
    match = pool_match + (f',{SERIES_ROLE_LABEL}="{role}"' if role else "")
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


def scaled_object(pool: Pool, target: str, component: str, scaling: models.Autoscaling,
                  role: str | None = None) -> dict[str, Any]:
    meta = pool.meta(target, component,
                     annotations={KEDA_EXCLUDED_LABELS: f"{POOL_LABEL},app.kubernetes.io/managed-by"})
    triggers = [
        {"type": "prometheus", "name": TRIGGERS[name][0], "metricType": "AverageValue",
         "metadata": {"serverAddress": pool.settings.keda_prometheus_address,
                      "query": query(pool, name, scaling, role), "threshold": threshold(value)}}
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


def horizontal_pod_autoscaler(pool: Pool, target: str, component: str, scaling: models.Autoscaling,
                              role: str | None = None) -> dict[str, Any]:
    """Pods metrics are the target's own pods' (`role` needs no filter here); the router trigger is an
    Object metric of the router's Service, which prometheus-adapter serves from the router's series."""
    metrics = [
        {"type": "Object", "object": {
            "describedObject": {"apiVersion": "v1", "kind": "Service", "name": router_name(pool)},
            "metric": {"name": TRIGGERS[name][1]},
            "target": {"type": "AverageValue", "averageValue": quantity(value)}}}
        if name == "router_requests" else
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


def scaler(pool: Pool, target: str, component: str, scaling: models.Autoscaling,
           role: str | None = None) -> dict[str, Any]:
    """The autoscaler of the Deployment `target` (its pods labelled `component`, and `role`)."""
    build = scaled_object if pool.settings.keda else horizontal_pod_autoscaler
    return build(pool, target, component, scaling, role)


def render_autoscaling(pool: Pool) -> list[dict[str, Any]]:
    """The engines' autoscaler and, with spec.prefill.autoscaling, the prefill engines'."""
    out = []
    prefill = pool.spec.prefill
    if pool.spec.autoscaling is not None:
        out.append(scaler(pool, pool.name, "engine", pool.spec.autoscaling, DECODE if prefill else None))
    if prefill is not None and prefill.autoscaling is not None:
        out.append(scaler(pool, prefill_name(pool), "prefill", prefill.autoscaling, PREFILL))
    return out
