"""The check that no secret reaches a rendered object or a pool's status, shared by the render
tests (every example) and the property tests (random specs with a secret written into them)."""

from __future__ import annotations

import json
from typing import Any

from kvpool_operator.reconcile.secrets import generated_values
from kvpool_operator.render import load_pool
from kvpool_operator.render.secrets import generate_keys, generated_secret_names
from kvpool_operator.render.service import pool_endpoints
from kvpool_operator.settings import Settings
from kvpool_operator.status import Observation, compute_status

SENTINEL = "s3cr3t-Sentinel"  # a secret someone wrote into a spec; it must be refused or stay out


def assert_no_secret_values(obj: dict[str, Any], manifests: list[dict[str, Any]], settings: Settings) -> None:
    """No secret reaches a rendered object or the status: neither one written into the spec, nor a
    generated credential (values exist only in the Secret the reconciler creates)."""
    pool = load_pool(obj, settings)
    status = compute_status(Observation(generation=1, desired_replicas=pool.spec.replicas, selector="s",
                                        endpoints=pool_endpoints(pool)), "2026-01-01T00:00:00Z")
    generated = []
    for manifest in manifests:
        if manifest["kind"] == "Secret":
            assert "data" not in manifest and "stringData" not in manifest
            assert manifest["metadata"]["name"] in generated_secret_names(obj["metadata"]["name"])
            generated += generated_values(generate_keys(manifest)).values()
    blob = json.dumps([manifests, status])
    assert SENTINEL not in blob
    assert not [value for value in generated if value in blob]
