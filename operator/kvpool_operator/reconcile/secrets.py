"""Generated Secrets: created only if absent, adopted only when labelled, never overwritten.

The operator may not list Secrets (RBAC grants get/create/patch/delete): it reads the few names
a pool's generated Secrets can have (render.secrets.generated_secret_names). A Secret of such a
name that is not labelled as this pool's (managed-by kvpool-operator, kvpool.dev/pool=<pool>)
belongs to someone else: a conflict, reported and never touched. A labelled one is adopted: keys
it lacks (written by an older operator, or by hand) are added, existing values never change, so
a reconcile never rotates a credential and a user's rotation sticks.

`plan_secret` is pure; `generated_values` is the only randomness; `execute` is the I/O.
"""

from __future__ import annotations

import copy
import secrets
from dataclasses import dataclass
from typing import Any

from kvpool_operator.kube import Kube
from kvpool_operator.naming import MANAGER, POOL_LABEL
from kvpool_operator.render.secrets import generate_keys


@dataclass(frozen=True)
class SecretAction:
    """What to do with one generated Secret."""

    manifest: dict[str, Any]  # as rendered, with the pool's ownerReference
    create: bool  # absent: create it with every key
    add_keys: tuple[str, ...]  # keys to generate (all of them when creating)
    adopt: bool = False  # labelled ours but without an ownerReference: set ours

    @property
    def name(self) -> str:
        return self.manifest["metadata"]["name"]


def is_ours(obj: dict[str, Any], pool_name: str) -> bool:
    labels = obj.get("metadata", {}).get("labels") or {}
    return labels.get("app.kubernetes.io/managed-by") == MANAGER and labels.get(POOL_LABEL) == pool_name


def present_keys(obj: dict[str, Any]) -> set[str]:
    """Keys a live Secret holds (`stringData` too: a real API server folds it into `data`)."""
    return set(obj.get("data") or {}) | set(obj.get("stringData") or {})


def conflict_message(name: str, pool_name: str) -> str:
    return (f"Secret {name!r} exists but is not labelled app.kubernetes.io/managed-by={MANAGER}, "
            f"{POOL_LABEL}={pool_name}: the operator never overwrites a Secret it did not create; "
            "delete or rename it, or add those labels to let the operator adopt it")


def plan_secret(manifest: dict[str, Any], current: dict[str, Any] | None,
                pool_name: str) -> SecretAction | str | None:
    """Pure: a SecretAction, a conflict message, or None when the live Secret is complete."""
    keys = generate_keys(manifest)
    if current is None:
        return SecretAction(manifest, create=True, add_keys=tuple(keys))
    if not is_ours(current, pool_name):
        return conflict_message(manifest["metadata"]["name"], pool_name)
    missing = tuple(k for k in keys if k not in present_keys(current))
    adopt = not current.get("metadata", {}).get("ownerReferences")
    if missing or adopt:
        return SecretAction(manifest, create=False, add_keys=missing, adopt=adopt)
    return None


def generate_value(key: str) -> str:
    """A fresh random value in the form its consumer needs."""
    if key == "hashSeed":
        return str(secrets.randbelow(2**32))  # PYTHONHASHSEED: a decimal in [0, 4294967295]
    if key.endswith("ccessKey"):  # accessKey, engineAccessKey: an S3 user name (MinIO: >= 3 chars)
        return "kvpool-" + secrets.token_hex(6)
    return secrets.token_urlsafe(32)  # 43 URL-safe characters (256 bits)


def generated_values(keys: tuple[str, ...] | list[str]) -> dict[str, str]:
    return {key: generate_value(key) for key in keys}


def execute(kube: Kube, action: SecretAction) -> str:
    """Create or complete the Secret; returns what was done (key names only, never values)."""
    meta = action.manifest["metadata"]
    values = generated_values(action.add_keys)
    if action.create:
        kube.create({**copy.deepcopy(action.manifest), "stringData": values})
        return f"created Secret/{action.name}"
    body: dict[str, Any] = {}
    if values:
        body["stringData"] = values
    if action.adopt:
        body["metadata"] = {"ownerReferences": meta.get("ownerReferences", [])}
    kube.patch("v1", "Secret", meta["namespace"], action.name, body)
    done = [f"added keys {', '.join(action.add_keys)}"] if action.add_keys else []
    if action.adopt:
        done.append("adopted")
    return f"{' and '.join(done)}: Secret/{action.name}"
