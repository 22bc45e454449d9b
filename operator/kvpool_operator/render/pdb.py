"""PodDisruptionBudget `<name>`: at most one engine down at a time during drains (replicas,
or autoscaling.maxReplicas, > 1)."""

from __future__ import annotations

from typing import Any

from kvpool_operator.render.common import Pool


def render_pdb(pool: Pool) -> list[dict[str, Any]]:
    scaling = pool.spec.autoscaling
    if (scaling.max_replicas if scaling is not None else pool.spec.replicas) <= 1:
        return []
    return [
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": pool.meta(pool.name, "engine"),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": pool.selector("engine")}},
        }
    ]
