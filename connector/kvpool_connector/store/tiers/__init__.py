"""Tier registry: config `type` -> implementation.

The built-in tiers are registered by "module:Class" and imported on first use, so that a
store without a redis or s3 tier needs neither redis-py nor boto3. A new tier is one module
with a `Tier` subclass and one `register_tier` call (plus its config model in
`kvpool_connector.config`).
"""

from __future__ import annotations

import importlib

from .base import Tier

_REGISTRY: dict[str, type[Tier] | str] = {}


def register_tier(type_name: str, tier: type[Tier] | str) -> None:
    """Make `type_name` (a tier config's `type`) build `tier`: a `Tier` subclass, or its
    "module:Class" path, imported the first time a store (or a capability check) needs it."""
    if type_name in _REGISTRY:
        raise ValueError(f"tier type {type_name!r} is already registered")
    _REGISTRY[type_name] = tier


def registered_types() -> list[str]:
    return sorted(_REGISTRY)


def tier_class(type_name: str) -> type[Tier]:
    """The class registered for a tier type; its capability attributes (`local`, `remote`,
    `shared`, `hit_source`, ...) describe that tier without building one."""
    try:
        target = _REGISTRY[type_name]
    except KeyError:
        raise ValueError(f"unknown tier type {type_name!r}; known: {registered_types()}") from None
    if isinstance(target, str):
        module, _, name = target.partition(":")
        target = _REGISTRY[type_name] = getattr(importlib.import_module(module), name)
    return target


register_tier("cpu", "kvpool_connector.store.tiers.cpu:CpuTier")
register_tier("disk", "kvpool_connector.store.tiers.disk:DiskTier")
register_tier("redis", "kvpool_connector.store.tiers.redis:RedisTier")
register_tier("s3", "kvpool_connector.store.tiers.s3:S3Tier")

__all__ = ["Tier", "register_tier", "registered_types", "tier_class"]
