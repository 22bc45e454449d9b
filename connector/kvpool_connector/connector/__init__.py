"""The vLLM V1 connector of kvpool, one concern per module.

config     connector keys on top of the store config (file + inline, validated)
keys       chunk keys from vLLM's block hashes (never Python hash())
layout     block dimension and chunk gather/scatter for any attention backend
metadata   scheduler <-> worker messages
scheduler  lookups and load/save plans (EngineCore process)
worker     copies between paged KV and the store (worker processes)
stats      counters for vLLM's stats path and Prometheus
connector  the `KVConnectorBase_V1` class wiring it together
"""
