"""Prefill/decode disaggregation (spec.prefill): the role labels and names both roles' renderers,
the router and status share.

With spec.prefill, the pool's engine Deployment `<name>` decodes and `<name>-prefill` prefills.
Their pods carry `llm-d.ai/role: prefill|decode`, the label llm-d's inference scheduler reads, and
the router discovers each role by it. The engine Deployment's selector is left as it was (a
Deployment's selector cannot change): the role label is on its pods only, and the prefill pods'
component (`prefill`) keeps them out of the engines' selector, Service and PodDisruptionBudget.
"""

from __future__ import annotations

from kvpool_operator.render.common import POOL_LABEL, Pool, child_name

ROLE_LABEL = "llm-d.ai/role"
PREFILL = "prefill"
DECODE = "decode"


def prefill_name(pool: Pool) -> str:
    """`<name>-prefill`: the prefill Deployment, Service, PodDisruptionBudget and NetworkPolicy."""
    return child_name(pool.name, PREFILL)


def role_labels(pool: Pool, role: str) -> dict[str, str]:
    """The role label of a pod template: none without spec.prefill (a plain pool's pods roll only
    when it turns P/D on)."""
    return {ROLE_LABEL: role} if pool.spec.prefill is not None else {}


def role_selector(pool: Pool, role: str) -> dict[str, str]:
    """Which of the pool's pods serve a role: what the router discovers them by."""
    return {"app.kubernetes.io/instance": pool.name, POOL_LABEL: pool.name, ROLE_LABEL: role}


def role_endpoints(pool: Pool) -> dict[str, str]:
    """Each role's Service (status.roles.<role>.endpoint): `<name>-prefill` and the engines' `<name>`."""
    port = pool.spec.service.port
    return {PREFILL: f"http://{pool.svc_host(prefill_name(pool))}:{port}", DECODE: f"http://{pool.svc_host(pool.name)}:{port}"}
