"""User-provided Secrets a pool references, and what their values must look like.

The reconciler checks these before applying anything (a missing Secret or a malformed key would
otherwise crash-loop the engines); messages name the field and the key, never the value.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvpool_operator.render.common import HASH_SEED, POOL_KEY, Pool

TLS_KEYS = ("tls.crt", "tls.key", "ca.crt")  # a kubernetes.io/tls Secret with its CA, as cert-manager writes it
MIN_POOL_KEY = 32  # the connector refuses shorter keys
MAX_HASH_SEED = 2**32 - 1  # Python refuses any other PYTHONHASHSEED


def _pool_key(value: str) -> str | None:
    return None if len(value) >= MIN_POOL_KEY else f"must hold at least {MIN_POOL_KEY} characters"


def _hash_seed(value: str) -> str | None:
    if value.isascii() and value.isdigit() and int(value) <= MAX_HASH_SEED:
        return None
    return f"must be a decimal integer in [0, {MAX_HASH_SEED}] (PYTHONHASHSEED)"


@dataclass(frozen=True)
class SecretRef:
    field: str  # spec path, for messages
    name: str
    key: str
    check: Callable[[str], str | None] | None = None  # problem with the decoded value, or None


def referenced_secrets(pool: Pool) -> list[SecretRef]:
    """Every user-provided Secret key the pool's children need."""
    spec = pool.spec
    tiers = spec.tiers
    refs = []
    keys = spec.security.keys_secret_ref
    if keys is not None:
        field = "spec.security.keysSecretRef"
        refs += [SecretRef(field, keys.name, POOL_KEY, _pool_key), SecretRef(field, keys.name, HASH_SEED, _hash_seed)]
    if spec.model.hf_token_secret_ref is not None:
        ref = spec.model.hf_token_secret_ref
        refs.append(SecretRef("spec.model.hfTokenSecretRef", ref.name, ref.key))
    if spec.service.api_key_secret_ref is not None:
        ref = spec.service.api_key_secret_ref
        refs.append(SecretRef("spec.service.apiKeySecretRef", ref.name, ref.key))
    for tier in ("redis", "s3"):  # TLS: a managed backend's certificate, an external one's CA
        backend = getattr(tiers, tier)
        if backend and backend.managed and backend.managed.tls:
            name = backend.managed.tls.secret_name
            refs += [SecretRef(f"spec.tiers.{tier}.managed.tls", name, key) for key in TLS_KEYS]
        if backend and backend.external and backend.external.ca_secret_ref:
            ref = backend.external.ca_secret_ref
            refs.append(SecretRef(f"spec.tiers.{tier}.external.caSecretRef", ref.name, ref.key))
    if tiers.redis and tiers.redis.external and tiers.redis.external.password_secret_ref:
        ref = tiers.redis.external.password_secret_ref
        refs.append(SecretRef("spec.tiers.redis.external.passwordSecretRef", ref.name, ref.key))
    if tiers.s3 and tiers.s3.external and tiers.s3.external.credentials_secret_ref:
        creds = tiers.s3.external.credentials_secret_ref
        field = "spec.tiers.s3.external.credentialsSecretRef"
        refs += [SecretRef(field, creds.name, creds.access_key_key), SecretRef(field, creds.name, creds.secret_key_key)]
    return refs
