"""Helpers of the scheduler-half tests: real vLLM requests (sha256 block hashes) and the
scheduler outputs and allocations vLLM would hand the connector."""

from __future__ import annotations

import random
import threading
import time

from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
from vllm.v1.request import Request, RequestStatus

from kvpool_connector.connector.keys import KeySpace
from kvpool_connector.connector.metadata import KVPoolWorkerMetadata
from kvpool_connector.connector.tails import part_key

BS, BPC = 128, 2  # vLLM block size on CPU, blocks per 256-token chunk
PREFIX = KeySpace("t", "m", "h", "v", "bf16", "fp", 1, "sha256", 256).prefix()


def make_request(rid: str, n: int, seed: int = 0, cache_salt: str | None = None,
                 kv_transfer_params: dict | None = None) -> Request:
    init_none_hash(sha256)
    rng = random.Random(seed)
    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    return Request(rid, [rng.randrange(3, 2000) for _ in range(n)],
                   SamplingParams(max_tokens=4, extra_args=extra), None, cache_salt=cache_salt,
                   block_hasher=get_request_block_hasher(BS, sha256))


def part_of(req, n: int) -> bytes:
    """Key of the partial-block object of the request's first `n` tokens (n % BS != 0)."""
    b = n // BS
    return part_key(PREFIX, req.block_hashes[b - 1], list(req.all_token_ids)[b * BS:n])


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


def held_then_answered(side, req, monkeypatch, store, method: str):
    """Hold the real `store.method` call until released (a wrapper around the real
    call, standing in for a slow network: loopback Redis cannot be slowed down otherwise);
    check that the lookup answers None ("ask again next step") meanwhile, then release it
    and return the answer once the job is done."""
    gate = threading.Event()
    real = getattr(store, method)
    monkeypatch.setattr(store, method, lambda ks: (gate.wait(10), real(ks))[1])
    assert side.num_matched(req, 0) == (None, False)  # in flight: the scheduler moves on
    assert side.num_matched(req, 0) == (None, False)
    gate.set()
    for _ in range(500):
        answer = side.num_matched(req, 0)
        if answer[0] is not None:
            return answer
        threading.Event().wait(0.01)
    return answer


def report_stored(side, meta) -> None:
    """The workers copied every planned save into the cpu tier."""
    side.on_worker_meta(KVPoolWorkerMetadata(
        stored_keys=[k for s in meta.saves for k in s.keys],
        copied_saves={s.req_id: 1 for s in meta.saves}))


def run_turn(side, req, answer: list[int], computed: int = 0):
    """Prefill (after `computed` loaded tokens) then decode `answer` one token per step,
    then finish; returns every save job planned, the finish step's included."""
    jobs = []
    meta = side.build_meta(scheduler_output({req.request_id: req.num_tokens - computed}))
    jobs += meta.saves
    report_stored(side, meta)
    req.num_computed_tokens = req.num_tokens
    req.append_output_token_ids(answer[0])
    for tok in answer[1:]:
        meta = side.build_meta(scheduler_output({req.request_id: 1}))
        jobs += meta.saves
        report_stored(side, meta)
        req.num_computed_tokens += 1
        req.append_output_token_ids(tok)
    # the blocks vLLM allocated as the answer grew
    side.test_blocks[req.request_id] = list(range(100, 100 + len(req.block_hashes) + 1))
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    side.finished(req, [side.test_blocks[req.request_id]])
    meta = side.build_meta(scheduler_output({}))
    jobs += meta.saves
    report_stored(side, meta)
    return jobs


def with_prompt(rid: str, ids: list[int]):
    """A request of exactly these prompt ids (token-exact history)."""
    proto = make_request(rid, 1)
    return type(proto)(rid, ids, proto.sampling_params, None, block_hasher=proto._block_hasher)


def answered(side, req):
    """num_matched until the lookup threads answered (bounded)."""
    for _ in range(500):
        got = side.num_matched(req, 0)
        if got[0] is not None:
            return got
        time.sleep(0.01)
    raise AssertionError("the lookup never answered")
