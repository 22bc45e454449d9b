"""What an engine container maps, item by item: the one account its memory request and limit and
its /dev/shm size are rendered from (`kvpool render --explain` prints it).

Every item is host memory the pod's cgroup is charged for, counted once:
- vLLM's process (`model.memoryOverhead`): Python, torch, the CUDA context; on CPU nodes
  (`gpus: 0`) the model's weights too, which then live in host memory;
- vLLM's paged KV cache where it is host memory (`gpus: 0`: `model.cpuKvCacheGiB`, rendered as
  VLLM_CPU_KVCACHE_SPACE; left unset, vLLM would reserve 90% of the node's memory, not the pod's);
- tiered: kvpool's cpu tier (`tiers.cpu.size`, pinned), the save staging and the lower tiers'
  write queues (bounded by the rendered store config);
- native: vLLM's host region, one file of `cpu_bytes_to_use` in /dev/shm
  (`/dev/shm/vllm_offload_<engine>.mmap`, vLLM checks the free space before creating it), so
  /dev/shm is sized to it plus `model.shmSize`; and the write queues of kvpool's secondary tier;
- /dev/shm's own `model.shmSize` (tmpfs pages are the pod's memory: NCCL, vLLM's message queues).

Pure: a validated pool in, the account out; `check_fits` refuses a user-set memory limit below it.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from kubernetes.utils import parse_quantity

from kvpool_connector.config import parse_size
from kvpool_operator import models
from kvpool_operator.render.common import InvalidPool, Pool, merge
from kvpool_operator.render.connector import QUEUE_BYTES, STAGING_BYTES, connector_config
from kvpool_operator.render.roles import DECODE, PREFILL

GIB = 1 << 30


@dataclass(frozen=True)
class Item:
    """One part of the account: what it is, its bytes, and the field that sets it."""

    what: str
    nbytes: int
    field: str
    in_shm: bool = False  # a file in /dev/shm: /dev/shm's sizeLimit holds it


@dataclass(frozen=True)
class Account:
    """An engine's memory: its items, their sum (request = limit), and /dev/shm's size."""

    items: tuple[Item, ...]

    @property
    def total(self) -> int:
        return sum(item.nbytes for item in self.items)

    @property
    def shm_bytes(self) -> int:
        """/dev/shm's sizeLimit: the items that are files there (the native region, shmSize)."""
        return sum(item.nbytes for item in self.items if item.in_shm)


def cpu_kv_cache_bytes(pool: Pool) -> int:
    """vLLM's paged KV cache in host memory: on the CPU platform (`gpus: 0`) only, where every
    tensor-parallel rank's worker allocates VLLM_CPU_KVCACHE_SPACE GiB of its own."""
    model = pool.spec.model
    return model.cpu_kv_cache_gib * GIB * model.tensor_parallel_size if model.gpus == 0 else 0


def account(pool: Pool) -> Account:
    """The items an engine maps (see the module docstring). Both roles (decode, prefill) run the
    same engine, connector config and /dev/shm: one account; only the user's resources
    (`prefill.resources` over `model.resources`) differ per role, which `check_fits` reads."""
    spec = pool.spec
    model = spec.model
    weights = " and, on CPU nodes, the model's weights" if model.gpus == 0 else ""
    items = [Item(f"vLLM's process (Python, torch{weights})", parse_size(model.memory_overhead),
                  "spec.model.memoryOverhead")]
    if model.gpus == 0:
        ranks = f" x {model.tensor_parallel_size} ranks" if model.tensor_parallel_size > 1 else ""
        items.append(Item(f"vLLM's paged KV cache in host memory (VLLM_CPU_KVCACHE_SPACE{ranks})",
                          cpu_kv_cache_bytes(pool), "spec.model.cpuKvCacheGiB"))
    cpu = spec.tiers.cpu
    if cpu is not None and spec.connector == "tiered":
        items.append(Item("kvpool's cpu tier (pinned)", parse_size(cpu.size), "spec.tiers.cpu.size"))
    if cpu is not None and spec.connector == "native":
        items.append(Item("vLLM's native host region (/dev/shm/vllm_offload_*.mmap)", parse_size(cpu.size),
                          "spec.tiers.cpu.size", in_shm=True))
    config = connector_config(pool)
    if config is not None and spec.connector == "tiered":
        items.append(Item("kvpool's save staging", parse_size(STAGING_BYTES), "the connector's staging_bytes"))
    queues = 0 if config is None else len(config.tiers) - 1  # every store tier after the first
    if queues:
        items.append(Item(f"write queues of {queues} lower tier{'s' if queues > 1 else ''}",
                          queues * parse_size(QUEUE_BYTES), "spec.tiers"))
    items.append(Item("/dev/shm for vLLM and NCCL", parse_size(model.shm_size), "spec.model.shmSize", in_shm=True))
    return Account(tuple(items))


def roles(pool: Pool) -> list[str]:
    """The engine roles a pool runs: decode (the engines), and prefill with spec.prefill."""
    return [DECODE, PREFILL] if pool.spec.prefill is not None else [DECODE]


def user_resources(pool: Pool, role: str) -> tuple[dict[str, Any], str]:
    """The resources the user set for a role's engines, and the field they come from."""
    model_resources = pool.spec.model.resources
    if role == PREFILL and pool.spec.prefill is not None:
        prefill = pool.spec.prefill.resources
        field = "spec.prefill.resources" if "memory" in (prefill.get("limits") or {}) else "spec.model.resources"
        return merge(model_resources, prefill), field
    return model_resources, "spec.model.resources"


def _quantity(value: Any, field: str) -> Decimal:
    try:
        return Decimal(parse_quantity(value))
    except (ValueError, TypeError, InvalidOperation):
        raise InvalidPool(f"{field}: {value!r} is not a Kubernetes quantity") from None


def check_fits(pool: Pool) -> None:
    """Refuse a user-set memory limit below what the role's engine maps (the kernel would
    OOM-kill it once its tiers fill), naming the field and the account's total."""
    need = account(pool).total
    for role in roles(pool):
        resources, field = user_resources(pool, role)
        limit = (resources.get("limits") or {}).get("memory")
        if limit is None:
            continue
        if _quantity(limit, f"{field}.limits.memory") < need:
            raise InvalidPool(
                f"{field}.limits.memory: {limit} is below the {models.format_size(need)} the {role} engine maps "
                f"(`kvpool render --explain` itemizes it); raise the limit or lower tiers.cpu.size, "
                f"model.shmSize, model.memoryOverhead or model.cpuKvCacheGiB")


def explain(pool: Pool) -> str:
    """The account of every role, one line per item: what `kvpool render --explain` prints."""
    lines = []
    acc = account(pool)
    for role in roles(pool):
        resources, field = user_resources(pool, role)
        total = models.format_size(acc.total)
        request = (resources.get("requests") or {}).get("memory", total)
        limit = (resources.get("limits") or {}).get("memory", total)
        source = f", from {field}" if (request, limit) != (total, total) else ""
        lines.append(f"{pool.namespace}/{pool.name} {role} engine maps {total} "
                     f"(memory request {request}, limit {limit}{source})")
        width = max(len(item.what) for item in acc.items)
        for item in acc.items:
            lines.append(f"  {item.what:<{width}}  {models.format_size(item.nbytes):>8}  {item.field}")
        lines.append(f"  /dev/shm sizeLimit: {models.format_size(acc.shm_bytes)}")
    return "\n".join(lines) + "\n"
