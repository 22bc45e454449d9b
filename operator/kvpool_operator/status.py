"""Pure status computation: from what was observed to the pool's `.status`.

kstatus compatible: `observedGeneration`, a `Ready` condition for `kubectl wait` and Argo CD,
and the kstatus pair `Reconciling` / `Stalled` that Flux and cli-utils read. Conditions keep
their `lastTransitionTime` while their status does not change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "ConfigValid", "BackendsReady", "BackendsSecure",
                   "SizesFit", "Reconciling", "Stalled")


@dataclass(frozen=True)
class Observation:
    """Everything status depends on; gathered by the reconciler, no I/O here."""

    generation: int | None
    desired_replicas: int  # spec.replicas, or the autoscaler's (the engine Deployment's spec.replicas)
    selector: str
    invalid: str | None = None  # why the spec cannot be applied (ConfigValid=False)
    apply_errors: tuple[str, ...] = ()
    deployment: dict[str, Any] | None = None
    backends: dict[str, dict[str, Any] | None] = field(default_factory=dict)  # component -> StatefulSet
    router: dict[str, Any] | None = None  # the router Deployment (pools with spec.router)
    router_replicas: int | None = None  # spec.router.replicas; None: the pool has no router
    prefill: dict[str, Any] | None = None  # the prefill Deployment (pools with spec.prefill)
    prefill_replicas: int | None = None  # spec.prefill.replicas or its autoscaler's; None: no prefill role
    role_endpoints: dict[str, str] = field(default_factory=dict)  # role -> its Service's URL
    endpoints: dict[str, str] = field(default_factory=dict)
    insecure: tuple[str, ...] = ()  # external backends without password or TLS (a warning, not an error)
    sizes: tuple[str, ...] = ()  # pods no node of their sort can hold (policy.size_warnings; a warning)
    previous: dict[str, Any] = field(default_factory=dict)  # the current .status


def public_url(url: str) -> str:
    """scheme://host[:port]/path of a URL: status is readable by anyone who may read the pool, so
    userinfo, query and fragment (where credentials could hide) never reach it."""
    if not url:
        return ""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))


def _condition(prev: dict[str, dict[str, Any]], ctype: str, ok: bool, reason: str, message: str,
               generation: int | None, now: str) -> dict[str, Any]:
    status = "True" if ok else "False"
    old = prev.get(ctype)
    since = old["lastTransitionTime"] if old and old.get("status") == status and old.get("lastTransitionTime") else now
    cond = {"type": ctype, "status": status, "lastTransitionTime": since, "reason": reason, "message": message}
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def _backend_state(backends: dict[str, dict[str, Any] | None]) -> tuple[bool, str]:
    waiting = []
    for component, statefulset in sorted(backends.items()):
        want = (statefulset or {}).get("spec", {}).get("replicas", 1)
        ready = (statefulset or {}).get("status", {}).get("readyReplicas", 0) or 0
        if statefulset is None or ready < want:
            waiting.append(f"{component} {ready}/{want} ready")
    return (not waiting, "; ".join(waiting))


def _deadline_exceeded(deployment: dict[str, Any]) -> bool:
    for cond in deployment.get("status", {}).get("conditions", []) or []:
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return True
    return False


def compute_status(obs: Observation, now: str) -> dict[str, Any]:
    prev_conditions = {c["type"]: c for c in obs.previous.get("conditions", []) or [] if "type" in c}
    prev_phase = obs.previous.get("phase")
    dep_status = (obs.deployment or {}).get("status", {}) or {}
    ready = dep_status.get("readyReplicas", 0) or 0
    updated = dep_status.get("updatedReplicas", 0) or 0
    dep_gen = (obs.deployment or {}).get("metadata", {}).get("generation")
    observed = dep_gen is None or dep_status.get("observedGeneration", 0) >= dep_gen
    backends_ok, backends_msg = _backend_state(obs.backends)
    want = obs.desired_replicas
    router_ok, router_msg = True, ""
    if obs.router_replicas is not None:  # clients reach the pool through the router: it must be ready too
        router_ready = ((obs.router or {}).get("status") or {}).get("readyReplicas", 0) or 0
        router_ok = router_ready >= obs.router_replicas
        router_msg = f"router {router_ready}/{obs.router_replicas} ready"

    if obs.prefill_replicas is not None:  # P/D: a request needs a prefill engine as well as a decode one
        prefill_status = (obs.prefill or {}).get("status") or {}
        prefill_ready = prefill_status.get("readyReplicas", 0) or 0
        prefill_ok = obs.prefill is not None and prefill_ready >= obs.prefill_replicas
        prefill_msg = f"prefill {prefill_ready}/{obs.prefill_replicas} ready"
        router_ok = router_ok and prefill_ok
        router_msg = ", ".join(filter(None, [prefill_msg, router_msg]))

    def cond(ctype: str, ok: bool, reason: str, message: str = "") -> dict[str, Any]:
        return _condition(prev_conditions, ctype, ok, reason, message, obs.generation, now)

    stalled = False
    if obs.invalid is not None:
        phase, reason, message = "Invalid", "InvalidSpec", obs.invalid
        stalled = True
    elif obs.apply_errors:
        phase, reason, message = "Degraded", "ApplyFailed", "; ".join(obs.apply_errors)
        stalled = True
    elif obs.deployment is not None and _deadline_exceeded(obs.deployment):
        phase, reason, message = "Degraded", "ProgressDeadlineExceeded", "engine rollout exceeded its deadline"
        stalled = True
    elif obs.deployment is not None and observed and updated >= want and ready >= want and backends_ok and router_ok:
        phase, reason, message = (
            "Ready",
            "Ready",
            ", ".join(filter(None, [f"{ready}/{want} engines ready", router_msg])),
        )
    elif prev_phase in ("Ready", "Degraded") and observed and updated >= want:
        detail = backends_msg if not backends_ok else router_msg if not router_ok else f"{ready}/{want} engines ready"
        phase, reason, message = "Degraded", "Unavailable", detail
    elif obs.deployment is None or (ready == 0 and prev_phase in (None, "Pending")):
        phase, reason, message = "Pending", "Pending", "waiting for engines to be scheduled and started"
    else:
        waiting = [f"{ready}/{want} engines ready, {updated}/{want} updated"]
        if not backends_ok:
            waiting.append(backends_msg)
        if not router_ok:
            waiting.append(router_msg)
        phase, reason, message = "Progressing", "RollingOut", "; ".join(waiting)

    progressing = phase in ("Pending", "Progressing")
    conditions = [
        cond("Ready", phase == "Ready", reason, message),
        cond("Progressing", progressing, reason if progressing else "Idle", message if progressing else ""),
        cond("Degraded", phase == "Degraded", reason if phase == "Degraded" else "AsExpected",
             message if phase == "Degraded" else ""),
        cond("ConfigValid", obs.invalid is None, "InvalidSpec" if obs.invalid else "Valid", obs.invalid or ""),
        cond("BackendsReady", backends_ok, "BackendsReady" if backends_ok else "BackendsNotReady",
             backends_msg or ("no managed backends" if not obs.backends else "all managed backends ready")),
        cond("BackendsSecure", not obs.insecure, "InsecureBackend" if obs.insecure else "Secure",
             "; ".join(obs.insecure)),
        cond("SizesFit", not obs.sizes, "ExceedsNodeMemory" if obs.sizes else "Fits", "; ".join(obs.sizes)),
        cond("Reconciling", progressing, reason if progressing else "Idle", message if progressing else ""),
        cond("Stalled", stalled, reason if stalled else "AsExpected", message if stalled else ""),
    ]
    status: dict[str, Any] = {
        "phase": phase,
        "replicas": dep_status.get("replicas", 0) or 0,
        "desiredReplicas": want,
        "readyReplicas": ready,
        "selector": obs.selector,
        "conditions": conditions,
        "endpoints": {name: public_url(url) for name, url in obs.endpoints.items()},
    }
    roles = _roles(obs, dep_status)
    if roles is not None:
        status["roles"] = roles
    elif obs.previous.get("roles") and obs.invalid is None:
        status["roles"] = None  # spec.prefill is gone: a merge patch of status drops the block
    if obs.generation is not None:
        status["observedGeneration"] = obs.generation
    return status


def _roles(obs: Observation, decode_status: dict[str, Any]) -> dict[str, Any] | None:
    """status.roles: each role's pods, ready pods and Service (pools with spec.prefill). None for a
    pool without, and for a spec that cannot be read (left as it was: its children are too)."""
    if obs.prefill_replicas is None:
        return None
    prefill_status = (obs.prefill or {}).get("status") or {}
    return {role: {"desiredReplicas": want, "replicas": dep.get("replicas", 0) or 0,
                   "readyReplicas": dep.get("readyReplicas", 0) or 0,
                   "endpoint": public_url(obs.role_endpoints.get(role, ""))}
            for role, want, dep in (("prefill", obs.prefill_replicas, prefill_status),
                                    ("decode", obs.desired_replicas, decode_status))}
