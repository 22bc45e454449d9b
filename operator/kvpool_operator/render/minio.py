"""Managed MinIO: StatefulSet (one volumeClaimTemplate of `storage`) + Service `<name>-minio`.

The bucket is created by the engines' connector (`create_bucket: true` in the store config) on
first use, so no Job has to race the StatefulSet. Volumes are deleted with the pool (it is a cache).
"""

from __future__ import annotations

from typing import Any

from kvpool_operator.render.backends import (
    RESTRICTED_CONTAINER,
    backend_service,
    backend_statefulset,
    pod_security,
)
from kvpool_operator.render.common import MINIO_PORT, Pool, secret_env


def render_minio(pool: Pool) -> list[dict[str, Any]]:
    managed = pool.managed_s3
    if managed is None:
        return []
    claim_spec: dict[str, Any] = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": managed.storage}},
    }
    if managed.storage_class_name:
        claim_spec["storageClassName"] = managed.storage_class_name
    container = {
        "name": "minio",
        "image": managed.image or pool.settings.minio_image,
        "imagePullPolicy": pool.settings.image_pull_policy,
        "args": ["server", "/data"],
        "env": [
            secret_env("MINIO_ROOT_USER", pool.minio, "accessKey"),
            secret_env("MINIO_ROOT_PASSWORD", pool.minio, "secretKey"),
            {"name": "MINIO_BROWSER", "value": "off"},
        ],
        "ports": [{"name": "s3", "containerPort": MINIO_PORT, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": "/minio/health/ready", "port": "s3"}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/minio/health/live", "port": "s3"}, "periodSeconds": 10},
        "resources": {"requests": {"cpu": "250m", "memory": "512Mi"}},
        "securityContext": RESTRICTED_CONTAINER,
        "volumeMounts": [{"name": "data", "mountPath": "/data"}, {"name": "tmp", "mountPath": "/tmp"}],
    }
    pod_spec = {
        "automountServiceAccountToken": False,
        "securityContext": pod_security(1000),
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {}}],
    }
    statefulset = backend_statefulset(
        pool, pool.minio, "minio", pod_spec,
        persistentVolumeClaimRetentionPolicy={"whenDeleted": "Delete", "whenScaled": "Retain"},
        volumeClaimTemplates=[{"metadata": {"name": "data", "labels": pool.labels("minio")}, "spec": claim_spec}],
    )
    return [statefulset, backend_service(pool, pool.minio, "minio", "s3", MINIO_PORT)]
