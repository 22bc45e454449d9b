"""PodDisruptionBudget `<name>`: at most one engine down at a time during drains (replicas > 1)."""

from __future__ import annotations

from typing import Any

from kvpool_operator.render.common import Pool


def render_pdb(pool: Pool) -> list[dict[str, Any]]:
    if pool.spec.replicas <= 1:
        return []
    return [
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": pool.meta(pool.name, "engine"),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": pool.selector("engine")}},
        }
    ]
