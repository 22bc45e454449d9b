"""The tier contract: one abstract base, capability attributes, one registry."""

import pytest

from kvpool_connector.store.tiers import Tier, register_tier, registered_types, tier_class


def test_builtin_tiers_declare_their_capabilities():
    caps = {t: (tier_class(t).local, tier_class(t).remote, tier_class(t).shared,
                tier_class(t).hit_source) for t in registered_types()}
    assert caps == {
        "cpu": (True, False, False, "host"),
        "disk": (True, False, True, "disk"),
        "redis": (False, True, True, "external_unspecified"),
        "s3": (False, True, True, "external_unspecified"),
    }
    assert all(issubclass(tier_class(t), Tier) and tier_class(t).type == t
               for t in registered_types())


def test_a_tier_must_implement_the_contract():
    class Half(Tier):
        def put_many(self, records):
            pass

    with pytest.raises(TypeError):
        Half(None, "ns", None)


def test_registry_refuses_unknown_and_duplicate_types():
    with pytest.raises(ValueError, match="unknown tier type 'tape'"):
        tier_class("tape")
    with pytest.raises(ValueError, match="already registered"):
        register_tier("cpu", "kvpool_connector.store.tiers.cpu:CpuTier")
