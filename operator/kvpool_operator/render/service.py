"""Service `<name>`: the OpenAI-compatible API of the engines."""

from __future__ import annotations

from typing import Any

from kvpool_operator.render.common import Pool


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
