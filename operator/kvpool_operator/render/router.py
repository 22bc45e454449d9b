"""`<name>-router`: vllm-router (the vLLM project's Rust router) in front of the engines.

Children of a pool with `spec.router`: a ServiceAccount, a RoleBinding `<name>-router-discovery`
of it to the discovery ClusterRole the chart ships (rbac.ROUTER_DISCOVERY_RULES: list and watch the
pods of the pool's namespace, what vllm-router 0.1.17's Kubernetes service discovery does; it
filters by label itself, so RBAC cannot narrow it further), the Deployment and its Service
(`spec.service.port` -> the router's 8000, and `metrics` 29000 for the chart's monitors). The
binding has its own name because a RoleBinding's roleRef cannot change: an older operator's
`<name>-router` binding to a per-pool Role is pruned, and its Role goes with the pool.

The router forwards each client's Authorization header to the engines (and on cache_aware's
render call), so `spec.service.apiKeySecretRef` needs nothing on the router: no key is ever in
its argv or env. Facts checked against vllm-router 0.1.17 by tests/operator/test_router_discovery.py,
which runs the real binary with these args against the emulator.
"""

from __future__ import annotations

from typing import Any

from kvpool_operator import models
from kvpool_operator.rbac import RBAC_GROUP
from kvpool_operator.render.backends import RESTRICTED_CONTAINER, pod_security
from kvpool_operator.render.common import HTTP_PORT, Pool, child_name, merge
from kvpool_operator.render.roles import DECODE, PREFILL, role_selector

ROUTER_PORT = 8000
ROUTER_METRICS_PORT = 29000
ROUTER_UID = 65532  # the Dockerfile's `router` target user
ROUTER_HEALTH_CHECK_SECONDS = 15  # the router's own engine health checks (its default: 60)
ROUTER_RESOURCES = {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"cpu": "2", "memory": "1Gi"}}


def router_name(pool: Pool) -> str:
    return child_name(pool.name, "router")


def _labels(selector: dict[str, str]) -> list[str]:
    return [f"{k}={v}" for k, v in sorted(selector.items())]


def _discovery(pool: Pool) -> list[str]:
    """Which pods the router sends requests to. With spec.prefill, vllm-router's vLLM P/D mode
    (`--vllm-pd-disaggregation`) with Kubernetes discovery by role: a pod matching
    `--prefill-selector` is a prefill server, else one matching `--decode-selector` a decode server
    (vllm-router 0.1.17, src/service_discovery.rs `PodInfo::should_include`/`from_pod`; `--selector`
    is not read in P/D mode). `--kv-connector nixl` (its default, spelled out) is the protocol that
    passes the prefill response's kv_transfer_params to the decode request unchanged
    (src/routers/http/vllm_pd_router.rs: the prefill request gets {do_remote_decode: true} and
    max_tokens 1), which kvpool's handover speaks; nothing NIXL itself runs."""
    if pool.spec.prefill is None:
        return ["--service-discovery", "--selector", *_labels(pool.selector("engine"))]
    return ["--vllm-pd-disaggregation", "--kv-connector", "nixl", "--service-discovery",
            "--prefill-selector", *_labels(role_selector(pool, PREFILL)),
            "--decode-selector", *_labels(role_selector(pool, DECODE))]


def router_args(pool: Pool, router: models.RouterSpec) -> list[str]:
    """vllm-router flags: service discovery of this pool's engine pods in its namespace."""
    args = ["--host", "0.0.0.0", "--port", str(ROUTER_PORT), "--policy", router.policy,
            *_discovery(pool),
            "--service-discovery-port", str(HTTP_PORT),
            "--service-discovery-namespace", pool.namespace,
            "--health-check-interval-secs", str(ROUTER_HEALTH_CHECK_SECONDS),
            "--prometheus-host", "0.0.0.0", "--prometheus-port", str(ROUTER_METRICS_PORT),
            "--log-level", "info"]
    for flag, value in (("--cache-threshold", router.cache_threshold),
                        ("--balance-abs-threshold", router.balance_abs_threshold),
                        ("--balance-rel-threshold", router.balance_rel_threshold)):
        if value is not None:
            args += [flag, str(value)]
    return args


def _rbac(pool: Pool) -> list[dict[str, Any]]:
    name = router_name(pool)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": pool.meta(name, "router"),
         "automountServiceAccountToken": False},  # mounted by the router pod only
        {"apiVersion": f"{RBAC_GROUP}/v1", "kind": "RoleBinding", "metadata": pool.meta(f"{name}-discovery", "router"),
         "roleRef": {"apiGroup": RBAC_GROUP, "kind": "ClusterRole", "name": pool.settings.router_discovery_role},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": pool.namespace}]},
    ]


def _deployment(pool: Pool, router: models.RouterSpec) -> dict[str, Any]:
    name = router_name(pool)
    container = {
        "name": "router",
        "image": router.image or pool.settings.router_image,
        "imagePullPolicy": pool.settings.image_pull_policy,
        "command": ["vllm-router"],
        "args": router_args(pool, router),
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": ROUTER_METRICS_PORT, "protocol": "TCP"}],
        # /readiness is 503 until at least one engine is healthy: no traffic to a router without engines
        "readinessProbe": {"httpGet": {"path": "/readiness", "port": "http"}, "periodSeconds": 5,
                           "timeoutSeconds": 3},
        "livenessProbe": {"httpGet": {"path": "/liveness", "port": "http"}, "periodSeconds": 10,
                          "timeoutSeconds": 3, "failureThreshold": 3},
        "resources": merge(ROUTER_RESOURCES, router.resources),
        "securityContext": dict(RESTRICTED_CONTAINER),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    return {
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
                    "automountServiceAccountToken": True,  # service discovery reads pods with it
                    "enableServiceLinks": False,
                    "securityContext": pod_security(ROUTER_UID),
                    "containers": [container],
                    "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}],
                },
            },
        },
    }


def _service(pool: Pool) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": pool.meta(router_name(pool), "router"),
        "spec": {
            "type": pool.spec.service.type,
            "selector": pool.selector("router"),
            "ports": [{"name": "http", "port": pool.spec.service.port, "targetPort": "http", "protocol": "TCP"},
                      {"name": "metrics", "port": ROUTER_METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"}],
        },
    }


def render_router(pool: Pool) -> list[dict[str, Any]]:
    router = pool.spec.router
    if router is None:
        return []
    return [*_rbac(pool), _deployment(pool, router), _service(pool)]
