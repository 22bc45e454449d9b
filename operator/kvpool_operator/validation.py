"""One validation path for a KVCachePool: what the reconciler, `kvpool render` and `kvpool
validate` all run, so that a pool one of them accepts none of the others refuses.

`check` = the models (CRD rules), the operator's policy (its settings), the memory account (a
user-set limit below what the engine maps: render/memory.py), every renderer, and the warnings
(allowed, but worth saying: sizes no node can hold). Pure: a document and settings in, a checked
pool or InvalidPool naming the field out. The CLIs add only reading files and printing.

Exit codes of both commands (docs/operator.md, "Validate and render offline"): 0 every document
is a valid pool (warnings do not fail), 1 some document is invalid (a YAML syntax error, an empty
file, a wrong kind or a field the operator would refuse), 2 the command cannot run as asked (bad
arguments, a path that cannot be read, bad KVPOOL_* settings).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

from kvpool_operator import models, policy
from kvpool_operator.render import InvalidPool, Pool, load_pool, memory, render_pool
from kvpool_operator.settings import Settings

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2


@dataclass(frozen=True)
class Checked:
    """A pool that passed: its children as the operator would apply them, and the warnings (sizes:
    those about pods no node holds, the operator's SizesFit condition)."""

    pool: Pool
    manifests: list[dict[str, Any]]
    warnings: list[str]
    sizes: list[str]


def check(doc: Any, settings: Settings, namespace: str | None = None) -> Checked:
    """The reconciler's validation of a pool object: raises InvalidPool naming the field."""
    if not isinstance(doc, dict):
        raise InvalidPool(f"expected a {models.KIND} mapping, got a {type(doc).__name__}")
    pool = load_pool(doc, settings, namespace)
    memory.check_fits(pool)
    manifests = render_pool(pool)
    sizes = policy.size_warnings(pool.spec, manifests)
    return Checked(pool=pool, manifests=manifests, warnings=policy.model_warnings(pool.spec) + sizes, sizes=sizes)


def kind_problem(doc: dict[str, Any]) -> str | None:
    """Why a document from a file is not a KVCachePool (a file may hold anything; the API only
    pools): kind and apiVersion are required there, and a near miss is named."""
    kind = doc.get("kind")
    if kind is None:
        return f"kind: required ({models.KIND}, apiVersion {models.API_VERSION})"
    if kind != models.KIND:
        close = difflib.get_close_matches(str(kind), [models.KIND], n=1, cutoff=0.6)
        hint = f"; did you mean {models.KIND}?" if close else f" (only {models.KIND} documents are pools)"
        return f"kind: {kind!r} is not {models.KIND}{hint}"
    if doc.get("apiVersion") is None:
        return f"apiVersion: required ({models.API_VERSION})"
    return None


def check_document(doc: Any, settings: Settings, namespace: str | None = None) -> Checked:
    """`check` for a document read from a file: kind and apiVersion must be spelled out."""
    if isinstance(doc, dict) and (problem := kind_problem(doc)):
        raise InvalidPool(problem)
    return check(doc, settings, namespace)


def describe(doc: Any) -> str:
    """How reports name a document: `KVCachePool <name>` (or `<unnamed>`)."""
    if not isinstance(doc, dict):
        return "document"
    meta = doc.get("metadata")
    name = meta.get("name") if isinstance(meta, dict) else None
    return f"{doc.get('kind') or models.KIND} {name or '<unnamed>'}"
