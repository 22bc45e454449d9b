"""The four base classes of vLLM that the worker half imports, for a GPU machine without
vLLM: vLLM's CUDA build cannot be installed where tests/gpu runs (that machine reaches no
package index, and vLLM's wheel is larger than what travels to it). These are copies of
vLLM 0.32's definitions (vllm/distributed/kv_transfer/kv_connector/v1/base.py, metrics.py):
kvpool only subclasses them; nothing of vLLM's behaviour is stood in for. Installed only
where `import vllm` fails."""

from __future__ import annotations

import sys
import types
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


class KVConnectorMetadata(ABC):  # noqa: B024 -- as vLLM's
    pass


class KVConnectorWorkerMetadata(ABC):
    @abstractmethod
    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata: ...


@dataclass
class KVConnectorStats:
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return self.data


class KVConnectorPromMetrics:
    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: Any,
                 per_engine_labelvalues: Any) -> None:
        self._kv_transfer_config = getattr(vllm_config, "kv_transfer_config", None)
        self._gauge_cls, self._counter_cls, self._histogram_cls = (
            metric_types.get(k) for k in ("gauge", "counter", "histogram"))
        self._labelnames, self._per_engine_labelvalues = labelnames, per_engine_labelvalues


def install() -> bool:
    """Register the shim under vLLM's module names when vLLM itself does not import; True
    if it did so."""
    try:
        import vllm  # noqa: F401
        return False
    except ImportError:
        pass
    names = ["vllm", "vllm.distributed", "vllm.distributed.kv_transfer",
             "vllm.distributed.kv_transfer.kv_connector",
             "vllm.distributed.kv_transfer.kv_connector.v1"]
    for name in names:
        sys.modules.setdefault(name, types.ModuleType(name))
    base = types.ModuleType(names[-1] + ".base")
    base.KVConnectorMetadata = KVConnectorMetadata  # type: ignore[attr-defined]
    base.KVConnectorWorkerMetadata = KVConnectorWorkerMetadata  # type: ignore[attr-defined]
    metrics = types.ModuleType(names[-1] + ".metrics")
    metrics.KVConnectorStats = KVConnectorStats  # type: ignore[attr-defined]
    metrics.KVConnectorPromMetrics = KVConnectorPromMetrics  # type: ignore[attr-defined]
    sys.modules[base.__name__], sys.modules[metrics.__name__] = base, metrics
    return True
