"""Managed Redis: StatefulSet + Service `<name>-redis`, password from the generated Secret.

A cache, not a database: no persistence, `maxmemory` at 85% of the memory limit (headroom for
fragmentation and replication buffers) with `allkeys-lru`, so a full Redis evicts instead of failing.
"""

from __future__ import annotations

from typing import Any

from kvpool_operator import models
from kvpool_operator.render.backends import (
    RESTRICTED_CONTAINER,
    backend_service,
    backend_statefulset,
    pod_security,
)
from kvpool_operator.render.common import REDIS_PORT, Pool, secret_env

MAXMEMORY_FRACTION = 0.85


def render_redis(pool: Pool) -> list[dict[str, Any]]:
    managed = pool.managed_redis
    if managed is None:
        return []
    maxmemory = int(models.size_bytes(managed.memory) * MAXMEMORY_FRACTION)
    ping = 'redis-cli -a "$REDIS_PASSWORD" --no-auth-warning ping | grep -q PONG'
    container = {
        "name": "redis",
        "image": managed.image or pool.settings.redis_image,
        "imagePullPolicy": pool.settings.image_pull_policy,
        "command": ["redis-server"],
        "args": [
            "--requirepass", "$(REDIS_PASSWORD)",
            "--maxmemory", str(maxmemory),
            "--maxmemory-policy", "allkeys-lru",
            "--save", "",
            "--appendonly", "no",
        ],
        "env": [secret_env("REDIS_PASSWORD", pool.redis, "password")],
        "ports": [{"name": "redis", "containerPort": REDIS_PORT, "protocol": "TCP"}],
        "readinessProbe": {"exec": {"command": ["sh", "-c", ping]}, "periodSeconds": 5, "timeoutSeconds": 3},
        "livenessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 10, "failureThreshold": 6},
        "resources": {
            "requests": {"cpu": "250m", "memory": managed.memory},
            "limits": {"memory": managed.memory},
        },
        "securityContext": RESTRICTED_CONTAINER,
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    }
    pod_spec = {
        "automountServiceAccountToken": False,
        "securityContext": pod_security(999),
        "containers": [container],
        "volumes": [{"name": "data", "emptyDir": {}}],
    }
    return [
        backend_statefulset(pool, pool.redis, "redis", pod_spec),
        backend_service(pool, pool.redis, "redis", "redis", REDIS_PORT),
    ]
