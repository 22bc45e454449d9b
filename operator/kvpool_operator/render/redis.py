"""Managed Redis: StatefulSet + Service `<name>-redis`, users from the generated Secret.

A cache, not a database: no persistence, `maxmemory` at 85% of the memory limit (headroom for
fragmentation and replication buffers) with `allkeys-lru`, so a full Redis evicts instead of failing.

Two users, from an ACL file the container writes at start (password hashes only, in a
memory-backed emptyDir; no password on any command line): `default` (the Secret's `password`;
the readiness probe logs in with it through REDISCLI_AUTH) and `kvpool-engine` (its
`enginePassword`), which may run only the commands the Redis tier issues, on its pool's keys.
With `tls.secretName` Redis serves TLS only and the engines verify it with the Secret's ca.crt.
"""

from __future__ import annotations

from typing import Any

from kvpool_connector.config import parse_size
from kvpool_operator import models
from kvpool_operator.render.backends import (
    RESTRICTED_CONTAINER,
    backend_service,
    backend_statefulset,
    pod_security,
)
from kvpool_operator.render.common import (
    REDIS_ENGINE_USER,
    REDIS_KEY_PREFIX,
    REDIS_PORT,
    Pool,
    secret_env,
)
from kvpool_operator.render.connector import store_namespace

MAXMEMORY_FRACTION = 0.85
# What the Redis tier sends (connector/kvpool_connector/store/tiers/redis.py): SET (EX), GETRANGE
# (reads bounded by the reader's buffer), EXISTS, UNLINK; connection setup (AUTH or HELLO, the
# client library's CLIENT SETINFO, PING, SELECT for a database other than 0).
ENGINE_COMMANDS = ("set", "getrange", "exists", "unlink", "auth", "hello", "client|setinfo", "ping", "select")
ACL_FILE = "/run/redis/users.acl"
TLS_DIR = "/tls"

# Runs as the container's shell (sh): printf is a builtin, so passwords reach sha256sum on stdin,
# never an argv; the file holds only their hashes. `exec` leaves redis-server without them in its env.
START_SCRIPT = """\
set -eu
umask 077
hash() { printf '%s' "$1" | sha256sum | cut -d ' ' -f 1; }
{
  printf 'user default on #%s ~* &* +@all\\n' "$(hash "$REDIS_PASSWORD")"
  printf 'user %s on #%s %s\\n' "$ENGINE_USER" "$(hash "$REDIS_ENGINE_PASSWORD")" "$ENGINE_ACL"
} > "$ACL_FILE"
unset REDIS_PASSWORD REDIS_ENGINE_PASSWORD REDISCLI_AUTH
exec redis-server --aclfile "$ACL_FILE" "$@"
"""


def engine_acl(pool: Pool) -> str:
    """ACL rules of the engines' user: its pool's keys, no channels, only the tier's commands."""
    keys = f"~{REDIS_KEY_PREFIX}{store_namespace(pool)}:*"
    return " ".join(["resetkeys", keys, "resetchannels", "-@all", *(f"+{c}" for c in ENGINE_COMMANDS)])


def _tls_args(tls: models.TlsSecret | None) -> list[str]:
    if tls is None:
        return []
    return ["--port", "0", "--tls-port", str(REDIS_PORT), "--tls-cert-file", f"{TLS_DIR}/tls.crt",
            "--tls-key-file", f"{TLS_DIR}/tls.key", "--tls-ca-cert-file", f"{TLS_DIR}/ca.crt",
            "--tls-auth-clients", "no"]


def render_redis(pool: Pool) -> list[dict[str, Any]]:
    managed = pool.managed_redis
    if managed is None:
        return []
    maxmemory = int(parse_size(managed.memory) * MAXMEMORY_FRACTION)
    tls_cli = f"--tls --cacert {TLS_DIR}/ca.crt " if managed.tls else ""
    ping = f"redis-cli {tls_cli}-p {REDIS_PORT} ping | grep -q PONG"  # password from REDISCLI_AUTH
    mounts: list[dict[str, Any]] = [{"name": "data", "mountPath": "/data"},
                                    {"name": "acl", "mountPath": ACL_FILE.rpartition("/")[0]}]
    volumes: list[dict[str, Any]] = [
        {"name": "data", "emptyDir": {}},
        {"name": "acl", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
    ]
    if managed.tls:
        mounts.append({"name": "tls", "mountPath": TLS_DIR, "readOnly": True})
        volumes.append({"name": "tls", "secret": {"secretName": managed.tls.secret_name, "defaultMode": 0o440}})
    container = {
        "name": "redis",
        "image": managed.image or pool.settings.redis_image,
        "imagePullPolicy": pool.settings.image_pull_policy,
        "command": ["sh", "-c", START_SCRIPT, "redis"],
        "args": [
            "--maxmemory", str(maxmemory),
            "--maxmemory-policy", "allkeys-lru",
            "--save", "",
            "--appendonly", "no",
            *_tls_args(managed.tls),
        ],
        "env": [
            secret_env("REDIS_PASSWORD", pool.redis, "password"),
            secret_env("REDIS_ENGINE_PASSWORD", pool.redis, "enginePassword"),
            secret_env("REDISCLI_AUTH", pool.redis, "password"),
            {"name": "ENGINE_USER", "value": REDIS_ENGINE_USER},
            {"name": "ENGINE_ACL", "value": engine_acl(pool)},
            {"name": "ACL_FILE", "value": ACL_FILE},
        ],
        "ports": [{"name": "redis", "containerPort": REDIS_PORT, "protocol": "TCP"}],
        "readinessProbe": {"exec": {"command": ["sh", "-c", ping]}, "periodSeconds": 5, "timeoutSeconds": 3},
        "livenessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 10, "failureThreshold": 6},
        "resources": {
            "requests": {"cpu": "250m", "memory": managed.memory},
            "limits": {"memory": managed.memory},
        },
        "securityContext": RESTRICTED_CONTAINER,
        "volumeMounts": mounts,
    }
    pod_spec = {
        "automountServiceAccountToken": False,
        "securityContext": pod_security(999),
        "containers": [container],
        "volumes": volumes,
    }
    return [
        backend_statefulset(pool, pool.redis, "redis", pod_spec),
        backend_service(pool, pool.redis, "redis", "redis", REDIS_PORT),
    ]
