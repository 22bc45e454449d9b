"""Native mode's objects by kind and tier (native/kinds.py) on vLLM's real tiering manager,
driven as vLLM's OffloadingConnector drives it; the engine end of it (the counters on
vLLM's metrics, hits from every secondary tier) is in tests/e2e/test_native.py."""

from __future__ import annotations

import uuid

from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext

from kvpool_connector.native import KVPoolOffloadingSpec
from kvpool_connector.native.kinds import KindCountingManager

from .harness import BLOCK_BYTES, BLOCKS_PER_CHUNK, NATIVE, chunk_keys, offloading_config

CHUNK_TOKENS = 16 * BLOCKS_PER_CHUNK  # offloading_config: 16 tokens per block


def _spec() -> KVPoolOffloadingSpec:
    return KVPoolOffloadingSpec(offloading_config(
        {**NATIVE, "cpu_bytes_to_use": 16 * BLOCK_BYTES * BLOCKS_PER_CHUNK}))


def _stats(manager) -> dict[tuple[str, str, str], float]:
    stats = manager.get_stats()
    values = stats.data["data"] if stats is not None else {}
    return {(metric, *labels): v for metric in ("kvpool_saved_objects", "kvpool_hit_objects",
                                                "kvpool_hit_tokens")
            for labels, v in values.get(metric, {}).items()}


def test_saves_and_hits_are_counted_by_kind_and_tier():
    spec = _spec()
    manager = spec.get_manager()
    assert isinstance(manager, KindCountingManager) and spec.get_manager() is manager
    try:
        prompt_key, decode_key = chunk_keys("conversation", 2)
        # turn 1: scheduled first with one full prompt chunk; its answer completes a second
        turn1 = ReqContext(req_id=uuid.uuid4().hex)
        manager.on_new_request(turn1)
        turn1.set_offload_key_position(prompt_key, CHUNK_TOKENS)
        manager.on_schedule_end(ScheduleEndContext(new_req_ids=[turn1.req_id],
                                                   preempted_req_ids=()))
        turn1.set_offload_key_position(decode_key, 2 * CHUNK_TOKENS)
        for key in (prompt_key, decode_key):  # stored as they complete
            out = manager.prepare_store([key], turn1)
            assert out is not None and out.keys_to_store == [key]
            manager.complete_store(out.keys_to_store, turn1)
        manager.on_request_finished(turn1)
        assert _stats(manager) == {("kvpool_saved_objects", "prompt", "host"): 1,
                                   ("kvpool_saved_objects", "decode", "host"): 1}
        # turn 2: both chunks are its prompt now; the second is still a decode chunk's hit
        turn2 = ReqContext(req_id=uuid.uuid4().hex)
        manager.on_new_request(turn2)
        keys = [prompt_key, decode_key]
        assert [manager.lookup(k, turn2) for k in keys] == [LookupResult.HIT] * 2
        manager.prepare_load(keys, turn2)
        manager.complete_load(keys, turn2)
        manager.on_request_finished(turn2)
        assert _stats(manager) == {
            ("kvpool_hit_objects", "prompt", "host"): 1,
            ("kvpool_hit_objects", "decode", "host"): 1,
            ("kvpool_hit_tokens", "prompt", "host"): CHUNK_TOKENS,
            ("kvpool_hit_tokens", "decode", "host"): CHUNK_TOKENS}
        assert _stats(manager) == {}  # increases: reported once
    finally:
        manager.shutdown()


def test_the_counters_are_declared_with_vllms_offloading_metrics():
    defs = KVPoolOffloadingSpec.build_metric_definitions(
        {**NATIVE, "cpu_bytes_to_use": 1 << 20})
    for name in ("kvpool_saved_objects", "kvpool_hit_objects", "kvpool_hit_tokens"):
        assert defs[name].labelnames == ("kind", "tier")
    assert "vllm:kv_offload_tiering_chunk_hits" in defs  # vLLM's own are still there
