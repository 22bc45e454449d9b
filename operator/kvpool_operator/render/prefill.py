"""`<name>-prefill`: the prefill engines of a pool with spec.prefill (prefill/decode disaggregation).

The same engine as the pool's Deployment `<name>` (which then decodes): the same image, model,
connector config (tiers, store namespace), keys Secret (PYTHONHASHSEED, so both roles name a
prompt's chunks alike; the pool key, so each reads what the other sealed), volumes and placement,
with `spec.prefill`'s replicas (none with spec.prefill.autoscaling: its autoscaler owns them), its
resources merged over the engines' and its extraArgs after the model's. The router sends each
request here first (kv_transfer_params do_remote_decode, one token); the engine (the only one whose
connector honours such a request: `handover_requests` in its --kv-transfer-config) saves the prompt's
KV to the pool's tiers and hands it over in the response's kv_transfer_params, which the router
passes to a decode engine that loads it from the shared tier.

Beside the Deployment: a ClusterIP Service (status.roles.prefill.endpoint, metrics scrapes), a
PodDisruptionBudget with more than one replica (or autoscaling.maxReplicas), and with
`<name>-engines` rendered, the same ingress rules for the prefill pods (`<name>-prefill`).
"""

from __future__ import annotations

import copy
from typing import Any

from kvpool_operator.render.autoscaling import replicas_field
from kvpool_operator.render.common import CHECKSUM_ANNOTATION, Pool, checksum, merge
from kvpool_operator.render.configmap import config_data
from kvpool_operator.render.connector import kv_transfer_config
from kvpool_operator.render.engine import compact_json, engine_pod_spec
from kvpool_operator.render.networkpolicy import render_networkpolicy
from kvpool_operator.render.roles import PREFILL, prefill_name, role_labels

COMPONENT = "prefill"


def prefill_pod_spec(pool: Pool) -> dict[str, Any]:
    """The engines' pod with the prefill role's arguments and resources."""
    prefill = pool.spec.prefill
    assert prefill is not None
    pod_spec = engine_pod_spec(pool)
    container = pod_spec["containers"][0]
    args = list(container["args"])
    at = args.index("--kv-transfer-config") + 1
    args[at] = compact_json(kv_transfer_config(pool, prefill=True))  # honours handover requests
    container["args"] = [*args, *prefill.extra_args]
    resources = merge(container.get("resources") or {}, prefill.resources)
    if resources:
        container["resources"] = resources
    return pod_spec


def _deployment(pool: Pool) -> dict[str, Any]:
    assert pool.spec.prefill is not None
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": pool.meta(prefill_name(pool), COMPONENT),
        "spec": {
            **replicas_field(pool.spec.prefill.replicas, pool.spec.prefill.autoscaling),
            "selector": {"matchLabels": pool.selector(COMPONENT)},
            "template": {
                "metadata": {
                    "labels": {**pool.labels(COMPONENT), **role_labels(pool, PREFILL)},
                    "annotations": {CHECKSUM_ANNOTATION: checksum(config_data(pool))},
                },
                "spec": prefill_pod_spec(pool),
            },
        },
    }


def _service(pool: Pool) -> dict[str, Any]:
    port = pool.spec.service.port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": pool.meta(prefill_name(pool), COMPONENT),
        "spec": {
            "type": "ClusterIP",  # clients go through the router; this names the role's pods
            "selector": pool.selector(COMPONENT),
            "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def _pdb(pool: Pool) -> list[dict[str, Any]]:
    prefill = pool.spec.prefill
    assert prefill is not None
    if (prefill.autoscaling.max_replicas if prefill.autoscaling is not None else prefill.replicas) <= 1:
        return []
    return [{
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": pool.meta(prefill_name(pool), COMPONENT),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": pool.selector(COMPONENT)}},
    }]


def _network_policy(pool: Pool) -> list[dict[str, Any]]:
    """`<name>-engines`' ingress rules (apiIngress, kvEvents) on the prefill pods too."""
    out = []
    for policy in render_networkpolicy(pool):
        if policy["metadata"]["name"] == pool.engine_network_policy:
            policy = copy.deepcopy(policy)
            policy["metadata"] = pool.meta(prefill_name(pool), COMPONENT)
            policy["spec"]["podSelector"] = {"matchLabels": pool.selector(COMPONENT)}
            out.append(policy)
    return out


def render_prefill(pool: Pool) -> list[dict[str, Any]]:
    if pool.spec.prefill is None:
        return []
    return [_deployment(pool), _service(pool), *_pdb(pool), *_network_policy(pool)]
