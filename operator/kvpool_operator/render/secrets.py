"""Generated Secrets: the pool's keys (pool key, hash seed), Redis `requirepass`, MinIO root credentials.

Rendering stays pure: the manifest carries no data, only the annotation
`kvpool.dev/generate-keys` naming the keys. The reconciler (reconcile/secrets.py) fills random
values when it creates the Secret, adds keys a labelled one lacks and never rewrites a value, so
a reconcile never rotates credentials.
"""

from __future__ import annotations

from typing import Any

from kvpool_operator.render.common import GENERATE_ANNOTATION, HASH_SEED, POOL_KEY, Pool, child_name

# Components whose Secret the operator may generate: all the names it ever reads Secrets under.
GENERATED_COMPONENTS = ("kvpool-keys", "redis", "minio")


def _secret(pool: Pool, name: str, component: str, keys: list[str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": pool.meta(name, component, annotations={GENERATE_ANNOTATION: ",".join(keys)}),
        "type": "Opaque",
    }


def render_secrets(pool: Pool) -> list[dict[str, Any]]:
    out = []
    if pool.spec.security.keys_secret_ref is None:  # previousPoolKey is only ever added by a rotation
        out.append(_secret(pool, pool.keys_secret, "engine", [POOL_KEY, HASH_SEED]))
    if pool.managed_redis:
        out.append(_secret(pool, pool.redis, "redis", ["password", "enginePassword"]))  # default, engines' user
    if pool.managed_s3:
        # root (bootstrap only), and the engines' bucket-scoped user
        out.append(_secret(pool, pool.minio, "minio", ["accessKey", "secretKey", "engineAccessKey", "engineSecretKey"]))
    return out


def generated_secret_names(pool_name: str) -> list[str]:
    """Every name a generated Secret of this pool can have (the operator reads them, never lists)."""
    return [child_name(pool_name, component) for component in GENERATED_COMPONENTS]


def generate_keys(manifest: dict[str, Any]) -> list[str]:
    annotation = manifest.get("metadata", {}).get("annotations", {}).get(GENERATE_ANNOTATION, "")
    return [k for k in annotation.split(",") if k]
