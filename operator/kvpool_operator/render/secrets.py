"""Generated Secrets of managed backends: Redis `requirepass`, MinIO root credentials.

Rendering stays pure: the manifest carries no data, only the annotation
`kvpool.dev/generate-keys` naming the keys. The reconciler fills random values when it creates
the Secret and never touches an existing one, so a reconcile never rotates credentials.
"""

from __future__ import annotations

from typing import Any

from kvpool_operator.render.common import GENERATE_ANNOTATION, Pool


def _secret(pool: Pool, name: str, component: str, keys: list[str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": pool.meta(name, component, annotations={GENERATE_ANNOTATION: ",".join(keys)}),
        "type": "Opaque",
    }


def render_secrets(pool: Pool) -> list[dict[str, Any]]:
    out = []
    if pool.managed_redis:
        out.append(_secret(pool, pool.redis, "redis", ["password"]))
    if pool.managed_s3:
        out.append(_secret(pool, pool.minio, "minio", ["accessKey", "secretKey"]))
    return out


def generate_keys(manifest: dict[str, Any]) -> list[str]:
    annotation = manifest.get("metadata", {}).get("annotations", {}).get(GENERATE_ANNOTATION, "")
    return [k for k in annotation.split(",") if k]
