"""kvpool connector: a vLLM V1 KV connector and the tiered KV store under it."""

__version__ = "0.1.0"
