"""Pure rendering: a KVCachePool (+ operator settings) -> the child manifests. No I/O.

`render(pool, settings)` is what the reconciler applies, what `kvpool-operator render` prints and
what the golden tests pin. Children carry no ownerReferences here: the reconciler adds them at
apply time (it knows the pool's uid); offline output stays reproducible.
"""

from __future__ import annotations

from typing import Any

from kvpool_operator.render.autoscaling import render_autoscaling
from kvpool_operator.render.common import InvalidPool, Pool, load_pool
from kvpool_operator.render.configmap import render_configmap
from kvpool_operator.render.engine import render_engine
from kvpool_operator.render.inferencepool import render_inference_pool
from kvpool_operator.render.minio import render_minio
from kvpool_operator.render.networkpolicy import render_networkpolicy
from kvpool_operator.render.pdb import render_pdb
from kvpool_operator.render.prefill import render_prefill
from kvpool_operator.render.redis import render_redis
from kvpool_operator.render.router import render_router
from kvpool_operator.render.secrets import render_secrets
from kvpool_operator.render.service import render_service
from kvpool_operator.settings import Settings

__all__ = ["InvalidPool", "Pool", "load_pool", "render", "render_pool"]

# Dependencies first: Secrets and config before the workloads that mount them. Every kind they
# produce is in kinds.CHILD_KINDS (what the reconciler lists and prunes, and RBAC grants).
RENDERERS = (
    render_secrets,
    render_configmap,
    render_redis,
    render_minio,
    render_networkpolicy,
    render_engine,
    render_autoscaling,
    render_service,
    render_pdb,
    render_prefill,
    render_router,
    render_inference_pool,
)


def render_pool(pool: Pool) -> list[dict[str, Any]]:
    """Every child of a validated pool. A renderer that fails anyway (a spec the models let through
    and a renderer cannot build) raises InvalidPool naming it: the reconciler reports that as
    ConfigValid=False like any bad spec, instead of a traceback on every retry."""
    manifests = []
    for renderer in RENDERERS:
        try:
            manifests += renderer(pool)
        except Exception as exc:  # noqa: BLE001  (whatever it is, the pool cannot be rendered)
            raise InvalidPool(f"{renderer.__name__.removeprefix('render_')}: cannot render: {_one_line(exc)}") from exc
    return manifests


def _one_line(exc: Exception) -> str:
    errors = getattr(exc, "errors", None)  # a pydantic ValidationError of a model a renderer builds
    if callable(errors):
        return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg'].removeprefix('Value error, ')}" for e in errors())
    return f"{type(exc).__name__}: {exc}"


def render(pool: dict[str, Any], settings: Settings, namespace: str | None = None) -> list[dict[str, Any]]:
    """All child manifests of a KVCachePool object; raises InvalidPool naming the bad field."""
    return render_pool(load_pool(pool, settings, namespace))
