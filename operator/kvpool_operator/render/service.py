"""Service `<name>`: the OpenAI-compatible API of the engines (behind `<name>-router` when the
pool has a router)."""

from __future__ import annotations

from typing import Any

from kvpool_operator.render.common import Pool
from kvpool_operator.render.connector import redis_url, s3_endpoint
from kvpool_operator.render.router import router_name


def pool_endpoints(pool: Pool) -> dict[str, str]:
    """Where clients (the router, else the engines' Service) and engines (the backends) reach the
    pool: status.endpoints. `engines` is always the engines' Service (a merge patch of status
    would otherwise keep a stale value after the router goes)."""
    engines = f"http://{pool.svc_host(pool.name)}:{pool.spec.service.port}"
    router = f"http://{pool.svc_host(router_name(pool))}:{pool.spec.service.port}"
    return {"openai": router if pool.spec.router is not None else engines, "engines": engines,
            "redis": redis_url(pool), "s3": s3_endpoint(pool)}


def render_service(pool: Pool) -> list[dict[str, Any]]:
    svc = pool.spec.service
    return [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": pool.meta(pool.name, "engine"),
            "spec": {
                # with a router, clients go through it: only the router's Service gets svc.type
                "type": "ClusterIP" if pool.spec.router is not None else svc.type,
                "selector": pool.selector("engine"),
                "ports": [{"name": "http", "port": svc.port, "targetPort": "http", "protocol": "TCP"}],
            },
        }
    ]
