"""`kvpool plan -f POOL.yaml`: the pool to replay, read from a `KVCachePool` manifest that the
operator's own validator accepts (a pool it refuses is refused here, in its one line).

What a manifest says, the model takes: engine replicas, chunkTokens, the router's policy, and
each tier's capacity as the store sees it: the cpu tier per engine; a disk tier per engine on
a node-local volume, or one shared by every engine on a claim (persistentVolumeClaim); a
managed Redis holds its maxmemory (85% of `memory`), a managed MinIO its bucket quota (90% of
`storage`). What it cannot say (an external Redis or S3's capacity, vLLM's own cache) comes
from the command line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvpool_connector.config import parse_size
from kvpool_connector.plan.sim import PoolModel, TierModel

REDIS_MAXMEMORY = 0.85   # ManagedRedis: maxmemory is 85% of memory (allkeys-lru)
MINIO_QUOTA = 0.90       # ManagedS3: the bucket's quota is 90% of storage
GI = 1 << 30


class PoolFileError(ValueError):
    """A manifest the planner cannot model; one line naming the field."""


@dataclass(frozen=True)
class PlannedPool:
    pool: PoolModel
    notes: list[str]          # what the model approximates for this manifest
    name: str
    gpus: int = 1             # per engine (spec.model.gpus)
    cpu_kv_cache: int = 0     # gpus 0: vLLM's own KV cache per engine (cpuKvCacheGiB x TP)


def managed_memory(capacity: int) -> int:
    """The managed Redis `memory` whose maxmemory holds `capacity` bytes, whole GiB (pure)."""
    return math.ceil(capacity / REDIS_MAXMEMORY / GI) * GI


def managed_storage(capacity: int) -> int:
    """The managed MinIO `storage` whose quota holds `capacity` bytes, whole GiB (pure)."""
    return math.ceil(capacity / MINIO_QUOTA / GI) * GI


def from_spec(spec: Any, name: str, *, bytes_per_token: int, engines: int | None = None,
              routing: str | None = None, external_size: int = 0) -> PlannedPool:
    """A validated KVCachePoolSpec -> the replay's PoolModel (pure)."""
    notes: list[str] = []
    n = engines or spec.replicas
    if spec.autoscaling is not None and not engines:
        n = spec.autoscaling.max_replicas
        notes.append(f"autoscaling: planned at maxReplicas ({n}); --engines N for another count")
    if n < 1:
        raise PoolFileError("spec.replicas: 0 engines serve nothing; --engines N to plan")
    if routing is None:  # every router policy is one the replay models (sim.ROUTINGS)
        routing = spec.router.policy if spec.router is not None else "round_robin"
    t = spec.tiers
    tiers: list[TierModel] = []
    if t.cpu is not None:
        tiers.append(TierModel("cpu", parse_size(t.cpu.size), shared=False, eviction=t.cpu.eviction_policy))
    if t.disk is not None:
        shared_disk = t.disk.volume.persistent_volume_claim is not None
        tiers.append(TierModel("disk", parse_size(t.disk.size), shared=shared_disk))
        if shared_disk:
            notes.append("disk on a claim: one tier every engine shares, evicting at its size")
    for kind, backend, managed_size, share in (
            ("redis", t.redis, lambda m: int(parse_size(m.memory) * REDIS_MAXMEMORY), "maxmemory"),
            ("s3", t.s3, lambda m: int(parse_size(m.storage) * MINIO_QUOTA), "bucket quota")):
        if backend is None:
            continue
        if backend.managed is not None:
            tiers.append(TierModel(kind, managed_size(backend.managed), shared=True))
        elif external_size:
            tiers.append(TierModel(kind, external_size, shared=True))
        else:
            raise PoolFileError(f"spec.tiers.{kind}.external: its capacity is not in the manifest; "
                                f"--shared SIZE gives it (its {share})")
    m = spec.model
    cpu_kv = m.cpu_kv_cache_gib * GI * m.tensor_parallel_size if m.gpus == 0 else 0
    return PlannedPool(PoolModel(engines=n, bytes_per_token=bytes_per_token, tiers=tuple(tiers),
                                 routing=routing, chunk_tokens=spec.chunk_tokens), notes, name,
                       gpus=m.gpus, cpu_kv_cache=cpu_kv)


def read_pool(path: str, **kw: Any) -> PlannedPool:
    """The first KVCachePool in a file, checked by the operator's own validator (imported on
    use, as `kvpool validate` does: an engine image lacks the operator's dependencies)."""
    from kvpool_cli.main import load
    from kvpool_connector.config import MalformedFile, load_documents

    try:
        docs = load_documents(path)
        pools = [d for d in docs if isinstance(d, dict) and d.get("kind") == "KVCachePool"]
        if not pools:
            raise PoolFileError(f"{path}: no KVCachePool document")
        try:
            pool_spec = load("kvpool_operator.cli:pool_spec")
        except ImportError as e:
            raise PoolFileError(f"-f needs the operator's validator (pip install "
                                f"'kvpool[operator]'): {e}") from None
        name, spec = pool_spec(pools[0])
    except (MalformedFile, ValueError) as e:  # UsageError, InvalidPool, SettingsError too
        raise PoolFileError(str(e)) from None
    return from_spec(spec, name, **kw)
