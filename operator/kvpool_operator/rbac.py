"""The one list of API permissions the operator uses (Kubernetes PolicyRule shape).

The Helm chart's ClusterRole/Role and its tests derive from `RBAC_RULES` (and `rules_for`, which
adds what the settings turn on). Tests pin it verbatim, compare it with the requests the real
operator sends to the emulator and with the table in docs/helm.md, so a verb the code stops
using, or starts using, fails a test.
"""

from __future__ import annotations

from typing import Any

from kvpool_operator import models
from kvpool_operator.kinds import CHILD_KINDS, ChildKind, optional_settings

RBAC_GROUP = "rbac.authorization.k8s.io"
# Children (kinds.CHILD_KINDS): applied server-side (patch; create when absent), listed by label to
# find and compare them, read by name where the listing shows nothing (so that an apply never goes
# over someone else's object of that name unseen: `get` reads no more than `list` already does),
# pruned. Never `update` (no PUT anywhere), `watch` only where a handler watches (the workloads
# whose status flows into the pool's). Secrets are read by their known names instead of listed
# (listing would read every Secret in the namespace), created only if absent, completed by patch,
# pruned. A pool's router needs a ServiceAccount and a RoleBinding of it to the shipped discovery
# ClusterRole (render/router.py); the `bind` on that one ClusterRole is in `router_binding_rule`.
APPLIED = ["get", "list", "create", "patch", "delete"]
BY_NAME = ["get", "create", "patch", "delete"]


def child_verbs(kind: ChildKind) -> list[str]:
    return [*(BY_NAME if kind.by_name else APPLIED), *(["watch"] if kind.watched else [])]


def child_rules(kinds: tuple[ChildKind, ...] | list[ChildKind]) -> list[dict[str, Any]]:
    """One rule per API group and set of verbs, in the order of the kinds table."""
    grouped: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for kind in kinds:
        grouped.setdefault((kind.group, tuple(child_verbs(kind))), []).append(kind.plural)
    return [{"apiGroups": [group], "resources": plurals, "verbs": list(verbs)}
            for (group, verbs), plurals in grouped.items()]


RBAC_RULES: list[dict[str, Any]] = [
    # The pools: kopf watches them and patches finalizers/annotations; child events read one pool.
    {"apiGroups": [models.GROUP], "resources": [models.PLURAL], "verbs": ["get", "list", "watch", "patch"]},
    {"apiGroups": [models.GROUP], "resources": [f"{models.PLURAL}/status"], "verbs": ["patch"]},
    *child_rules([k for k in CHILD_KINDS if k.setting is None]),
    # Kubernetes Events about pools (kopf posts them to core/v1 events, never patches them).
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    # kopf: CRD observation, namespace observation (namespaced mode), peering between replicas.
    {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"], "verbs": ["list", "watch"]},
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
    {
        "apiGroups": ["kopf.dev"],
        "resources": ["clusterkopfpeerings", "kopfpeerings"],
        "verbs": ["list", "watch", "patch"],
    },
]

# Granted only with the operator setting of that name (the chart's operator.settings.<camelCase name>
# grants both): without it the operator never lists or writes these kinds (kinds.ChildKind.setting).
OPTIONAL_RULES: dict[str, list[dict[str, Any]]] = {
    setting: child_rules([k for k in CHILD_KINDS if k.setting == setting]) for setting in optional_settings()
}

# Roles for people, aggregated into the built-in `admin` ClusterRole (namespace admins) and `view`
# (everyone who may read a namespace). Never into `edit`: a pool starts pods that hold the pool's
# keys, mount the node directories the operator allows and talk to its backends, so creating one
# is a namespace admin's decision (further narrowed by examples/admission/).
POOL_ADMIN_RULES: list[dict[str, Any]] = [
    {"apiGroups": [models.GROUP], "resources": [models.PLURAL],
     "verbs": ["get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"]},
    {"apiGroups": [models.GROUP], "resources": [f"{models.PLURAL}/scale"], "verbs": ["get", "update", "patch"]},
    {"apiGroups": [models.GROUP], "resources": [f"{models.PLURAL}/status"], "verbs": ["get"]},
]
POOL_VIEWER_RULES: list[dict[str, Any]] = [
    {"apiGroups": [models.GROUP], "resources": [models.PLURAL, f"{models.PLURAL}/scale", f"{models.PLURAL}/status"],
     "verbs": ["get", "list", "watch"]},
]
USER_ROLES = {"admin": POOL_ADMIN_RULES, "view": POOL_VIEWER_RULES}  # built-in role aggregated into -> rules

# Cluster-scoped resources: a namespaced install still needs a ClusterRole for these.
CLUSTER_SCOPED = {("apiextensions.k8s.io", "customresourcedefinitions"), ("", "namespaces"),
                  ("kopf.dev", "clusterkopfpeerings")}


# What a pool's router needs for service discovery (vllm-router 0.1.17 lists and watches every pod
# of its namespace and filters by label itself, so no resourceNames or selector can narrow it). The
# chart ships it once as the ClusterRole <fullname>-router-discovery (the operator setting
# router_discovery_role names it); the operator binds it per pool with a RoleBinding, which grants
# it in that namespace only. So the operator itself needs no pods access and creates no Roles.
ROUTER_DISCOVERY_RULES: list[dict[str, Any]] = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]


def router_binding_rule(role: str) -> dict[str, Any]:
    """`bind` on exactly one ClusterRole: without it Kubernetes lets the operator create a RoleBinding
    to a role only when it holds every permission of that role itself (pods list/watch)."""
    return {"apiGroups": [RBAC_GROUP], "resources": ["clusterroles"], "verbs": ["bind"], "resourceNames": [role]}


def rules_for(settings: Any) -> list[dict[str, Any]]:
    """RBAC_RULES, the bind on the router discovery ClusterRole these settings name, and the
    optional rules they turn on."""
    return [*RBAC_RULES, router_binding_rule(settings.router_discovery_role),
            *(rule for key, rules in OPTIONAL_RULES.items() if getattr(settings, key) for rule in rules)]


def allows(api_group: str, resource: str, verb: str, rules: list[dict[str, Any]] = RBAC_RULES,
           name: str | None = None) -> bool:
    """Whether `rules` grant `verb` on `resource` (named `name`, where a rule has resourceNames)."""
    return any(
        api_group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]
        and ("resourceNames" not in rule or name in rule["resourceNames"])
        for rule in rules
    )
