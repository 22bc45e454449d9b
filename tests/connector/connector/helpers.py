"""Helpers of the scheduler-half tests: real vLLM requests (sha256 block hashes) and the
scheduler outputs and allocations vLLM would hand the connector."""

from __future__ import annotations

import random

from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
from vllm.v1.request import Request

from kvpool_connector.connector.keys import KeySpace

BS, BPC = 128, 2  # vLLM block size on CPU, blocks per 256-token chunk
PREFIX = KeySpace("t", "m", "h", "v", "bf16", "fp", 0, 1, "sha256", 256).prefix()


def make_request(rid: str, n: int, seed: int = 0, cache_salt: str | None = None,
                 kv_transfer_params: dict | None = None) -> Request:
    init_none_hash(sha256)
    rng = random.Random(seed)
    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    return Request(rid, [rng.randrange(3, 2000) for _ in range(n)],
                   SamplingParams(max_tokens=4, extra_args=extra), None, cache_salt=cache_salt,
                   block_hasher=get_request_block_hasher(BS, sha256))


def scheduler_output(sched: dict[str, int], preempted=()) -> SchedulerOutput:
    return SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(),
                           num_scheduled_tokens=sched, total_num_scheduled_tokens=sum(sched.values()),
                           scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
                           finished_req_ids=set(), free_encoder_mm_hashes=[],
                           preempted_req_ids=set(preempted))


def allocate(side, req, n_external):
    ids = list(range(100, 100 + len(req.block_hashes) + 1))
    side.test_blocks[req.request_id] = ids
    side.after_alloc(req, KVCacheBlocks((tuple(KVCacheBlock(i) for i in ids),)), n_external)
    return ids
