"""Helpers of the store tests."""

from __future__ import annotations

from kvpool_connector.store import TieredStore, open_store
from tests.conftest import SECURITY


def build_store(namespace: str, *tiers: dict, layout: bytes = b"test-layout",
                timeout: float = 5.0, security: dict | None = None, **settings) -> TieredStore:
    """A store of `tiers` (fastest first) in `namespace`, keyed with the session's pool key
    (`security` replaces that block). The default bound is generous: these tests check
    function, and moto on 2 busy cores can be slow."""
    return open_store({"namespace": namespace, "tiers": list(tiers), "timeout_seconds": timeout,
                       "security": SECURITY if security is None else security, **settings},
                      layout=layout)
