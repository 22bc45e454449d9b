"""Service `<name>`: the OpenAI-compatible API of the engines."""

from __future__ import annotations

from typing import Any

from kvpool_operator.render.common import Pool
from kvpool_operator.render.connector import redis_url, s3_endpoint


def pool_endpoints(pool: Pool) -> dict[str, str]:
    """Where clients (the Service) and engines (the backends) reach the pool: status.endpoints."""
    return {
        "openai": f"http://{pool.svc_host(pool.name)}:{pool.spec.service.port}",
        "redis": redis_url(pool),
        "s3": s3_endpoint(pool),
    }


def render_service(pool: Pool) -> list[dict[str, Any]]:
    svc = pool.spec.service
    return [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": pool.meta(pool.name, "engine"),
            "spec": {
                "type": svc.type,
                "selector": pool.selector("engine"),
                "ports": [{"name": "http", "port": svc.port, "targetPort": "http", "protocol": "TCP"}],
            },
        }
    ]
