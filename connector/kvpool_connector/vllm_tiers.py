"""The module path vLLM configs name for kvpool's secondary tier of native offloading.

    "secondary_tiers": [{"type": "kvpool", "module_path": "kvpool_connector.vllm_tiers", ...}]

vLLM imports the tier as `getattr(import_module(module_path), type)`, so this path is part of
every native-mode config: the operator renders it, the README and docs show it, and pods of
running pools hold it in their `--kv-transfer-config`. The tier itself lives with the rest
of native mode in `kvpool_connector/native/tier.py`; this module only keeps the configured
path (and both type names, `kvpool` and `KVPoolTier`) working. Import the implementation
from `kvpool_connector.native.tier`.
"""

from .native.tier import KVPoolTier, kvpool

__all__ = ["KVPoolTier", "kvpool"]
