"""kopf handlers: thin shells around reconcile/children.py.

create/update/resume run a full pass; a timer repeats it (drift correction, status refresh);
Deployment/StatefulSet events of our children refresh the owner's status at once. Status goes
through kopf's `patch` so it lands together with kopf's own bookkeeping.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable
from typing import Any

import kopf
from kubernetes.client import ApiException
from urllib3.exceptions import HTTPError

from kvpool_operator import models
from kvpool_operator.kinds import WATCHED
from kvpool_operator.kube import Kube
from kvpool_operator.naming import MANAGER, POOL_LABEL
from kvpool_operator.reconcile.children import Outcome, is_subset, reconcile, refresh_status
from kvpool_operator.settings import Settings

FINALIZER = "kvpool.dev/finalizer"
ANNOTATION_PREFIX = "kvpool.dev"


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _kube(memo: kopf.Memo) -> Kube:
    kube = memo.get("kube")
    if kube is None:
        raise kopf.TemporaryError("Kubernetes client not initialised yet", delay=1)
    return kube


def _condition(status: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions", []) if c.get("type") == ctype), {})


def _report(outcome: Outcome, body: kopf.Body, logger: kopf.Logger, previous: dict[str, Any]) -> None:
    """Kubernetes Events for what changed; warnings for invalid specs, insecure backends and
    sizes no node holds (once per message) and errors."""
    insecure = _condition(outcome.status, "BackendsSecure")
    if (
        insecure.get("status") == "False"
        and _condition(previous, "BackendsSecure").get("message") != insecure["message"]
    ):
        kopf.event(body, type="Warning", reason="InsecureBackend", message=insecure["message"])
    sizes = _condition(outcome.status, "SizesFit")
    if sizes.get("status") == "False" and _condition(previous, "SizesFit").get("message") != sizes["message"]:
        kopf.event(body, type="Warning", reason="ExceedsNodeMemory", message=sizes["message"])
    for change in outcome.applied:
        kopf.event(body, type="Normal", reason="Applied", message=change)
    for pruned in outcome.pruned:
        kopf.event(body, type="Normal", reason="Pruned", message=f"deleted {pruned} (no longer rendered)")
    if outcome.invalid is not None:
        if _condition(previous, "ConfigValid").get("message") != outcome.invalid:
            kopf.event(
                body,
                type="Warning",
                reason="InvalidSpec",
                message=f"{outcome.invalid}; existing children left untouched",
            )
        logger.warning("invalid spec, children untouched: %s", outcome.invalid)
    for error in outcome.errors:
        kopf.event(body, type="Warning", reason="ApplyFailed", message=error)
    for warning in outcome.warnings:
        logger.warning("%s", warning)


def _reconcile(settings: Settings, body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo,
               logger: kopf.Logger) -> None:
    try:
        outcome = reconcile(_kube(memo), dict(body), settings, now())
    except ApiException as exc:  # listing/reading failed: the API is unwell, retry with backoff
        raise kopf.TemporaryError(f"Kubernetes API error {exc.status} {exc.reason}",
                                  delay=settings.retry_delay) from exc
    except HTTPError as exc:  # no answer within kube.TIMEOUT, connection lost
        raise kopf.TemporaryError(f"Kubernetes API unreachable: {exc}", delay=settings.retry_delay) from exc
    previous = dict(body.get("status") or {})
    if not is_subset(outcome.status, previous):  # no write when nothing changed
        patch.status.update(outcome.status)
    _report(outcome, body, logger, previous)
    if outcome.errors:
        raise kopf.TemporaryError("; ".join(outcome.errors), delay=settings.retry_delay)
    if outcome.recheck:
        # A missing Secret may appear any moment: keep checking (typos in the spec wait for an edit).
        raise kopf.TemporaryError(outcome.invalid, delay=settings.retry_delay)
    logger.info("reconciled: %d applied, %d pruned, %d unchanged",
                len(outcome.applied), len(outcome.pruned), outcome.unchanged)


def build_registry(settings: Settings, login: Callable[..., Any] | None = None) -> kopf.OperatorRegistry:
    """A fresh registry with every handler; `login` overrides how kopf reaches the API (tests)."""
    registry = kopf.OperatorRegistry()
    resource = (models.GROUP, models.VERSION, models.PLURAL)

    @kopf.on.login(registry=registry)
    def login_fn(**kwargs: Any) -> kopf.ConnectionInfo | None:
        return (login or kopf.login_via_client)(**kwargs)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        settings.persistence.finalizer = FINALIZER
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=ANNOTATION_PREFIX)
        settings.posting.level = logging.WARNING  # our own Events are explicit; no per-handler noise
        settings.execution.max_workers = 8
        if memo.get("kube") is None:
            memo["kube"] = Kube.from_environment()

    @kopf.on.create(*resource, registry=registry, backoff=settings.retry_delay, id="reconcile")
    @kopf.on.update(*resource, registry=registry, backoff=settings.retry_delay, id="reconcile")
    @kopf.on.resume(*resource, registry=registry, backoff=settings.retry_delay, id="reconcile")
    def reconcile_fn(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: kopf.Logger,
                     **_: Any) -> None:
        _reconcile(settings, body, patch, memo, logger)  # returns nothing: kopf would store it in status

    @kopf.timer(*resource, registry=registry, interval=settings.reconcile_interval,
                initial_delay=settings.reconcile_interval, idle=None, id="drift")
    def drift_fn(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: kopf.Logger,
                 **_: Any) -> None:
        if body.get("metadata", {}).get("deletionTimestamp"):
            return
        try:
            _reconcile(settings, body, patch, memo, logger)
        except kopf.TemporaryError as exc:  # a timer retries on its own next tick
            logger.warning("drift correction incomplete: %s", exc)

    child_labels: dict[str, Any] = {"app.kubernetes.io/managed-by": MANAGER, POOL_LABEL: kopf.PRESENT}

    def child_status(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
        """A child workload changed (pods became ready, a rollout finished): refresh the owner's status."""
        owner_name = body["metadata"]["labels"][POOL_LABEL]
        namespace = body["metadata"]["namespace"]
        kube = memo.get("kube")
        if kube is None:
            return
        try:
            pool = kube.get(models.API_VERSION, models.KIND, namespace, owner_name)
            if pool is None or pool.get("metadata", {}).get("deletionTimestamp"):
                return
            status = refresh_status(kube, pool, settings, now())
            if status is not None and not is_subset(status, pool.get("status") or {}):
                kube.patch_status(namespace, owner_name, status)
        except (ApiException, HTTPError) as exc:
            logger.warning("status refresh of %s/%s failed: %s", namespace, owner_name, getattr(exc, "reason", exc))

    for kind in WATCHED:
        group, _, version = kind.api_version.rpartition("/")
        kopf.on.event(group, version, kind.plural, labels=child_labels, registry=registry,
                      id=f"status-{kind.plural}")(child_status)

    @kopf.on.delete(*resource, registry=registry, optional=True, id="goodbye")
    def goodbye(body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
        logger.info("pool deleted; Kubernetes garbage-collects its children through ownerReferences")

    return registry
