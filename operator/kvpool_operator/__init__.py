"""kvpool operator: reconciles KVCachePool resources into vLLM fleets with KV offloading."""

__version__ = "0.1.0"
