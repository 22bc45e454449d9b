"""What every child shares: names, labels, selectors, the pool context, checksums."""

from __future__ import annotations

import copy
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from kvpool_operator import models, policy
from kvpool_operator.naming import (  # re-exported for the renderers (`X as X`)
    CHECKSUM_ANNOTATION as CHECKSUM_ANNOTATION,
    GENERATE_ANNOTATION as GENERATE_ANNOTATION,
    MANAGER as MANAGER,
    MAX_POOL_NAME as MAX_POOL_NAME,
    POOL_LABEL as POOL_LABEL,
)
from kvpool_operator.settings import Settings

CONFIG_DIR = "/etc/kvpool"
CONFIG_FILE = f"{CONFIG_DIR}/connector.yaml"
DISK_PATH = "/var/lib/kvpool/disk"
HTTP_PORT = models.ENGINE_PORT
REDIS_PORT = 6379
MINIO_PORT = 9000
MINIO_BUCKET = "kvpool"

REDIS_KEY_PREFIX = "kvpool:"  # the Redis tier's key_prefix; its ACL grants ~<prefix><store namespace>:*
REDIS_ENGINE_USER = "kvpool-engine"  # managed Redis: the ACL user of the engines
TLS_CA_DIR = "/etc/kvpool-tls"  # engines: <dir>/<tier>/ca.crt verifies a backend's TLS certificate
REDIS_PASSWORD_ENV = "KVPOOL_REDIS_PASSWORD"
S3_ACCESS_KEY_ENV = "KVPOOL_S3_ACCESS_KEY"
S3_SECRET_KEY_ENV = "KVPOOL_S3_SECRET_KEY"

# The pool's keys Secret (generated `<name>-kvpool-keys`, or the user's spec.security.keysSecretRef).
POOL_KEY = "poolKey"  # MACs (and optionally encrypts) every object in the shared tiers
PREVIOUS_POOL_KEY = "previousPoolKey"  # only during a rotation: objects under it stay readable
HASH_SEED = "hashSeed"  # PYTHONHASHSEED: vLLM's prefix hashes, identical on every replica
POOL_KEY_ENV = "KVPOOL_POOL_KEY"
PREVIOUS_POOL_KEY_ENV = "KVPOOL_POOL_KEY_PREVIOUS"


# RFC 1035 label: a pool's name is also its Services' (`<name>`, `<name>-redis`), which must be one.
DNS_LABEL = r"[a-z]([-a-z0-9]*[a-z0-9])?"


def child_name(pool_name: str, component: str) -> str:
    """`<pool>-<component>`: the names of a pool's children (also known without parsing its spec)."""
    return f"{pool_name}-{component}"


class InvalidPool(ValueError):
    """The pool cannot be rendered; the message names the field."""


@dataclass(frozen=True)
class Pool:
    """A validated pool: metadata plus the parsed spec."""

    name: str
    namespace: str
    spec: models.KVCachePoolSpec
    settings: Settings

    # names of children
    @property
    def config_map(self) -> str:
        return child_name(self.name, "kvpool")

    @property
    def redis(self) -> str:
        return child_name(self.name, "redis")

    @property
    def minio(self) -> str:
        return child_name(self.name, "minio")

    @property
    def network_policy(self) -> str:
        return child_name(self.name, "backends")

    @property
    def engine_network_policy(self) -> str:
        return child_name(self.name, "engines")

    @property
    def keys_secret(self) -> str:
        """Where the pool key and hash seed live: the user's Secret, else the generated one."""
        ref = self.spec.security.keys_secret_ref
        return ref.name if ref is not None else child_name(self.name, "kvpool-keys")

    def svc_host(self, service: str) -> str:
        return f"{service}.{self.namespace}.svc"

    def labels(self, component: str) -> dict[str, str]:
        return {
            "app.kubernetes.io/name": "kvpool",
            "app.kubernetes.io/instance": self.name,
            "app.kubernetes.io/component": component,
            "app.kubernetes.io/managed-by": MANAGER,
            "app.kubernetes.io/part-of": "kvpool",
            POOL_LABEL: self.name,
        }

    def selector(self, component: str) -> dict[str, str]:
        return {
            "app.kubernetes.io/instance": self.name,
            "app.kubernetes.io/component": component,
            POOL_LABEL: self.name,
        }

    def meta(self, name: str, component: str, **extra: Any) -> dict[str, Any]:
        return {"name": name, "namespace": self.namespace, "labels": self.labels(component), **extra}

    @property
    def managed_redis(self) -> models.ManagedRedis | None:
        return self.spec.tiers.redis.managed if self.spec.tiers.redis else None

    @property
    def managed_s3(self) -> models.ManagedS3 | None:
        return self.spec.tiers.s3.managed if self.spec.tiers.s3 else None


def load_pool(pool: dict[str, Any], settings: Settings, namespace: str | None = None) -> Pool:
    """Validate a KVCachePool object (as from the API or a YAML file) and the operator's policy."""
    if pool.get("kind") not in (None, models.KIND):
        raise InvalidPool(f"kind: {pool['kind']!r} is not {models.KIND}")
    if pool.get("apiVersion") not in (None, models.API_VERSION):
        raise InvalidPool(f"apiVersion: {pool['apiVersion']!r} is not {models.API_VERSION} (the only version "
                          f"of {models.KIND})")
    meta = pool.get("metadata") or {}
    if not isinstance(meta, dict):
        raise InvalidPool(f"metadata: must be a mapping, not {type(meta).__name__}")
    name = meta.get("name") or ""
    if not name:
        raise InvalidPool("metadata.name: required")
    if not isinstance(name, str) or not re.fullmatch(DNS_LABEL, name):
        raise InvalidPool(f"metadata.name: {name!r} must be a DNS label (lowercase letters, digits and '-', "
                          "starting with a letter, ending with a letter or digit): it names Services")
    if len(name) > MAX_POOL_NAME:
        raise InvalidPool(f"metadata.name: at most {MAX_POOL_NAME} characters (children append -minio)")
    ns = namespace or meta.get("namespace") or "default"
    spec = pool.get("spec") or {}
    if not isinstance(spec, dict):
        raise InvalidPool(f"spec: must be a mapping, not {type(spec).__name__}")
    try:
        spec = models.parse_spec(spec)
    except ValueError as exc:
        raise InvalidPool(models.format_error(exc)) from exc
    refused = policy.refusals(spec, settings)
    if refused:
        raise InvalidPool("; ".join(refused))
    return Pool(name=name, namespace=ns, spec=spec, settings=settings)


def checksum(*parts: Any) -> str:
    """Stable sha256 of JSON-serialisable parts (dict order does not matter)."""
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def ca_file(tier: str) -> str:
    return f"{TLS_CA_DIR}/{tier}/ca.crt"


def secret_env(env: str, secret: str, key: str, optional: bool = False) -> dict[str, Any]:
    """An env var filled from a Secret by the kubelet: the value never appears in a manifest."""
    ref: dict[str, Any] = {"name": secret, "key": key}
    if optional:
        ref["optional"] = True
    return {"name": env, "valueFrom": {"secretKeyRef": ref}}


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`override` deep-merged over `base` (dicts merge, anything else replaces); both unchanged."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
