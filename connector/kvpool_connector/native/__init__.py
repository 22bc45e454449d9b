"""Native mode on every platform: vLLM's OffloadingConnector with `KVPoolOffloadingSpec`.

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {
        "spec_name": "KVPoolOffloadingSpec", "spec_module_path": "kvpool_connector.native",
        "cpu_bytes_to_use": 8589934592,
        "secondary_tiers": [{"type": "kvpool", "module_path": "kvpool_connector.vllm_tiers",
                             "config_file": "/etc/kvpool/connector.yaml"}]}}'

See spec.py (what differs from vLLM's TieringOffloadingSpec), host_copy.py (the CPU
platform's worker) and contract.py (the vLLM internals used, pinned to one release).
"""

from .spec import KVPoolOffloadingSpec

__all__ = ["KVPoolOffloadingSpec"]
