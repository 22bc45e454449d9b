"""Tier registry: config `type` -> implementation and config model.

A new tier is one module with a `Tier` subclass and a config model (a `TierConfigBase`
subclass with `type: Literal["<type>"] = "<type>"`), and one call:

    register_tier("<type>", MyTier, MyTierConfig)

From then on store configs accept `{"type": "<type>", ...}` (validated, and in the JSON
schema, as `MyTierConfig`) and a store builds `MyTier` for it. A tier outside this package
also names its module in the `kvpool_connector.tiers` entry point group of its
distribution, so that every process reading configs (the engines, `kvpool validate`)
imports it when a config names the type:

    [project.entry-points."kvpool_connector.tiers"]
    mytier = "mypackage.mytier"

The built-in tiers are registered by "module:Class" and imported on first use, so that a
store without a redis or s3 tier needs neither redis-py nor boto3.
"""

from __future__ import annotations

import importlib

from ...config import (
    CpuTierConfig,
    DiskTierConfig,
    RedisTierConfig,
    S3TierConfig,
    TierConfigBase,
    register_tier_config,
)
from .base import Tier

_REGISTRY: dict[str, type[Tier] | str] = {}


def register_tier(type_name: str, tier: type[Tier] | str,
                  config_model: type[TierConfigBase]) -> None:
    """Make `type_name` (a tier config's `type`) a tier: configs naming it validate as
    `config_model`, and a store builds `tier` (a `Tier` subclass, or its "module:Class"
    path, imported the first time a store or a capability check needs it)."""
    if type_name in _REGISTRY:
        raise ValueError(f"tier type {type_name!r} is already registered")
    if not isinstance(tier, str) and not (isinstance(tier, type) and issubclass(tier, Tier)
                                          and tier.type == type_name):
        raise ValueError(f"tier type {type_name!r}: {tier!r} is not a Tier subclass whose "
                         f"`type` is {type_name!r}")
    if not isinstance(tier, str) and tier.local and "size" not in config_model.model_fields:
        raise ValueError(f"tier type {type_name!r}: a local tier's config model needs a "
                         "`size` field (its bytes)")
    register_tier_config(type_name, config_model)
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


def local_size(cfg: TierConfigBase) -> int:
    """The bytes a local tier's config bounds it to (its `size`, which every local tier's
    config has: register_tier checks); 0 for a tier that is not local."""
    return int(getattr(cfg, "size", 0)) if tier_class(cfg.type).local else 0


register_tier("cpu", "kvpool_connector.store.tiers.cpu:CpuTier", CpuTierConfig)
register_tier("disk", "kvpool_connector.store.tiers.disk:DiskTier", DiskTierConfig)
register_tier("redis", "kvpool_connector.store.tiers.redis:RedisTier", RedisTierConfig)
register_tier("s3", "kvpool_connector.store.tiers.s3:S3Tier", S3TierConfig)

__all__ = ["Tier", "TierConfigBase", "local_size", "register_tier", "registered_types",
           "tier_class"]
