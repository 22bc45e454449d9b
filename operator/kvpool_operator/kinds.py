"""The one list of Kubernetes kinds a pool's children can be.

Everything that names child kinds derives from `CHILD_KINDS`: the reconciler (what it lists,
reads by name and prunes), the API client's URL table (kube.PLURALS), the RBAC rules
(rbac.RBAC_RULES: what each kind needs), the handlers' watches and the tests' API emulator. A new
rendered kind is one entry here (plus its renderer): its RBAC and its client paths follow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ChildKind:
    api_version: str
    kind: str
    plural: str
    watched: bool = False  # handlers watch it: its status flows into the pool's (RBAC adds `watch`)
    by_name: bool = False  # read by its known names, never listed (listing Secrets would read them all)
    setting: str | None = None  # rendered, listed and granted only when this operator setting is on

    @property
    def key(self) -> tuple[str, str]:
        return (self.api_version, self.kind)

    @property
    def group(self) -> str:
        """API group ("" for the core group)."""
        return self.api_version.rpartition("/")[0]


# In the order the RBAC rules list them.
CHILD_KINDS: tuple[ChildKind, ...] = (
    ChildKind("v1", "Secret", "secrets", by_name=True),
    ChildKind("v1", "ConfigMap", "configmaps"),
    ChildKind("v1", "Service", "services"),
    ChildKind("v1", "ServiceAccount", "serviceaccounts"),
    ChildKind("apps/v1", "Deployment", "deployments", watched=True),
    ChildKind("apps/v1", "StatefulSet", "statefulsets", watched=True),
    ChildKind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets"),
    ChildKind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies"),
    ChildKind("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings"),
    ChildKind("inference.networking.k8s.io/v1", "InferencePool", "inferencepools", setting="inference_pools"),
    ChildKind("autoscaling/v2", "HorizontalPodAutoscaler", "horizontalpodautoscalers"),
    ChildKind("keda.sh/v1alpha1", "ScaledObject", "scaledobjects", setting="keda"),
)

SECRET = ("v1", "Secret")
WATCHED = tuple(k for k in CHILD_KINDS if k.watched)  # the workloads whose status the pool's reads


def enabled(settings: Any) -> tuple[ChildKind, ...]:
    """The child kinds these operator settings allow (the always-on ones and the opted-in)."""
    return tuple(k for k in CHILD_KINDS if k.setting is None or getattr(settings, k.setting))


def optional_settings() -> tuple[str, ...]:
    """The operator settings that turn on a kind, in table order."""
    return tuple(dict.fromkeys(k.setting for k in CHILD_KINDS if k.setting))
