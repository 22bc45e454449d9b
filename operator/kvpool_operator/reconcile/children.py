"""Bring a pool's children to the rendered state: apply what differs, keep generated Secrets, prune.

The decision of what to do is pure (`plan`); `reconcile` is the thin I/O around it.
Children are found by label (`kvpool.dev/pool=<name>`, `app.kubernetes.io/managed-by`), generated
Secrets by their few possible names (the operator may not list Secrets), and whatever else stands
at a child's name by reading that name. They are applied only over objects that are this pool's
(someone else's object of that name is a conflict, reported, never taken over) and pruned only
when they carry an ownerReference to this very pool (same uid).
"""

from __future__ import annotations

import base64
import copy
import json
from dataclasses import dataclass, field
from typing import Any

from kubernetes.client import ApiException
from kubernetes.utils.quantity import parse_quantity

from kvpool_operator import models, policy, validation
from kvpool_operator.kinds import SECRET, WATCHED, ChildKind, enabled
from kvpool_operator.kube import Kube
from kvpool_operator.naming import MANAGER, POOL_LABEL
from kvpool_operator.reconcile.secrets import SecretAction, execute, is_ours, plan_secret
from kvpool_operator.render import InvalidPool, Pool
from kvpool_operator.render.roles import prefill_name, role_endpoints
from kvpool_operator.render.router import router_name
from kvpool_operator.render.secretrefs import referenced_secrets
from kvpool_operator.render.secrets import generate_keys, generated_secret_names
from kvpool_operator.render.service import pool_endpoints
from kvpool_operator.settings import Settings
from kvpool_operator.status import Observation, compute_status

Key = tuple[str, str, str]  # apiVersion, kind, name


def key_of(manifest: dict[str, Any]) -> Key:
    return (manifest["apiVersion"], manifest["kind"], manifest["metadata"]["name"])


def describe(key: Key) -> str:
    return f"{key[1]}/{key[2]}"


def owner_reference(body: dict[str, Any]) -> dict[str, Any]:
    meta = body["metadata"]
    return {
        "apiVersion": models.API_VERSION,
        "kind": models.KIND,
        "name": meta["name"],
        "uid": meta.get("uid", ""),
        "controller": True,
        "blockOwnerDeletion": True,
    }


def with_owner(manifest: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(manifest)
    out["metadata"]["ownerReferences"] = [ref]
    return out


def owned_by(obj: dict[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in obj.get("metadata", {}).get("ownerReferences") or [])


def foreign(key: Key, obj: dict[str, Any], pool_name: str, uid: str) -> str | None:
    """Why a live object of a child's name is not this pool's to apply over, or None when it is:
    owned by the pool, or labelled as its child and owned by nothing (restored from a backup, or
    orphaned by a deletion: adopted). A server-side apply with `force` would take anything else
    over, fields, labels and owner alike."""
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    if owned_by(obj, uid) or (not refs and is_ours(obj, pool_name)):
        return None
    owners = ", ".join(f"{r.get('kind')}/{r.get('name')} (uid {r.get('uid')})" for r in refs)
    whose = f"owned by {owners}" if refs else f"not labelled {POOL_LABEL}={pool_name}, owned by nothing"
    return (f"{describe(key)} exists and is not this pool's ({whose}): the operator never takes over an "
            "object it did not create; delete or rename it")


def _empty(value: Any) -> bool:
    return value is None or value == {} or value == [] or value == ""


def _scalar_equal(want: Any, have: Any) -> bool:
    if want == have:
        return True
    if isinstance(want, (int, float, str)) and isinstance(have, (int, float, str)) and not isinstance(want, bool):
        if str(want) == str(have):
            return True  # the API server turns quantities like `1` into "1"
        try:
            # Kubernetes' own quantity grammar, on purpose: these are fields of Kubernetes objects as
            # the API server writes them back ("1Gi" may return as "1024Mi", "0.5" as "500m", CPU in
            # millicores), not kvpool sizes (parse_size's grammar, checked before anything renders).
            return parse_quantity(want) == parse_quantity(have)
        except ValueError:
            return False
    return False


def is_subset(want: Any, have: Any) -> bool:
    """Does the live object already contain everything rendered? (Server defaults are ignored.)"""
    if isinstance(want, dict):
        if not isinstance(have, dict):
            return False
        return all(
            (k in have and is_subset(v, have[k])) or (k not in have and _empty(v)) for k, v in want.items()
        )
    if isinstance(want, list):
        return isinstance(have, list) and len(want) == len(have) and all(map(is_subset, want, have))
    return _scalar_equal(want, have)


@dataclass
class Plan:
    apply: list[dict[str, Any]] = field(default_factory=list)
    secrets: list[SecretAction] = field(default_factory=list)  # generated Secrets to create or complete
    conflicts: list[str] = field(default_factory=list)  # someone else's object where a child belongs
    unchanged: list[Key] = field(default_factory=list)
    prune: list[Key] = field(default_factory=list)


def plan(desired: list[dict[str, Any]], live: dict[Key, dict[str, Any]], owner_uid: str,
         keep: frozenset[Key] = frozenset()) -> Plan:
    """Pure: which children to apply, which are already right, which to delete (never `keep`),
    and which names someone else's object holds (`live` must hold whatever stands at each desired
    name, labelled or not: every apply is checked against it)."""
    out = Plan()
    wanted = set()
    for manifest in desired:
        key = key_of(manifest)
        wanted.add(key)
        current = live.get(key)
        pool_name = manifest["metadata"]["labels"][POOL_LABEL]
        if generate_keys(manifest):  # never applied: created once, completed, never rewritten
            action = plan_secret(manifest, current, pool_name)
            if isinstance(action, str):
                out.conflicts.append(action)
            elif action is None:
                out.unchanged.append(key)
            else:
                out.secrets.append(action)
        elif current is not None and (problem := foreign(key, current, pool_name, owner_uid)):
            out.conflicts.append(problem)
        elif current is not None and is_subset(manifest, current):
            out.unchanged.append(key)
        else:
            out.apply.append(manifest)
    out.prune = sorted(k for k, obj in live.items()
                       if k not in wanted and k not in keep and owner_uid and owned_by(obj, owner_uid))
    return out


HANDOVER_MANAGER = "kvpool-operator-handover"  # co-owns a Deployment's replicas handed to an autoscaler


def _owns_replicas(entry: dict[str, Any]) -> bool:
    return "f:replicas" in ((entry.get("fieldsV1") or {}).get("f:spec") or {})


def replicas_handover(manifest: dict[str, Any], live: dict[str, Any] | None) -> dict[str, Any] | None:
    """Pure: the apply that hands a Deployment's replicas to its autoscaler, or None.

    Server-side apply removes a field whose only manager stops applying it: the operator's first
    apply of the Deployment without `replicas` (spec.autoscaling just turned on) would reset it to
    Kubernetes' default 1. Applied first under HANDOVER_MANAGER with the live count, the field has
    a second owner and keeps its value. Only while the operator is its one owner (it applied
    replicas before): once anyone else owns it too, nothing is to be handed over."""
    if manifest["kind"] != "Deployment" or "replicas" in manifest.get("spec", {}) or live is None:
        return None
    owners = [e.get("manager") for e in (live.get("metadata") or {}).get("managedFields") or [] if _owns_replicas(e)]
    replicas = (live.get("spec") or {}).get("replicas")
    if set(owners) != {MANAGER} or replicas is None:
        return None
    meta = manifest["metadata"]
    return {"apiVersion": manifest["apiVersion"], "kind": "Deployment",
            "metadata": {"name": meta["name"], "namespace": meta["namespace"]}, "spec": {"replicas": replicas}}


@dataclass
class Outcome:
    status: dict[str, Any]
    applied: list[str] = field(default_factory=list)  # "created Deployment/x" / "updated ..."
    pruned: list[str] = field(default_factory=list)
    unchanged: int = 0
    invalid: str | None = None
    recheck: bool = False  # invalid because of something outside the spec (a Secret): look again later
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # allowed, but logged as a warning every pass


def selector_string(pool_name: str) -> str:
    return f"app.kubernetes.io/component=engine,app.kubernetes.io/instance={pool_name},{POOL_LABEL}={pool_name}"


def listed_kinds(settings: Settings) -> tuple[ChildKind, ...]:
    """Every child kind these settings allow, less those read by name only (Secrets)."""
    return tuple(k for k in enabled(settings) if not k.by_name)


def list_children(kube: Kube, namespace: str, pool_name: str, kinds: tuple[ChildKind, ...],
                  secrets: bool = True) -> dict[Key, dict[str, Any]]:
    """Live children of `kinds` by label, plus (with `secrets`) generated Secrets by name."""
    labels = {POOL_LABEL: pool_name, "app.kubernetes.io/managed-by": MANAGER}
    live: dict[Key, dict[str, Any]] = {}
    for kind in kinds:
        for obj in kube.list(kind.api_version, kind.kind, namespace, labels):
            live[(*kind.key, obj["metadata"]["name"])] = obj
    if secrets:
        for name in generated_secret_names(pool_name):
            secret = kube.get(*SECRET, namespace, name)
            if secret is not None:  # someone else's too: plan() must see it to leave it alone
                live[(*SECRET, name)] = secret
    return live


def unlisted(kube: Kube, namespace: str, desired: list[dict[str, Any]],
             live: dict[Key, dict[str, Any]]) -> dict[Key, dict[str, Any]]:
    """Objects at the names of desired children that the label listing did not show: someone
    else's, or ours with our labels removed. Read by name so that no apply goes over them unseen
    (Secrets were read by name already). An object created between this read and the apply is
    the one gap left: server-side apply has no create-only precondition."""
    found = {}
    for manifest in desired:
        key = key_of(manifest)
        if key not in live and key[:2] != SECRET:
            obj = kube.get(key[0], key[1], namespace, key[2])
            if obj is not None:
                found[key] = obj
    return found


def secret_value(secret: dict[str, Any], key: str) -> str | None:
    """A key's value as text (kept in memory only, never logged or reported)."""
    if key in (secret.get("stringData") or {}):
        return secret["stringData"][key]
    raw = (secret.get("data") or {}).get(key)
    if raw is None:
        return None
    try:
        return base64.b64decode(raw).decode()
    except (ValueError, UnicodeDecodeError):
        return ""


def check_secrets(kube: Kube, pool: Pool) -> str | None:
    """User-provided Secrets must exist with well-formed keys, else engines would crash-loop."""
    problems = []
    secrets: dict[str, dict[str, Any] | None] = {}
    for ref in referenced_secrets(pool):
        if ref.name not in secrets:
            secrets[ref.name] = kube.get("v1", "Secret", pool.namespace, ref.name)
        secret = secrets[ref.name]
        value = None if secret is None else secret_value(secret, ref.key)
        if secret is None:
            problems.append(f"{ref.field}: Secret {ref.name!r} not found in namespace {pool.namespace!r}")
        elif value is None:
            problems.append(f"{ref.field}: Secret {ref.name!r} has no key {ref.key!r}")
        elif ref.check is not None and (problem := ref.check(value)):
            problems.append(f"{ref.field}: Secret {ref.name!r} key {ref.key!r} {problem}")
    return "; ".join(dict.fromkeys(problems)) or None


def _observation(body: dict[str, Any], pool: Pool | None, live: dict[Key, dict[str, Any]], **kw: Any) -> Observation:
    meta = body["metadata"]
    name = meta["name"]
    backends = {}
    endpoints = {}
    desired = body.get("spec", {}).get("replicas", 1)
    deployment = live.get(("apps/v1", "Deployment", name))
    if pool is not None:
        desired = pool.spec.replicas
        if pool.spec.autoscaling is not None:  # the autoscaler's choice (a Deployment without one has 1)
            desired = ((deployment or {}).get("spec") or {}).get("replicas", 1)
        for component, managed in (("redis", pool.managed_redis), ("minio", pool.managed_s3)):
            if managed is not None:
                backends[component] = live.get(("apps/v1", "StatefulSet", f"{name}-{component}"))
        endpoints = pool_endpoints(pool)
        kw.setdefault("insecure", tuple(policy.insecure_backends(pool.spec)))
        if pool.spec.router is not None:
            kw["router"] = live.get(("apps/v1", "Deployment", router_name(pool)))
            kw["router_replicas"] = pool.spec.router.replicas
        if pool.spec.prefill is not None:
            kw["prefill"] = live.get(("apps/v1", "Deployment", prefill_name(pool)))
            kw["prefill_replicas"] = pool.spec.prefill.replicas
            if pool.spec.prefill.autoscaling is not None:  # its autoscaler's choice, as for the engines
                kw["prefill_replicas"] = ((kw["prefill"] or {}).get("spec") or {}).get("replicas", 1)
            kw["role_endpoints"] = role_endpoints(pool)
    return Observation(
        generation=meta.get("generation"),
        desired_replicas=desired,
        selector=selector_string(name),
        deployment=deployment,
        backends=backends,
        endpoints=endpoints,
        previous=body.get("status") or {},
        **kw,
    )


def reconcile(kube: Kube, body: dict[str, Any], settings: Settings, now: str) -> Outcome:
    """One full pass. Invalid specs touch no child; API errors on one child do not stop the others."""
    meta = body["metadata"]
    namespace, name, uid = meta["namespace"], meta["name"], meta.get("uid", "")
    live = list_children(kube, namespace, name, listed_kinds(settings))
    recheck = False
    sizes: tuple[str, ...] = ()
    try:
        checked = validation.check(body, settings)  # what `kvpool render` and `kvpool validate` run
        pool, rendered = checked.pool, checked.manifests
        sizes = tuple(checked.sizes)
        invalid = check_secrets(kube, pool)
        recheck = invalid is not None
    except InvalidPool as exc:
        pool, invalid = None, str(exc)
    if invalid is not None:
        status = compute_status(_observation(body, pool, live, invalid=invalid, sizes=sizes), now)
        return Outcome(status=status, invalid=invalid, recheck=recheck, unchanged=len(live))

    assert pool is not None
    ref = owner_reference(body)
    desired = [with_owner(m, ref) for m in rendered]
    # a Secret the spec now names (say keysSecretRef: <name>-kvpool-keys) is in use, never pruned
    in_use = frozenset((*SECRET, r.name) for r in referenced_secrets(pool))
    steps = plan(desired, {**live, **unlisted(kube, namespace, desired, live)}, uid, keep=in_use)
    if steps.conflicts:  # someone else's object stands where ours belongs: touch nothing, look again later
        invalid = "; ".join(steps.conflicts)
        status = compute_status(_observation(body, pool, live, invalid=invalid, sizes=sizes), now)
        return Outcome(status=status, invalid=invalid, recheck=True, unchanged=len(live))
    outcome = Outcome(status={}, unchanged=len(steps.unchanged),
                      warnings=policy.exposure_warnings(pool.spec) + policy.model_warnings(pool.spec))
    for action in steps.secrets:
        try:
            outcome.applied.append(execute(kube, action))
        except ApiException as exc:
            if exc.status == 409 and action.create:
                # created since we looked (a concurrent pass: the drift timer runs beside the handlers,
                # or its owner): never overwritten, planned again from what the next pass reads
                continue
            outcome.errors.append(f"Secret/{action.name}: {exc.status} {exc.reason}: {_api_message(exc)}")
    for manifest in [*steps.apply, *(m for m in desired if key_of(m) in steps.unchanged)]:
        handover = replicas_handover(manifest, live.get(key_of(manifest)))
        if handover is not None:  # before the first apply without replicas (even a later one)
            try:
                kube.apply(handover, manager=HANDOVER_MANAGER)
            except ApiException as exc:
                outcome.errors.append(f"{describe(key_of(manifest))}: replicas handover: {exc.status} {exc.reason}")
                steps.apply = [m for m in steps.apply if m is not manifest]  # never reset replicas to 1
    for manifest in steps.apply:
        key = key_of(manifest)
        verb = "updated" if key in live else "created"
        try:
            live[key] = kube.apply(manifest)
            outcome.applied.append(f"{verb} {describe(key)}")
        except ApiException as exc:
            outcome.errors.append(f"{describe(key)}: {exc.status} {exc.reason}: {_api_message(exc)}")
    for key in steps.prune:
        try:
            kube.delete(key[0], key[1], namespace, key[2])
            live.pop(key, None)
            outcome.pruned.append(describe(key))
        except ApiException as exc:
            outcome.errors.append(f"prune {describe(key)}: {exc.status} {exc.reason}")
    obs = _observation(body, pool, live, apply_errors=tuple(outcome.errors), sizes=sizes)
    outcome.status = compute_status(obs, now)
    return outcome


def _api_message(exc: ApiException) -> str:
    try:
        return json.loads(exc.body or "{}").get("message", "") or str(exc.body)[:300]
    except ValueError:
        return str(exc.body)[:300]


def refresh_status(kube: Kube, body: dict[str, Any], settings: Settings, now: str) -> dict[str, Any] | None:
    """Status only (on child events): reads children, changes nothing but the pool's status.

    None until the pool has been reconciled once: without observedGeneration a status would look
    (to kstatus, Argo CD, Flux and tests) like a verdict on a spec nobody has looked at yet.
    """
    previous = body.get("status") or {}
    if previous.get("observedGeneration") is None:
        return None
    meta = body["metadata"]
    live = list_children(kube, meta["namespace"], meta["name"], WATCHED, secrets=False)
    # Not a reconcile: report the generation last reconciled, not the one just written.
    body = {**body, "metadata": {**meta, "generation": previous.get("observedGeneration")}}
    try:
        checked = validation.check(body, settings)
    except InvalidPool as exc:
        return compute_status(_observation(body, None, live, invalid=str(exc)), now)
    pool = checked.pool
    invalid = None
    for cond in previous.get("conditions", []) or []:
        if cond.get("type") == "ConfigValid" and cond.get("status") == "False":
            invalid = cond.get("message") or "invalid"
    return compute_status(_observation(body, pool, live, invalid=invalid, sizes=tuple(checked.sizes)), now)
