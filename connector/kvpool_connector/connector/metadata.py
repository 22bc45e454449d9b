"""Messages between the scheduler-side and worker-side halves of the connector.

Scheduler -> workers (`KVPoolMetadata`, once per step) says which chunks to load into which
blocks and which freshly computed chunks to save. Workers -> scheduler
(`KVPoolWorkerMetadata`) says which chunks reached the store (so the scheduler process,
which has no access to the worker's cpu tier, can count them as hits), which save copies
are done (so blocks of finished requests are freed only after their copy) and, with vLLM's
KV events on, what the local tiers stored and evicted (events.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class ChunkLoad:
    key: bytes
    rows: list[int]       # block positions within the stored chunk to copy
    block_ids: list[int]  # destination blocks, same length as rows
    n_blocks: int = 0     # blocks the stored object holds; 0: a full chunk (a tail: fewer)
    kind: str = ""        # prompt, decode, prompt_tail or decode_tail (stats: hits by kind)
    tokens: int = 0       # a partial-block object: the tokens it matches (0: whole blocks)


@dataclass
class LoadJob:
    req_id: str
    chunks: list[ChunkLoad]
    is_async: bool  # True: between steps (request waits); False: inside this forward


@dataclass
class SaveJob:
    req_id: str
    keys: list[bytes]
    block_ids: list[list[int]]  # per chunk, all of its blocks in order (a tail: fewer)
    # per key: prompt, decode, prompt_tail or decode_tail (stats)
    kinds: list[str] = field(default_factory=list)
    # a prefill's handover (handover.py): written through to the shared tiers in the step
    durable: bool = False


@dataclass
class KVPoolMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    # finished requests whose blocks stay allocated until their save copies are done
    await_saves: set[str] = field(default_factory=set)
    # preempted requests: their blocks are reused next, finish their copies first
    preempted: set[str] = field(default_factory=set)
    # the step computes nothing (every request waits, for KV or a save): the workers may
    # spend it waiting for their loads instead of returning to vLLM's loop at once
    idle: bool = False
    # requests wait for a handover's objects (handover.py): an idle step may pause briefly
    # instead of spinning the engine loop until they are visible
    handover_waiting: bool = False


@dataclass
class KVPoolWorkerMetadata(KVConnectorWorkerMetadata):
    stored_keys: list[bytes] = field(default_factory=list)  # once per worker that stored
    dropped_keys: list[bytes] = field(default_factory=list)  # saves that never got stored
    copied_saves: dict[str, int] = field(default_factory=dict)  # req_id -> save jobs copied
    failed_loads: dict[str, list[bytes]] = field(default_factory=dict)  # req_id -> chunk keys
    # with vLLM KV events on: (tier type, stored or removed, chunk key) of the local tiers
    tier_events: list[tuple[str, bool, bytes]] = field(default_factory=list)
    # durable save jobs (handovers) done: req_id -> jobs, and the keys not written through
    durable_done: dict[str, int] = field(default_factory=dict)
    durable_failed: dict[str, list[bytes]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVPoolWorkerMetadata)
        copied = dict(self.copied_saves)
        for r, n in other.copied_saves.items():
            copied[r] = copied.get(r, 0) + n
        # one entry per worker: a chunk is stored when every worker stored its part of it
        # (tensor ranks' heads, pipeline stages' layers; ranks.py PartReports)
        keys = self.stored_keys + other.stored_keys
        dropped = list(dict.fromkeys(self.dropped_keys + other.dropped_keys))
        failed = {r: list(k) for r, k in self.failed_loads.items()}
        for r, k in other.failed_loads.items():
            failed[r] = list(dict.fromkeys(failed.get(r, []) + k))
        done = dict(self.durable_done)
        for r, n in other.durable_done.items():
            done[r] = done.get(r, 0) + n
        dfailed = {r: list(k) for r, k in self.durable_failed.items()}
        for r, k in other.durable_failed.items():
            dfailed[r] = list(dict.fromkeys(dfailed.get(r, []) + k))
        return KVPoolWorkerMetadata(stored_keys=keys, dropped_keys=dropped, copied_saves=copied,
                                    failed_loads=failed,
                                    tier_events=self.tier_events + other.tier_events,
                                    durable_done=done, durable_failed=dfailed)
