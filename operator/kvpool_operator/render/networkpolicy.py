"""NetworkPolicies: `<name>-backends` (on by default) lets only this pool's engine pods reach its
managed Redis and MinIO; `<name>-engines` (opt-in) lets only the listed peers (and the pool's router)
reach the engines' OpenAI port, and only `kvEvents.from` their KV events port; `<name>-router`
(with apiIngress and a router) lets only the listed peers reach the router. They need a CNI that
enforces NetworkPolicy; without one they are inert."""

from __future__ import annotations

import copy
from typing import Any

from kvpool_operator.render.common import HTTP_PORT, MINIO_PORT, POOL_LABEL, REDIS_PORT, Pool
from kvpool_operator.render.router import ROUTER_METRICS_PORT, ROUTER_PORT, router_name


def _policy(pool: Pool, name: str, component: str, selector: dict[str, Any],
            ingress: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": pool.meta(name, component),
        "spec": {"podSelector": selector, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def _backends(pool: Pool) -> list[dict[str, Any]]:
    components, ports = [], []
    if pool.managed_redis:
        components.append("redis")
        ports.append({"protocol": "TCP", "port": REDIS_PORT})
    if pool.managed_s3:
        components.append("minio")
        ports.append({"protocol": "TCP", "port": MINIO_PORT})
    if not pool.spec.network_policy.enabled or not components:
        return []
    selector = {
        "matchLabels": {POOL_LABEL: pool.name},
        "matchExpressions": [{"key": "app.kubernetes.io/component", "operator": "In", "values": components}],
    }
    engines = ["engine", *(["prefill"] if pool.spec.prefill is not None else [])]  # spec.prefill: both roles
    ingress = [{"from": [{"podSelector": {"matchLabels": pool.selector(c)}} for c in engines], "ports": ports}]
    return [_policy(pool, pool.network_policy, "backends", selector, ingress)]


def _peers(configured: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return copy.deepcopy(configured) or [{"podSelector": {}}]  # {} here: every pod of this namespace


def _engines(pool: Pool) -> list[dict[str, Any]]:
    """`<name>-engines`: the API port from `apiIngress.from` (and the pool's router), the KV events
    port (their events carry prompt token ids) from `kvEvents.from` only."""
    api = pool.spec.network_policy.api_ingress
    events = pool.spec.kv_events if pool.spec.kv_events and pool.spec.kv_events.enabled else None
    if not api.enabled and not (events and pool.spec.network_policy.enabled):
        return []
    ingress: list[dict[str, Any]] = []
    api_port = [{"protocol": "TCP", "port": HTTP_PORT}]
    if api.enabled:
        peers = _peers(api.from_)
        if pool.spec.router is not None:
            peers.append({"podSelector": {"matchLabels": pool.selector("router")}})
        ingress.append({"from": peers, "ports": api_port})
    else:
        ingress.append({"ports": api_port})  # no `from`: open, as without this policy
    if events:
        ingress.append({"from": _peers(events.from_), "ports": [{"protocol": "TCP", "port": events.port}]})
    return [_policy(pool, pool.engine_network_policy, "engine", {"matchLabels": pool.selector("engine")}, ingress)]


def _router(pool: Pool) -> list[dict[str, Any]]:
    """`<name>-router`: with apiIngress on, the router (the pool's front door) admits what the
    engines would: `apiIngress.from`, on its API and metrics ports."""
    api = pool.spec.network_policy.api_ingress
    if not api.enabled or pool.spec.router is None:
        return []
    ports = [{"protocol": "TCP", "port": ROUTER_PORT}, {"protocol": "TCP", "port": ROUTER_METRICS_PORT}]
    ingress = [{"from": _peers(api.from_), "ports": ports}]
    return [_policy(pool, router_name(pool), "router", {"matchLabels": pool.selector("router")}, ingress)]


def render_networkpolicy(pool: Pool) -> list[dict[str, Any]]:
    return _backends(pool) + _engines(pool) + _router(pool)
