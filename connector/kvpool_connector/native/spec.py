"""`KVPoolOffloadingSpec`: vLLM's `TieringOffloadingSpec` whose worker also runs on the CPU
platform.

Everything on the scheduler side is vLLM's: the primary host tier (`cpu_bytes_to_use`,
`eviction_policy` lru/arc), the `TieringOffloadingManager`, the secondary tiers
(`secondary_tiers`: vLLM's `fs`, kvpool's `kvpool` tier for disk/Redis/S3, ...), metrics and
events. Two things differ. `get_manager` wraps vLLM's tiering manager in kinds.py's
`KindCountingManager` (saves and hits by kind and tier, exported with vLLM's offloading
metrics: `build_metric_definitions`). And `get_worker`: vLLM's `CPUOffloadingSpec.get_worker` raises "CPU
Offloading is currently only supported on CUDA-alike and XPU GPUs" on the CPU platform, so
there this spec maps the same shared host region vLLM's worker would and moves blocks with
`HostCopyWorker` (torch copies). On CUDA and XPU it returns vLLM's own worker. Before either
side creates its region, host regions a killed engine left in /dev/shm are removed (regions.py).

`kv_connector_extra_config` key of this spec (all others are vLLM's):
  offload_worker: "auto" (default; kvpool's on the CPU platform, vLLM's on CUDA/XPU),
                  "kvpool" (CPU platform only), "vllm" (vLLM's, whatever the platform).
"""

from __future__ import annotations

import logging
from typing import Any

from .contract import (
    SPEC_ATTRIBUTES,
    CanonicalKVCaches,
    OffloadingWorker,
    SharedOffloadRegion,
    TieringOffloadingSpec,
    platform_kind,
    require_contract,
)
from .host_copy import HostCopyWorker
from .kinds import KindCountingManager, metric_definitions
from .regions import remove_stale_regions

logger = logging.getLogger(__name__)

WORKER_KEY = "offload_worker"
WORKER_CHOICES = ("auto", "kvpool", "vllm")


def choose_worker(setting: Any, platform: str) -> str:
    """'kvpool' or 'vllm': whose OffloadingWorker moves the blocks (pure)."""
    if setting not in WORKER_CHOICES:
        raise ValueError(f"kv_connector_extra_config.{WORKER_KEY}: {setting!r} is not one of "
                         f"{', '.join(WORKER_CHOICES)}")
    if setting == "vllm":
        return "vllm"
    if platform == "cpu":
        return "kvpool"
    if setting == "kvpool":
        raise ValueError(f"kv_connector_extra_config.{WORKER_KEY}: 'kvpool' copies host memory "
                         f"and runs on vLLM's CPU platform only (this is {platform}); use "
                         "'auto' or 'vllm'")
    return "vllm"  # CUDA/XPU: vLLM's stream-based worker; elsewhere vLLM reports the platform


class KVPoolOffloadingSpec(TieringOffloadingSpec):
    """Load with `"spec_name": "KVPoolOffloadingSpec", "spec_module_path":
    "kvpool_connector.native"` (see the module docstring)."""

    def __init__(self, config) -> None:
        require_contract()
        # before this engine's region is created (get_manager, get_worker): a region left in
        # /dev/shm by a killed engine would take the space vLLM checks for (regions.py)
        remove_stale_regions()
        super().__init__(config)
        missing = [a for a in SPEC_ATTRIBUTES if not hasattr(self, a)]
        if missing:
            raise RuntimeError(f"vLLM's TieringOffloadingSpec no longer sets {missing}")
        self.worker_kind = choose_worker(self.extra_config.get(WORKER_KEY, "auto"),
                                         platform_kind())
        if self.worker_kind == "kvpool" and config.canonical_layout:
            raise ValueError("kv_connector_extra_config.canonical_layout is not supported by "
                             f"kvpool's host-copy worker ({WORKER_KEY}: kvpool)")
        self._host_worker: HostCopyWorker | None = None

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        """vLLM's tiering metrics plus the objects by kind and tier (kinds.py)."""
        return {**super().build_metric_definitions(extra_config), **metric_definitions()}

    def get_manager(self):
        """vLLM's tiering manager (built once), counted by kind and tier."""
        manager = super().get_manager()
        if not isinstance(manager, KindCountingManager):
            tokens = self.tokens_per_block[0] * self.blocks_per_chunk
            manager = self._manager = KindCountingManager(manager, tokens)
        return manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self.worker_kind == "vllm":
            return super().get_worker(kv_caches)
        if self._host_worker is None:
            self._host_worker = self._create_host_copy_worker(kv_caches)
        return self._host_worker

    def _create_host_copy_worker(self, kv_caches: CanonicalKVCaches) -> HostCopyWorker:
        """The region and views `TieringOffloadingSpec.create_worker` gives vLLM's worker:
        this rank's slot of every primary-tier row, one view per KV tensor, so the scheduler's
        tiers (and their secondary tiers) see exactly the bytes vLLM's worker would write."""
        rank = 0 if self.replicated_layout else self.config.parallel.rank
        region = SharedOffloadRegion(
            engine_id=self.config.engine_id, num_chunks=self.num_chunks, rank=rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker)
        try:
            views = [region.create_next_worker_view(t.page_size_bytes * self.blocks_per_chunk)
                     for t in kv_caches.tensors]
            worker = HostCopyWorker(kv_caches, views, self.blocks_per_chunk,
                                    on_shutdown=region.cleanup)
        except Exception:
            region.cleanup()
            raise
        logger.info("kvpool host-copy offloading worker: %d KV tensors, %d host chunks of %d "
                    "blocks, rank %d", len(kv_caches.tensors), self.num_chunks,
                    self.blocks_per_chunk, rank)
        return worker
