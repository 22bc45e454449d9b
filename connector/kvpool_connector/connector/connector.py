"""`KVPoolConnector`: vLLM V1 KV connector over the kvpool tiered store.

One instance per process: role SCHEDULER in the EngineCore (lookups, plans; see
scheduler.py for why it opens only the shared lower tiers) and role WORKER in each worker
(copies; see worker.py). This class only wires vLLM's interface to those two halves.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ..amx import ask_for_amx_tiles
from ..config import StoreConfig
from ..identity import model_config_hash, pipeline_partition
from ..store import open_store
from ..store.tiers import local_size, tier_class
from .audit import KVAudit
from .block_groups import window_blocks
from .config import (
    ConnectorConfig,
    ConnectorConfigError,
    check_block_size,
    check_hash_algo,
    load_connector_config,
)
from .events import kv_events_enabled
from .keys import KeySpace
from .layout import KVLayout, group_specs, spec_fingerprint
from .metadata import KVPoolMetadata, KVPoolWorkerMetadata
from .ranks import AllRanksLookup, RankedStore, reporting_workers
from .scheduler import SchedulerSide
from .stats import KVPoolConnectorStats, KVPoolPromMetrics
from .tails import is_tail_key
from .warm import manifest_key, prewarm_keys, prewarm_objects, read_manifest
from .worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvpool.connector")


def _worker_ranks(role: KVConnectorRole, parallel_config) -> tuple[int, int]:
    """(tensor-parallel rank, pipeline stage) of this process: (0, 0) in the scheduler,
    which plans with the logical keys every rank shares (keys.py)."""
    if role != KVConnectorRole.WORKER:
        return 0, 0
    tp = pp = 0
    if parallel_config.tensor_parallel_size > 1:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        tp = get_tensor_model_parallel_rank()
    if parallel_config.pipeline_parallel_size > 1:
        from vllm.distributed.parallel_state import get_pp_group
        pp = get_pp_group().rank_in_group
    return tp, pp


def first_worker(tp_rank: int, pp_rank: int) -> bool:
    """The one worker of an engine that counts tokens and reports the tiers' KV events: the
    others' would count each token again. Not "the worker without a rank tag": with MLA every
    tensor rank of stage 0 shares the logical keys (no tag), and each counted every token."""
    return tp_rank == 0 and pp_rank == 0


def check_parallel_layout(parallel_config) -> None:
    """Refuse what the key space does not describe: with context parallelism each rank holds
    a share of the tokens' KV, which the chunk keys (one per token prefix) cannot name."""
    for option, attr in (("--decode-context-parallel-size", "decode_context_parallel_size"),
                         ("--prefill-context-parallel-size", "prefill_context_parallel_size")):
        if getattr(parallel_config, attr, 1) > 1:
            raise ConnectorConfigError(
                f"KVPoolConnector does not support {option} > 1 (each rank would hold a "
                f"share of every token's KV); start vLLM with {option} 1")


# KV cache group specs a hybrid model's groups may have (vLLM's class names): a chunk holds
# each group's blocks of its positions, and a sliding-window group's blocks out of the window
# are null (block_groups.py). Others (Mamba state, cross attention, middle-gap windows) hold
# something else than one block of KV per position, and are refused.
HYBRID_GROUP_SPECS = ("FullAttentionSpec", "MLAAttentionSpec", "SlidingWindowSpec")


def check_kv_cache_groups(kv_cache_config: KVCacheConfig, block_size: int) -> None:
    """Refuse what the chunk objects cannot describe: with several KV cache groups (vLLM's
    hybrid KV cache manager), a group of another kind than full or sliding-window attention,
    or of another block size."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) <= 1:
        return
    for i, g in enumerate(groups):
        for s in group_specs(g.kv_cache_spec):
            kind = type(s).__name__
            if kind not in HYBRID_GROUP_SPECS:
                raise ConnectorConfigError(
                    f"KVPoolConnector does not support KV cache group {i} of kind {kind} "
                    f"(supported with several groups: {', '.join(HYBRID_GROUP_SPECS)})")
            if getattr(s, "block_size", block_size) != block_size:
                raise ConnectorConfigError(
                    f"KVPoolConnector needs one block size in every KV cache group; group "
                    f"{i} has {s.block_size}, the engine {block_size}")


def group_keeps(kv_cache_config: KVCacheConfig, block_size: int) -> list[int | None]:
    """Per KV cache group, the last positions of an object it stores: a sliding-window
    group's window in blocks (block_groups.window_blocks), None (all) for the others and for
    every single-group engine (vLLM with HMA off gives a sliding-window model full-attention
    specs; one group keeps its objects as they were)."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) <= 1:
        return [None] * len(groups)
    out: list[int | None] = []
    for g in groups:
        spec = group_specs(g.kv_cache_spec)[0]
        window = getattr(spec, "sliding_window", None) if type(spec).__name__ == \
            "SlidingWindowSpec" else None
        out.append(window_blocks(int(window), block_size) if window else None)
    return out


def tp_replicas(kv_cache_config: KVCacheConfig) -> int:
    """vLLM's `kv_cache_config.kv_tp_replicas`: how many consecutive tensor ranks hold
    identical KV for every layer, which vLLM derives from each layer's spec (MLA's one latent
    vector per token on every rank; a cache with fewer shards than ranks; 1 under decode
    context parallelism, which splits the tokens). One copy per replica group is stored."""
    return int(getattr(kv_cache_config, "kv_tp_replicas", 1) or 1)


def _unexported(cfg: StoreConfig | None) -> StoreConfig | None:
    """The store config without the store's own Prometheus series in this process: the
    connector's stores run in vLLM's engine-core process, which serves no /metrics, and
    `metrics: true` sends their series through vLLM's stats instead (stats.py), to the API
    server; registering them here as well would collide with those where vLLM runs
    everything in one process."""
    return cfg.model_copy(update={"metrics": False}) if cfg is not None else None


def _chunk_slots(cfg: StoreConfig | None, chunk_bytes: int) -> StoreConfig | None:
    """The cpu tier's slots sized for one chunk (unless the config sets them): a chunk is
    then one contiguous slot, which a load scatters from in place (worker.py), and a tail
    object fits one slot too. Left to the tier, the first object stored decided, and when
    that was a tail (a short first prompt) every chunk spanned two slots, wasting up to
    half the arena and every in-place read."""
    if cfg is None:
        return None
    tiers = [t.model_copy(update={"slot_size": -(-chunk_bytes // 4096) * 4096})
             if getattr(t, "slot_size", 0) is None else t for t in cfg.tiers]
    return cfg.model_copy(update={"tiers": tiers})


def _manifest_store_config(cfg) -> StoreConfig | None:
    """The tiers that hold the warm start manifest (warm.py): the remote ones (Redis, S3)
    where there are any, else the shared disk. A disk in front of Redis or S3 is a pod's or a
    node's: reading the manifest there would find a stale copy, and writing through it would
    push that copy over the other engines' counts."""
    shared = [t.type for t in cfg.tiers if tier_class(t.type).shared]
    keep = [t for t in shared if tier_class(t).remote] or shared
    return _unexported(cfg.as_store_config(drop_types=tuple(
        t.type for t in cfg.tiers if t.type not in keep)))


def _backend_name(vllm_config: VllmConfig, layer_name: str) -> str:
    try:
        layer = vllm_config.compilation_config.static_forward_context[layer_name]
        return layer.attn_backend.get_name()
    except Exception:  # not an attention layer we can inspect: shapes still fingerprint
        return "unknown"


class KVPoolConnector(KVConnectorBase_V1, SupportsHMA):
    """Tiered (cpu / disk / Redis / S3) prefix cache for vLLM, on CPU and CUDA; hybrid
    models (full and sliding-window attention groups) with vLLM's hybrid KV cache manager."""

    _cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, role, kv_cache_config)
        transfer_config = self._kv_transfer_config
        self.cfg: ConnectorConfig = load_connector_config(transfer_config.kv_connector_extra_config)
        groups = kv_cache_config.kv_cache_groups
        self.block_size = vllm_config.cache_config.block_size
        self.blocks_per_chunk = check_block_size(self.cfg, self.block_size)
        check_kv_cache_groups(kv_cache_config, self.block_size)
        self.keep = group_keeps(kv_cache_config, self.block_size)
        if len(groups) > 1 and self.cfg.layerwise:
            raise ConnectorConfigError(
                "KVPoolConnector: layerwise loads need one KV cache group; set layerwise: "
                "false or start vLLM with --disable-hybrid-kv-cache-manager")
        if getattr(transfer_config, "kv_load_failure_policy", "fail") != "recompute":
            log.warning("KVPoolConnector: kv_load_failure_policy is %r; set it to 'recompute' "
                        "so a chunk that cannot be loaded is recomputed instead of failing "
                        "the request", getattr(transfer_config, "kv_load_failure_policy", None))
        model_config = vllm_config.model_config
        hash_algo = str(vllm_config.cache_config.prefix_caching_hash_algo)
        check_hash_algo(hash_algo, [t.type for t in self.cfg.tiers if tier_class(t.type).shared])
        self.spec_fingerprint = spec_fingerprint(kv_cache_config, str(model_config.model))
        parallel = vllm_config.parallel_config
        check_parallel_layout(parallel)
        self.tp_rank, self.pp_rank = _worker_ranks(role, parallel)
        self.keyspace = KeySpace(
            namespace=self.cfg.namespace, model=str(model_config.model),
            model_hash=model_config_hash(model_config),
            vllm_version=vllm.__version__,
            dtype=f"{model_config.dtype}/{vllm_config.cache_config.cache_dtype}",
            layout=self.spec_fingerprint, tp_size=parallel.tensor_parallel_size,
            hash_algo=hash_algo, chunk_tokens=self.cfg.chunk_tokens,
            pp_size=parallel.pipeline_parallel_size, pp_layers=pipeline_partition(vllm_config),
            tp_replicas=tp_replicas(kv_cache_config))
        self.prefix = self.keyspace.prefix()  # of the logical keys (keys.py "Ranks")
        self.rank_tag = self.keyspace.rank_tag(self.tp_rank, self.pp_rank)
        self.sched: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        self.manifest_store = None  # the warm start manifest's tiers (scheduler side)
        if role == KVConnectorRole.SCHEDULER:
            chunk_bytes = sum(
                g.kv_cache_spec.page_size_bytes * len(g.layer_names)
                * min(self.blocks_per_chunk, k or self.blocks_per_chunk)
                for g, k in zip(groups, self.keep, strict=True))
            # the tiers of the workers' own memory are out of this process's reach
            unshared = tuple(t.type for t in self.cfg.tiers if not tier_class(t.type).shared)
            lower_cfg = _unexported(self.cfg.as_store_config(drop_types=unshared))
            lower: Any = (open_store(lower_cfg, layout=self.spec_fingerprint)
                          if lower_cfg is not None else None)
            unranked = lower  # the manifest: one object of no rank (warm.py)
            tags = self.keyspace.rank_tags()
            if lower is not None and len(tags) > 1:
                lower = AllRanksLookup(lower, tags)  # a hit is every rank's part, or a miss
            manifest_cfg = _manifest_store_config(self.cfg) if self.cfg.warm_start.enabled else None
            self.manifest_store = (open_store(manifest_cfg, layout=self.spec_fingerprint)
                                   if manifest_cfg is not None else None)
            self.sched = SchedulerSide(self.cfg, self.prefix, self.block_size,
                                       self.blocks_per_chunk,
                                       chunk_bytes, reporting_workers(parallel), lower,
                                       self._request_block_ids,
                                       is_async=not self.cfg.layerwise,
                                       keep=self.keep,
                                       load=transfer_config.is_kv_consumer,
                                       save=transfer_config.is_kv_producer,
                                       manifest_store=(self.manifest_store if self.manifest_store
                                                       is not None else unranked))
            if kv_events_enabled(vllm_config):
                self.sched.enable_events(chunk_bytes)
        else:
            self.worker = None  # created in register_kv_caches, once the layout is known

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return bool((extra_config or {}).get("layerwise", False))

    # ==== worker side ==================================================================
    def register_kv_caches(self, kv_caches: dict[str, Any]):
        kv_cache_config = self._kv_cache_config
        groups = [list(g.layer_names) for g in kv_cache_config.kv_cache_groups]
        names = [n for g in groups for n in g]
        backend = _backend_name(self._vllm_config, names[0]) if names else "unknown"
        layout = KVLayout(kv_caches, groups if len(groups) > 1 else names,
                          kv_cache_config.num_blocks, backend, keep=self.keep)
        ask_for_amx_tiles(layout.device.type)  # before a first step that is a full hit (amx.py)
        full_fingerprint = f"{self.spec_fingerprint}|{layout.fingerprint()}"
        store: Any = open_store(_chunk_slots(_unexported(self.cfg.as_store_config()),
                                             layout.chunk_nbytes(self.blocks_per_chunk)),
                                layout=full_fingerprint,
                                shared_writes=self.keyspace.stores_shared(self.tp_rank))
        # tail objects go first when the cpu or disk tier needs room (tails.py)
        store.set_evict_first(functools.partial(is_tail_key, prefix_len=len(self.prefix)))
        if self.rank_tag:  # this rank's part of every chunk under its own keys (ranks.py)
            store = RankedStore(store, self.rank_tag)
        first = first_worker(self.tp_rank, self.pp_rank)
        self.worker = WorkerSide(store, self.blocks_per_chunk, self.cfg.layerwise,
                                 audit=KVAudit.from_env(rank=self.rank_tag.decode()),
                                 staging_bytes=self.cfg.staging_bytes,
                                 events=first and kv_events_enabled(self._vllm_config),
                                 store_metrics=self.cfg.metrics, block_size=self.block_size,
                                 count_tokens=first)
        self.worker.register(layout)
        log.info("KVPoolConnector: %d layers, %d bytes per chunk of %d tokens, tiers %s",
                 len(layout.layers), layout.chunk_nbytes(self.blocks_per_chunk),
                 self.cfg.chunk_tokens,
                 [t.type for t in self.cfg.tiers])
        if self.cfg.warm_start.enabled:
            self._prewarm(store, layout.chunk_nbytes(self.blocks_per_chunk))

    def _prewarm(self, store, chunk_bytes: int) -> None:
        """Warm start (warm.py): the top of the pool's hot set into the cpu tier, before
        vLLM's engine is up for at most warm_start.max_seconds, the rest in the background."""
        assert self.worker is not None
        ws = self.cfg.warm_start
        cpu_bytes = local_size(self.cfg.tiers[0])  # the engine's own memory: validated
        manifest_cfg = _manifest_store_config(self.cfg)
        if manifest_cfg is None:
            return
        manifests = open_store(manifest_cfg, layout=self.spec_fingerprint)
        try:
            manifest = read_manifest(manifests, manifest_key(self.prefix))
        finally:
            manifests.close()
        keys = prewarm_keys(manifest, self.prefix, prewarm_objects(ws.max_bytes, cpu_bytes,
                                                                   chunk_bytes))
        self.worker.prewarm(keys, min(ws.max_bytes, cpu_bytes // 2), ws.max_seconds)

    def _meta(self) -> KVPoolMetadata | None:
        m = self._connector_metadata
        return m if isinstance(m, KVPoolMetadata) else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._meta()
        if self.worker is not None and meta is not None and meta.loads:
            self.worker.submit_loads(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.worker is not None:
            self.worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # chunks are saved whole (all layers in one object) in wait_for_save

    def wait_for_save(self):
        meta = self._meta()
        if self.worker is None or meta is None:
            return
        self.worker.finish_sync_loads()
        if meta.saves:
            self.worker.submit_saves(meta)

    def handle_preemptions(self, kv_connector_metadata):
        if self.worker is not None and isinstance(kv_connector_metadata, KVPoolMetadata):
            self.worker.preempted(kv_connector_metadata.preempted)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.worker is None:
            return None, None
        sending, recving = self.worker.get_finished(self._meta())
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """get_finished's sets, and the loads that failed by request (several KV cache
        groups: vLLM recomputes those requests; loads.py fail_by_request)."""
        results = super().get_transfer_results(finished_req_ids)
        if self.worker is not None:
            results.failed_recving = self.worker.loads.take_failed_requests()
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors() if self.worker is not None else set()

    def build_connector_worker_meta(self) -> KVPoolWorkerMetadata | None:
        return self.worker.worker_meta() if self.worker is not None else None

    def get_kv_connector_stats(self) -> KVPoolConnectorStats | None:
        if self.worker is not None:
            return self.worker.take_stats()
        if self.sched is not None:
            return self.sched.take_stats()
        return None

    def shutdown(self):
        if self.worker is not None:
            self.worker.shutdown()
            self.worker.store.close()
        if self.sched is not None:
            self.sched.close()
            if self.sched.lower is not None:
                self.sched.lower.close()
            if self.manifest_store is not None:
                self.manifest_store.close()

    # ==== scheduler side ===============================================================
    def _request_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        assert self._kv_cache_manager is not None
        return self._kv_cache_manager.get_block_ids(req_id)

    def on_new_request(self, request: Request) -> None:
        if self.sched is not None:
            self.sched.request_record(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        assert self.sched is not None
        try:
            return self.sched.num_matched(request, num_computed_tokens)
        except Exception:  # a lookup problem is a miss, never a failed request
            log.exception("kvpool: lookup failed for %s", request.request_id)
            return 0, False

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int):
        assert self.sched is not None
        self.sched.after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int
                                       ) -> dict[CacheHitSource, int]:
        """Split a hit between the local first tier (index) and the lower tiers."""
        if num_external_tokens <= 0 or self.sched is None:
            return {}
        local, lower_chunks = self.sched.hit_sources(request)
        tiers = [tier_class(t.type) for t in self.cfg.tiers]
        first = CacheHitSource(tiers[0].hit_source)
        # the tiers the scheduler's lookups reach: one source when they all name the same
        lower_sources = {CacheHitSource(t.hit_source) for t in tiers if t.shared}
        lower = (lower_sources.pop() if len(lower_sources) == 1
                 else CacheHitSource.EXTERNAL_UNSPECIFIED)
        n_first = min(num_external_tokens, local * self.cfg.chunk_tokens)
        if not lower_chunks and self.sched.tail_hit_local(request):
            n_first = num_external_tokens  # every chunk, tail and partial block: first tier
        out: dict[CacheHitSource, int] = {}
        if n_first:
            out[first] = n_first
        if num_external_tokens - n_first:
            out[lower] = out.get(lower, 0) + num_external_tokens - n_first
        return out

    def build_connector_meta(self, scheduler_output) -> KVPoolMetadata:
        assert self.sched is not None
        return self.sched.build_meta(scheduler_output)

    def update_connector_output(self, connector_output):
        if self.sched is not None:
            worker_meta = connector_output.kv_connector_worker_meta
            self.sched.on_worker_meta(
                worker_meta if isinstance(worker_meta, KVPoolWorkerMetadata) else None)

    def take_events(self):
        """BlockStored/BlockRemoved of the cpu and disk tiers (vLLM publishes them with its own)."""
        events = self.sched.events if self.sched is not None else None
        return events.take() if events is not None else ()

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        assert self.sched is not None
        return self.sched.finish(request, [block_ids])

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's SupportsHMA: every group's blocks (a sliding window's out of it: null)."""
        assert self.sched is not None
        return self.sched.finish(request, block_ids)

    # ==== stats ========================================================================
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVPoolConnectorStats | None:
        return KVPoolConnectorStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KVPoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
