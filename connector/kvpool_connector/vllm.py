"""Entry point named in `--kv-transfer-config`:
`{"kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool_connector.vllm", ...}`.
"""

from .connector.connector import KVPoolConnector

__all__ = ["KVPoolConnector"]
