"""PROPOSAL for operator/kvpool_operator/render/router.py (not imported by anything yet).

Written next to the fleet bench (connector/kvpool_connector/bench/fleet_bench.py), which runs
the same `vllm-router` binary with the same flags over static worker URLs; here it finds the
engines by Kubernetes service discovery instead. Drop this file into render/, move the two
models into models.py (`KVCachePoolSpec.router: RouterSpec | None = None`,
`KVCachePoolSpec.inference_pool: InferencePoolSpec | None = None`), add `render_router` and
`render_inference_pool` to the renderer list, and the engines' `<name>-engines` NetworkPolicy
(apiIngress) must also admit `pool.selector("router")`.

Children of a pool with `spec.router`:
  ServiceAccount <name>-router, Role + RoleBinding <name>-router (pods: get/list/watch in the
  pool's namespace: what --service-discovery --service-discovery-namespace needs, nothing
  cluster-wide), Deployment <name>-router (vllm-router, non-root, read-only root, no
  capabilities), Service <name>-router (port spec.service.port -> the router's 8000, and
  `metrics` 29000 for the chart's ServiceMonitor/PodMonitor).
status.endpoints.openai names the router when there is one; the engines' Service stays as
status.endpoints.engines.

Facts checked against vllm-router 0.1.17 here: it forwards the client's Authorization header
to the engines (so spec.service.apiKeySecretRef needs nothing on the router: never put a key
in its argv), serves /health /liveness /readiness, and exports Prometheus metrics
(vllm_router_requests_total, vllm_router_processed_requests_total{worker},
vllm_router_policy_decisions_total{policy,worker}, ...) on --prometheus-port.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvpool_operator.render.backends import RESTRICTED_CONTAINER
from kvpool_operator.render.common import HTTP_PORT, Pool, child_name

ROUTER_PORT = 8000
ROUTER_METRICS_PORT = 29000
ROUTER_UID = 65532
ROUTER_IMAGE = "kvpool-router:0.1.0"  # Dockerfile target `router` (see the report)


# -- models (move into models.py; _Model there = this base) ------------------------------------


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class RouterSpec(_Model):
    policy: Literal["cache_aware", "consistent_hash", "power_of_two", "round_robin"] = Field(
        "cache_aware", description="cache_aware: approximate prefix tree per router (requests whose "
        "prompt matches a worker's tree above cacheThreshold go there, else to the least loaded); "
        "consistent_hash: sticky by x-session-id (or the OpenAI `user` field); power_of_two: the less "
        "loaded of two random engines; round_robin.")
    replicas: int = Field(1, ge=0, le=16, description="Router replicas. cache_aware learns its tree per "
                          "replica: more than one spreads a conversation's knowledge; consistent_hash "
                          "is stateless and scales out.")
    image: str | None = Field(None, description="Router image; default: the operator's routerImage setting.")
    cache_threshold: float | None = Field(None, ge=0, le=1, description="cache_aware: minimum prefix "
                                          "match ratio to route by cache (router default 0.3).")
    balance_abs_threshold: int | None = Field(None, ge=0, description="cache_aware: load gap that "
                                              "switches to least-loaded routing (router default 64).")
    balance_rel_threshold: float | None = Field(None, ge=1, description="cache_aware: load ratio "
                                                "that switches to least-loaded routing (default 1.5).")
    resources: dict[str, Any] = Field(default_factory=lambda: {
        "requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"cpu": "2", "memory": "1Gi"}},
        description="core/v1 ResourceRequirements of the router container.")


class EndpointPickerPort(_Model):
    number: int = Field(ge=1, le=65535)


class EndpointPickerRef(_Model):
    group: str = ""
    kind: str = "Service"
    name: str = Field(min_length=1, max_length=253)
    port: EndpointPickerPort | None = None
    failure_mode: Literal["FailOpen", "FailClose"] = Field("FailClose", alias="failureMode")


class InferencePoolSpec(_Model):
    """Gateway API Inference Extension: an InferencePool selecting this pool's engines."""

    enabled: bool = False
    endpoint_picker_ref: EndpointPickerRef | None = Field(None, alias="endpointPickerRef")


# -- rendering ----------------------------------------------------------------------------------


def router_name(pool: Pool) -> str:
    return child_name(pool.name, "router")


def router_args(pool: Pool, router: RouterSpec) -> list[str]:
    """vllm-router flags: service discovery of this pool's engine pods in its namespace."""
    selector = [f"{k}={v}" for k, v in sorted(pool.selector("engine").items())]
    args = ["--host", "0.0.0.0", "--port", str(ROUTER_PORT), "--policy", router.policy,
            "--service-discovery", "--selector", *selector,
            "--service-discovery-port", str(HTTP_PORT),
            "--service-discovery-namespace", pool.namespace,
            "--prometheus-host", "0.0.0.0", "--prometheus-port", str(ROUTER_METRICS_PORT),
            "--log-level", "info"]
    for flag, value in (("--cache-threshold", router.cache_threshold),
                        ("--balance-abs-threshold", router.balance_abs_threshold),
                        ("--balance-rel-threshold", router.balance_rel_threshold)):
        if value is not None:
            args += [flag, str(value)]
    return args


def router_rbac(pool: Pool) -> list[dict[str, Any]]:
    """Least privilege for discovery: read pods of the pool's namespace, nothing else."""
    name = router_name(pool)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": pool.meta(name, "router"),
         "automountServiceAccountToken": True},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": pool.meta(name, "router"),
         "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": pool.meta(name, "router"),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": pool.namespace}]},
    ]


def render_router(pool: Pool, router: RouterSpec | None = None) -> list[dict[str, Any]]:
    router = router if router is not None else getattr(pool.spec, "router", None)
    if router is None:
        return []
    name = router_name(pool)
    image = router.image or getattr(pool.settings, "router_image", None) or ROUTER_IMAGE
    probe = {"httpGet": {"path": "/liveness", "port": "http"}, "periodSeconds": 10, "failureThreshold": 3}
    container = {
        "name": "router",
        "image": image,
        "command": ["vllm-router"],
        "args": router_args(pool, router),
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": ROUTER_METRICS_PORT, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": "/readiness", "port": "http"}, "periodSeconds": 5},
        "livenessProbe": probe,
        "resources": router.resources,
        "securityContext": dict(RESTRICTED_CONTAINER),
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": pool.meta(name, "router"),
        "spec": {
            "replicas": router.replicas,
            "selector": {"matchLabels": pool.selector("router")},
            "template": {
                "metadata": {"labels": pool.labels("router")},
                "spec": {
                    "serviceAccountName": name,
                    "securityContext": {"runAsNonRoot": True, "runAsUser": ROUTER_UID,
                                        "runAsGroup": ROUTER_UID,
                                        "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [container],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": pool.meta(name, "router"),
        "spec": {
            "type": pool.spec.service.type,
            "selector": pool.selector("router"),
            "ports": [{"name": "http", "port": pool.spec.service.port, "targetPort": "http", "protocol": "TCP"},
                      {"name": "metrics", "port": ROUTER_METRICS_PORT, "targetPort": "metrics",
                       "protocol": "TCP"}],
        },
    }
    return [*router_rbac(pool), deployment, service]


def render_inference_pool(pool: Pool, spec: InferencePoolSpec | None = None) -> list[dict[str, Any]]:
    """inference.networking.k8s.io/v1 InferencePool over the engines (not the router: a Gateway
    with the inference extension routes to the model servers itself)."""
    spec = spec if spec is not None else getattr(pool.spec, "inference_pool", None)
    if spec is None or not spec.enabled:
        return []
    body: dict[str, Any] = {
        "selector": {"matchLabels": pool.selector("engine")},
        "targetPorts": [{"number": HTTP_PORT}],
        "appProtocol": "http",
    }
    ref = spec.endpoint_picker_ref
    if ref is not None:
        picker: dict[str, Any] = {"group": ref.group, "kind": ref.kind, "name": ref.name,
                                  "failureMode": ref.failure_mode}
        if ref.port is not None:
            picker["port"] = {"number": ref.port.number}
        body["endpointPickerRef"] = picker
    return [{"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
             "metadata": pool.meta(pool.name, "engine"), "spec": body}]


def pool_endpoints_with_router(pool: Pool, endpoints: dict[str, str]) -> dict[str, str]:
    """status.endpoints: `openai` is the router when there is one, `engines` the direct Service."""
    if getattr(pool.spec, "router", None) is None:
        return endpoints
    return {**endpoints, "engines": endpoints["openai"],
            "openai": f"http://{pool.svc_host(router_name(pool))}:{pool.spec.service.port}"}
