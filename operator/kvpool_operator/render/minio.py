"""Managed MinIO: StatefulSet (one volumeClaimTemplate of `storage`) + Service `<name>-minio`.

The root credentials (Secret keys accessKey/secretKey) serve only the bootstrap; engines use a
user of their own (engineAccessKey/engineSecretKey) allowed to get, put and delete objects under
their pool's prefix of the bucket, and to list it (so a missing object is a 404, not a 403).

The bootstrap is a second container in the MinIO pod (MinIO's `mc` client): it creates the
bucket, an expiry lifecycle rule and a quota (90% of the volume) so the bucket cannot fill its
volume, the engines' policy and user, then stays up; its readiness gates the pod's, so the
Service has no endpoint (and engines nothing to talk to) before the bucket and user exist. A
container rather than a Job: a Job's pod template cannot change, this one follows every spec
change and re-runs (idempotently) whenever the pod restarts, which also applies a rotated
engine key. It reaches MinIO on loopback; the root credentials go in through MC_HOST_kvpool,
composed by the kubelet from the Secret, and the engine user's secret on mc's stdin: never argv.
Volumes are deleted with the pool (it is a cache).
"""

from __future__ import annotations

import json
from typing import Any

from kvpool_connector.config import parse_size
from kvpool_operator import models
from kvpool_operator.render.backends import (
    RESTRICTED_CONTAINER,
    backend_service,
    backend_statefulset,
    pod_security,
)
from kvpool_operator.render.common import MINIO_BUCKET, MINIO_PORT, Pool, secret_env
from kvpool_operator.render.connector import store_namespace

QUOTA_FRACTION = 0.9  # writes are refused before the volume is full; expiry frees space meanwhile
ENGINE_POLICY = "kvpool-engine"
CERTS_DIR = "/certs"
MC_DIR = "/tmp/mc"
READY_FILE = f"{MC_DIR}/bootstrapped"

BOOTSTRAP_SCRIPT = """\
set -eu
until mc --quiet $MC_FLAGS ready kvpool >/dev/null 2>&1; do sleep 2; done
mc --quiet $MC_FLAGS mb --ignore-existing "kvpool/$BUCKET"
printf '%s' "$LIFECYCLE" | mc --quiet $MC_FLAGS ilm rule import "kvpool/$BUCKET"
mc --quiet $MC_FLAGS quota set "kvpool/$BUCKET" --size "$QUOTA_BYTES"
printf '%s' "$ENGINE_POLICY_JSON" > "$MC_CONFIG_DIR/engine-policy.json"
mc --quiet $MC_FLAGS admin policy create kvpool "$ENGINE_POLICY" "$MC_CONFIG_DIR/engine-policy.json"
printf '%s\\n' "$ENGINE_SECRET_KEY" | mc --quiet $MC_FLAGS admin user add kvpool "$ENGINE_ACCESS_KEY"
mc --quiet $MC_FLAGS admin policy attach kvpool "$ENGINE_POLICY" --user "$ENGINE_ACCESS_KEY"
touch "$READY_FILE"
echo "bucket $BUCKET, lifecycle, quota and user $ENGINE_ACCESS_KEY ready"
exec sleep infinity
"""


def engine_policy(pool: Pool) -> dict[str, Any]:
    """IAM policy of the engines' user: their pool's objects, listing of the bucket (HEAD of a
    missing object is a 404 only with s3:ListBucket), nothing else (no bucket or admin calls)."""
    bucket = f"arn:aws:s3:::{MINIO_BUCKET}"
    return {
        "Version": "2012-10-17",
        "Statement": [
            {"Effect": "Allow", "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject"],
             "Resource": [f"{bucket}/{store_namespace(pool)}/*"]},
            {"Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": [bucket]},
        ],
    }


def lifecycle(managed: models.ManagedS3) -> dict[str, Any]:
    """mc's JSON form of the bucket lifecycle: every object expires `expireDays` after its write."""
    return {"Rules": [{"ID": "kvpool-expiry", "Status": "Enabled", "Filter": {},
                       "Expiration": {"Days": managed.expire_days}}]}


def _bootstrap(pool: Pool, managed: models.ManagedS3) -> dict[str, Any]:
    scheme = "https" if managed.tls else "http"
    return {
        "name": "bootstrap",
        "image": pool.settings.minio_client_image,
        "imagePullPolicy": pool.settings.image_pull_policy,
        "command": ["sh", "-c", BOOTSTRAP_SCRIPT],
        "env": [
            secret_env("ROOT_USER", pool.minio, "accessKey"),
            secret_env("ROOT_PASSWORD", pool.minio, "secretKey"),
            # the kubelet expands $(...) from the two variables above: the manifest holds no value
            {"name": "MC_HOST_kvpool", "value": f"{scheme}://$(ROOT_USER):$(ROOT_PASSWORD)@127.0.0.1:{MINIO_PORT}"},
            # TLS on loopback inside the pod: the certificate names the Service, not 127.0.0.1
            {"name": "MC_FLAGS", "value": "--insecure" if managed.tls else ""},
            secret_env("ENGINE_ACCESS_KEY", pool.minio, "engineAccessKey"),
            secret_env("ENGINE_SECRET_KEY", pool.minio, "engineSecretKey"),
            {"name": "BUCKET", "value": MINIO_BUCKET},
            {"name": "ENGINE_POLICY", "value": ENGINE_POLICY},
            {"name": "ENGINE_POLICY_JSON", "value": json.dumps(engine_policy(pool), separators=(",", ":"))},
            {"name": "LIFECYCLE", "value": json.dumps(lifecycle(managed), separators=(",", ":"))},
            {"name": "QUOTA_BYTES", "value": str(int(parse_size(managed.storage) * QUOTA_FRACTION))},
            {"name": "MC_CONFIG_DIR", "value": MC_DIR},
            {"name": "READY_FILE", "value": READY_FILE},
        ],
        "readinessProbe": {"exec": {"command": ["test", "-f", READY_FILE]}, "periodSeconds": 5},
        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "128Mi"}},
        "securityContext": RESTRICTED_CONTAINER,
        "volumeMounts": [{"name": "mc", "mountPath": MC_DIR}],
    }


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
    scheme = "HTTPS" if managed.tls else "HTTP"
    mounts: list[dict[str, Any]] = [{"name": "data", "mountPath": "/data"}, {"name": "tmp", "mountPath": "/tmp"}]
    volumes: list[dict[str, Any]] = [
        {"name": "tmp", "emptyDir": {}},
        {"name": "mc", "emptyDir": {"medium": "Memory", "sizeLimit": "16Mi"}},
    ]
    args = ["server", "/data"]
    if managed.tls:
        args = ["server", "--certs-dir", CERTS_DIR, "/data"]
        mounts.append({"name": "tls", "mountPath": CERTS_DIR, "readOnly": True})
        items = [{"key": "tls.crt", "path": "public.crt"}, {"key": "tls.key", "path": "private.key"},
                 {"key": "ca.crt", "path": "CAs/ca.crt"}]
        volumes.append({"name": "tls", "secret": {"secretName": managed.tls.secret_name, "items": items,
                                                   "defaultMode": 0o440}})
    container = {
        "name": "minio",
        "image": managed.image or pool.settings.minio_image,
        "imagePullPolicy": pool.settings.image_pull_policy,
        "args": args,
        "env": [
            secret_env("MINIO_ROOT_USER", pool.minio, "accessKey"),
            secret_env("MINIO_ROOT_PASSWORD", pool.minio, "secretKey"),
            {"name": "MINIO_BROWSER", "value": "off"},
        ],
        "ports": [{"name": "s3", "containerPort": MINIO_PORT, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": "/minio/health/ready", "port": "s3", "scheme": scheme},
                           "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/minio/health/live", "port": "s3", "scheme": scheme},
                          "periodSeconds": 10},
        "resources": {"requests": {"cpu": "250m", "memory": "512Mi"}},
        "securityContext": RESTRICTED_CONTAINER,
        "volumeMounts": mounts,
    }
    pod_spec = {
        "automountServiceAccountToken": False,
        "securityContext": pod_security(1000),
        "containers": [container, _bootstrap(pool, managed)],
        "volumes": volumes,
    }
    statefulset = backend_statefulset(
        pool, pool.minio, "minio", pod_spec,
        persistentVolumeClaimRetentionPolicy={"whenDeleted": "Delete", "whenScaled": "Retain"},
        volumeClaimTemplates=[{"metadata": {"name": "data", "labels": pool.labels("minio")}, "spec": claim_spec}],
    )
    return [statefulset, backend_service(pool, pool.minio, "minio", "s3", MINIO_PORT)]
