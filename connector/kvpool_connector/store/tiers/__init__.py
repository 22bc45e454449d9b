"""Tier registry: config `type` -> implementation, imported lazily so that a store without a
redis or s3 tier needs neither redis-py nor boto3."""

from __future__ import annotations

import importlib

from .base import Tier

REGISTRY: dict[str, str] = {
    "cpu": "kvpool_connector.store.tiers.cpu:CpuTier",
    "disk": "kvpool_connector.store.tiers.disk:DiskTier",
    "redis": "kvpool_connector.store.tiers.redis:RedisTier",
    "s3": "kvpool_connector.store.tiers.s3:S3Tier",
}


def tier_class(type_: str) -> type[Tier]:
    try:
        target = REGISTRY[type_]
    except KeyError:
        raise ValueError(f"unknown tier type {type_!r}; known: {sorted(REGISTRY)}") from None
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


__all__ = ["REGISTRY", "Tier", "tier_class"]
