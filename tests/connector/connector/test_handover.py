"""Prefill/decode through the pool (connector/handover.py): the handover parser on
untrusted input, and the scheduler half driven the way vLLM drives it, on real vLLM
requests and a real disk tier: the prefill's durable saves and its handover (shortened when
the workers report a write that did not go through), the decode request's wait for the
objects, its hit, its timeout and a handover that is not its own."""

from __future__ import annotations

import pytest
from vllm.v1.request import RequestStatus

from kvpool_connector.connector.handover import (
    Handover,
    HandoverError,
    build_handover,
    parse_handover,
    wants_handover,
)
from kvpool_connector.connector.keys import chunk_keys
from kvpool_connector.connector.metadata import KVPoolWorkerMetadata
from kvpool_connector.connector.tails import tail_key
from tests.connector.connector.conftest import wait_inline
from tests.connector.connector.helpers import (
    BPC,
    BS,
    PREFIX,
    allocate,
    answered,
    make_request,
    part_of,
    scheduler_output,
)

TAILS = {"tail_objects": True}
PREFILL = {**TAILS, "handover_requests": True}  # a prefill engine: it honours handover requests
NAME = "ab" * 32
FIELD = "kv_transfer_params.kvpool.handover"


def _hv(**inner):
    return {"kvpool": {"handover": {"v": 1, "tokens": 256, "name": NAME, **inner}}}


def test_parse_accepts_a_handover_and_ignores_requests_without_one():
    assert parse_handover(_hv()) == Handover(256, bytes.fromhex(NAME))
    assert parse_handover(build_handover(384, b"\x01" * 32)) == Handover(384, b"\x01" * 32)
    for params in (None, {}, {"do_remote_decode": True}, {"kvpool": {"handover": True}},
                   {"kvpool": {"tails": False}}, "junk", {"kvpool": "x"}):
        assert parse_handover(params) is None


@pytest.mark.parametrize(("params", "field"), [
    ({"kvpool": {"handover": [1]}}, FIELD),
    ({"kvpool": {"handover": False}}, FIELD),
    (_hv(v=2), f"{FIELD}.v"),
    (_hv(v=True), f"{FIELD}.v"),
    (_hv(tokens="256"), f"{FIELD}.tokens"),
    (_hv(tokens=0), f"{FIELD}.tokens"),
    (_hv(tokens=-128), f"{FIELD}.tokens"),
    (_hv(tokens=1 << 40), f"{FIELD}.tokens"),
    (_hv(tokens=True), f"{FIELD}.tokens"),
    (_hv(name="AB" * 32), f"{FIELD}.name"),
    (_hv(name="ab" * 31), f"{FIELD}.name"),
    (_hv(name="x" * 100000), f"{FIELD}.name"),
    (_hv(name=None), f"{FIELD}.name"),
    (_hv(extra="\n" * 5), FIELD),
])
def test_malformed_handovers_are_one_line_errors_naming_the_field(params, field):
    with pytest.raises(HandoverError) as exc:
        parse_handover(params)
    msg = str(exc.value)
    assert msg.startswith(field + ":") and "\n" not in msg and len(msg) < 200


def test_routers_prefill_flags_ask_for_a_handover():
    # vllm-router's P/D mode and llm-d's nixlv2 sidecar send this with max_tokens=1
    assert wants_handover({"do_remote_decode": True, "do_remote_prefill": False,
                           "remote_engine_id": None, "remote_block_ids": None})
    assert wants_handover({"kvpool": {"handover": True}})
    for params in (None, {}, {"do_remote_decode": "yes"}, _hv(), {"kvpool": {"handover": 1}}):
        assert not wants_handover(params)


def _prefill(side, n: int, cached_chunks: int = 0, seed: int = 0):
    """A prefill request asked for a handover, run to its end (max_tokens=1); returns
    (request, the step's save jobs, the handover returned by finish)."""
    req = make_request("p", n, seed=seed, kv_transfer_params={"do_remote_decode": True})
    assert side.num_matched(req, 0)[0] == max(0, min(cached_chunks * 256, n - 1))
    allocate(side, req, 0)
    meta = side.build_meta(scheduler_output({"p": n}))
    req.num_computed_tokens = n
    req.append_output_token_ids(7)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = side.finish(req, [side.test_blocks["p"]])
    assert delay is True  # the copies are not confirmed yet
    return req, meta.saves, params


def _report(side, saves, failed=()):
    side.on_worker_meta(KVPoolWorkerMetadata(
        stored_keys=[k for s in saves for k in s.keys if k not in failed],
        copied_saves={s.req_id: 1 for s in saves},
        durable_done={s.req_id: sum(1 for x in saves if x.req_id == s.req_id) for s in saves},
        durable_failed={"p": list(failed)} if failed else {}))


@pytest.mark.parametrize("side", [PREFILL], indirect=True)
def test_prefill_writes_through_all_but_the_last_prompt_token_and_hands_it_over(side):
    req = make_request("p", 1000)  # 7 blocks (3 chunks + a 1-block tail), 104 tokens more
    keys = chunk_keys(PREFIX, req.block_hashes, BPC)
    # the chunks are already in the workers' memory: a handover writes them through anyway
    side.on_worker_meta(KVPoolWorkerMetadata(stored_keys=keys))
    req, saves, params = _prefill(side, 1000, cached_chunks=3)
    assert all(s.durable for s in saves)
    tail = tail_key(PREFIX, req.block_hashes, 6, 1)
    part = part_of(req, 999)  # block 7's first 103 tokens: all but the last prompt token
    assert [k for s in saves for k in s.keys] == keys + [tail, part]
    assert saves[-1].block_ids == [[side.test_blocks["p"][7]]]
    assert parse_handover(params) == Handover(999, side.lower.object_names([part])[0])
    _report(side, saves)
    assert parse_handover(params) == Handover(999, side.lower.object_names([part])[0])
    assert side.stats.data["kvpool_handovers"] == {"": 1}


@pytest.mark.parametrize("side", [PREFILL], indirect=True)
def test_a_prompt_ending_on_a_block_boundary_hands_over_its_last_block_but_one_token(side):
    """1024 tokens, 4 whole chunks: the handover is 3 chunks, a 1-block tail and the last
    block's first 127 tokens, all saved at prefill end (the 4th chunk too, for others)."""
    req, saves, params = _prefill(side, 1024)
    keys = chunk_keys(PREFIX, req.block_hashes, BPC)
    tail = tail_key(PREFIX, req.block_hashes, 6, 1)
    part = part_of(req, 1023)
    assert [k for s in saves for k in s.keys] == keys + [tail, part]
    _report(side, saves)
    assert parse_handover(params) == Handover(1023, side.lower.object_names([part])[0])


@pytest.mark.parametrize("side", [PREFILL], indirect=True)
def test_a_write_that_did_not_go_through_shortens_the_handover_returned(side):
    req, saves, params = _prefill(side, 1000)
    keys = chunk_keys(PREFIX, req.block_hashes, BPC)
    tail = tail_key(PREFIX, req.block_hashes, 6, 1)
    _report(side, saves, failed=[tail])  # reported in the same update_from_output
    assert parse_handover(params) == Handover(3 * 256, side.lower.object_names([keys[2]])[0])
    req, saves, params = _prefill(side, 1000, seed=2)
    tail = tail_key(PREFIX, req.block_hashes, 6, 1)
    _report(side, saves, failed=[part_of(req, 999)])  # the partial block alone
    assert parse_handover(params) == Handover(7 * BS, side.lower.object_names([tail])[0])
    req, saves, params = _prefill(side, 1000, seed=1)
    _report(side, saves, failed=[chunk_keys(PREFIX, req.block_hashes, BPC)[0]])
    assert params == {}  # nothing to hand over: the decode engine computes the prompt


def test_requests_not_asked_for_a_handover_return_none(side):
    req = make_request("q", 1000)
    side.num_matched(req, 0)
    allocate(side, req, 0)
    meta = side.build_meta(scheduler_output({"q": 1000}))
    assert not any(s.durable for s in meta.saves)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert side.finish(req, [side.test_blocks["q"]])[1] is None


@pytest.mark.parametrize("side", [TAILS], indirect=True)
def test_an_engine_that_is_no_prefill_engine_refuses_handover_requests(side):
    """A client asking any engine for a handover (do_remote_decode) forced a write-through of
    every chunk, cached ones too, inside the step: only engines with handover_requests (the
    prefill role) honour it; elsewhere it is an ordinary request, its saves deduplicated."""
    first = make_request("a", 1000)
    side.num_matched(first, 0)
    allocate(side, first, 0)
    assert side.build_meta(scheduler_output({"a": 1000})).saves  # the chunks are saved once
    for params in ({"do_remote_decode": True}, {"kvpool": {"handover": True}}):
        req = make_request("p", 1000, kv_transfer_params=params)
        side.num_matched(req, 0)
        allocate(side, req, 0)
        meta = side.build_meta(scheduler_output({"p": 1000}))
        assert not any(s.durable for s in meta.saves)
        assert not any(s.req_id == "p" for s in meta.saves)  # held already: not written again
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        assert side.finish(req, [side.test_blocks["p"]])[1] is None  # no handover returned
        side.reqs.pop("p", None)
    assert side.stats.data["kvpool_handover_refused"] == {"": 2}
    assert "kvpool_handovers" not in side.stats.data


def _decode_request(params, n=1000, rid="d"):
    return make_request(rid, n, kv_transfer_params=params)


@pytest.mark.parametrize("side", [TAILS], indirect=True)
def test_decode_waits_for_every_object_then_loads_them_as_a_hit(side):
    req = make_request("x", 1000)
    keys = chunk_keys(PREFIX, req.block_hashes, BPC)
    tail = tail_key(PREFIX, req.block_hashes, 6, 1)
    part = part_of(req, 999)
    params = build_handover(999, side.lower.object_names([part])[0])
    dec = _decode_request(params)
    assert side.num_matched(dec, 0) == (None, False)  # nothing visible yet
    side.lower.put_many(keys + [tail], [b"c" * 64] * 4)
    side.reqs["d"].handover_checked_at = 0.0  # (the next check is due)
    # the chunks and the tail are a visible prefix, but the handover promised the part too
    assert side.num_matched(dec, 0) == (None, False)
    side.lower.put_many([part], [b"t" * 64])
    side.reqs["d"].handover_checked_at = 0.0
    assert side.num_matched(dec, 0) == (999, True)  # all but the token vLLM computes
    ids = allocate(side, dec, 999)
    (load,) = side.build_meta(scheduler_output({})).loads
    assert [c.key for c in load.chunks] == keys + [tail, part]
    assert load.chunks[-2].block_ids == [ids[6]] and load.chunks[-2].n_blocks == 1
    # the partial block: copied whole into block 7, of which 103 tokens are the hit
    last = load.chunks[-1]
    assert (last.rows, last.block_ids, last.n_blocks, last.tokens) == ([0], [ids[7]], 1, 103)
    assert side.stats.data["kvpool_handover_hits"] == {"": 1}


@pytest.mark.parametrize("side", [TAILS], indirect=True)
def test_a_whole_block_handover_of_an_earlier_prefill_engine_still_loads(side):
    req = make_request("x", 1000)
    keys = chunk_keys(PREFIX, req.block_hashes, BPC)
    tail = tail_key(PREFIX, req.block_hashes, 6, 1)
    side.lower.put_many(keys + [tail], [b"c" * 64] * 4)
    dec = _decode_request(build_handover(7 * BS, side.lower.object_names([tail])[0]))
    assert side.num_matched(dec, 0) == (7 * BS, True)
    # a prompt ending on a block boundary: such an engine handed all of its blocks over,
    # of which the decode engine claims all but the last
    req = make_request("y", 1024, seed=5)
    keys = chunk_keys(PREFIX, req.block_hashes, BPC)
    side.lower.put_many(keys, [b"c" * 64] * 4)
    dec = make_request("d1024", 1024, seed=5, kv_transfer_params=build_handover(
        1024, side.lower.object_names([keys[3]])[0]))
    assert side.num_matched(dec, 0) == (7 * BS, True)


def test_a_handover_past_the_last_prompt_token_or_a_partial_block_of_an_image_is_refused(side):
    """A decode engine computes at least the last token, and a request with multimodal
    inputs has no partial-block key (its token ids do not name its KV)."""
    req = make_request("x", 1000)
    whole = build_handover(1000, side.lower.object_names([part_of(req, 1000)])[0])
    assert side.num_matched(_decode_request(whole), 0) == (0, False)
    img = _decode_request(build_handover(999, side.lower.object_names([part_of(req, 999)])[0]),
                          rid="i")
    img.mm_features = ["an image"]
    assert side.num_matched(img, 0) == (0, False)
    assert side.stats.data["kvpool_handover_rejected"] == {"": 2}


@pytest.mark.parametrize("side", [{**TAILS, "handover_wait_seconds": 0}], indirect=True)
def test_decode_past_the_bound_falls_back_to_an_ordinary_lookup(side):
    req = make_request("x", 1000)
    keys = chunk_keys(PREFIX, req.block_hashes, BPC)
    tail = tail_key(PREFIX, req.block_hashes, 6, 1)
    side.lower.put_many(keys[:2], [b"c" * 64] * 2)  # a partial prefix is visible
    dec = _decode_request(build_handover(7 * BS, side.lower.object_names([tail])[0]))
    # timed out: the visible, authenticated-on-load prefix is an ordinary hit
    assert side.num_matched(dec, 0) == (512, True)
    assert side.stats.data["kvpool_handover_timeouts"] == {"": 1}


@pytest.mark.parametrize("side", [TAILS], indirect=True)
def test_a_handover_naming_other_objects_is_ignored(side):
    other = make_request("x", 1000, seed=1)
    tail = tail_key(PREFIX, other.block_hashes, 6, 1)
    dec = _decode_request(build_handover(7 * BS, side.lower.object_names([tail])[0]))
    assert side.num_matched(dec, 0) == (0, False)  # an ordinary lookup: nothing stored
    too_long = _decode_request(build_handover(64 * BS, b"\x00" * 32), rid="d2")
    assert side.num_matched(too_long, 0) == (0, False)
    bad = _decode_request({"kvpool": {"handover": {"v": 1, "tokens": "all"}}}, rid="d3")
    assert side.num_matched(bad, 0) == (0, False)
    assert side.stats.data["kvpool_handover_rejected"] == {"": 3}


@pytest.mark.parametrize("side", [{**TAILS, "handover_always": True}], indirect=True)
def test_handover_always_makes_every_request_a_handover_prefill(side):
    # llm-d's shared-storage protocol sends the prefill request with no kv_transfer_params
    req = make_request("s", 1000)
    side.num_matched(req, 0)
    allocate(side, req, 0)
    meta = side.build_meta(scheduler_output({"s": 1000}))
    assert meta.saves and all(s.durable for s in meta.saves)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = side.finish(req, [side.test_blocks["s"]])
    assert parse_handover(params).tokens == 999


@pytest.mark.parametrize("side", [PREFILL], indirect=True)
def test_a_prefill_over_several_steps_settles_with_the_last_steps_report(side):
    req = make_request("p", 1000, kv_transfer_params={"kvpool": {"handover": True}})
    side.num_matched(req, 0)
    allocate(side, req, 0)
    first = side.build_meta(scheduler_output({"p": 600})).saves  # chunked prefill: 2 chunks
    assert [len(s.keys) for s in first] == [2] and first[0].durable
    _report(side, first)  # confirmed in the step after
    req.num_computed_tokens = 600
    last = side.build_meta(scheduler_output({"p": 400})).saves  # chunk 3, tail and part
    req.num_computed_tokens = 1000
    req.append_output_token_ids(7)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = side.finish(req, [side.test_blocks["p"]])
    part = part_of(req, 999)
    assert parse_handover(params) == Handover(999, side.lower.object_names([part])[0])
    _report(side, last, failed=[last[0].keys[0]])  # chunk 3 did not go through
    keys = chunk_keys(PREFIX, req.block_hashes, BPC)
    assert parse_handover(params) == Handover(2 * 256, side.lower.object_names([keys[1]])[0])
    assert side.handovers_out == {}


def test_vllm_hands_the_workers_report_over_after_request_finished_in_the_same_call():
    """The prefill's handover is shortened after `request_finished` returned it, by the
    workers' report of the same step: that needs vLLM's `update_from_output` to call the
    connector's `request_finished` (via `_free_request`) before `update_connector_output`
    (via `_update_from_kv_xfer_finished`), and `EngineCore.step` to send the outputs only
    after it returned. Pinned here for vLLM upgrades."""
    import inspect

    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    src = inspect.getsource(Scheduler.update_from_output)
    finished = src.index("self._free_request(request)")
    report = src.index("self._update_from_kv_xfer_finished(kv_connector_output)")
    assert finished < report
    step = inspect.getsource(EngineCore.step)
    assert "update_from_output" in step and "output_queue" not in step


def test_an_ordinary_lookup_finds_the_tail_in_redis(remote_side):
    # llm-d's shared-storage decode: no handover, the prompt written through by the prefill
    req = make_request("s", 1000, seed=3)
    keys = chunk_keys(PREFIX, req.block_hashes, BPC)
    remote_side.lower.put_many(keys, [b"c" * 64] * 3)
    assert answered(remote_side, req) == (3 * 256, True)  # no tail stored: the chunks
    remote_side.lower.put_many([tail_key(PREFIX, req.block_hashes, 6, 1)], [b"t" * 64])
    again = make_request("s2", 1000, seed=3)
    assert answered(remote_side, again) == (7 * BS, True)  # chunks and tail, up to the last block


def test_a_handover_already_visible_in_redis_loads_without_a_step_of_waiting(remote_side,
                                                                             monkeypatch):
    """The visibility check runs on the lookup threads; when it answers within the
    scheduler's inline bound (raised here, so that a busy machine cannot miss it), the
    first ask is the hit: the decode engine loads in the step it admits the request."""
    wait_inline(remote_side, 30.0, 30.0)
    remote_side.build_meta(scheduler_output({}))
    req = make_request("x", 1000, seed=5)
    keys = chunk_keys(PREFIX, req.block_hashes, BPC)
    tail = tail_key(PREFIX, req.block_hashes, 6, 1)
    part = part_of(req, 999)
    remote_side.lower.put_many(keys + [tail, part], [b"c" * 64] * 5)
    remote_side.lower.flush()
    params = build_handover(999, remote_side.lower.object_names([part])[0])
    dec = make_request("d", 1000, seed=5, kv_transfer_params=params)
    assert remote_side.num_matched(dec, 0) == (999, True)
    assert remote_side.stats.data["kvpool_handover_hits"] == {"": 1}


@pytest.mark.parametrize("side", [{**PREFILL, "require_cache_salt": True}], indirect=True)
def test_a_pool_saving_no_partial_block_hands_over_whole_blocks(side):
    """require_cache_salt with unencrypted shared tiers: no partial block is saved
    (test_tails.py), so the handover promises only the whole blocks it wrote."""
    req = make_request("p", 1000, cache_salt="tenant-a",
                       kv_transfer_params={"do_remote_decode": True})
    side.num_matched(req, 0)
    allocate(side, req, 0)
    saves = side.build_meta(scheduler_output({"p": 1000})).saves
    tail = tail_key(PREFIX, req.block_hashes, 6, 1)
    assert [k for s in saves for k in s.keys][-1] == tail
    req.num_computed_tokens = 1000
    req.append_output_token_ids(7)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = side.finish(req, [side.test_blocks["p"]])
    assert parse_handover(params) == Handover(7 * BS, side.lower.object_names([tail])[0])


@pytest.mark.parametrize("side", [{**PREFILL, "handover_max_bytes": "2Mi"}], indirect=True)
def test_a_handover_past_its_byte_cap_writes_through_up_to_it_and_hands_over_that(side):
    """1 MiB chunks, a 2 MiB cap: of a 1000-token prompt's 3 chunks, 2 are written through in
    the step and the third behind the first tier (an ordinary save); the handover ends after
    chunk 2 (the decode engine computes the rest). Before, a handover wrote whatever it was
    asked inside the step."""
    req, saves, params = _prefill(side, 1000)
    keys = chunk_keys(PREFIX, req.block_hashes, BPC)
    durable = [k for s in saves if s.durable for k in s.keys]
    behind = [k for s in saves if not s.durable for k in s.keys]
    assert durable == keys[:2] and keys[2] in behind
    _report(side, saves)
    assert parse_handover(params) == Handover(2 * 256, side.lower.object_names([keys[1]])[0])
    assert side.stats.data["kvpool_handover_capped"] == {"": 1}


@pytest.mark.parametrize("side", [{**PREFILL, "handover_step_bytes": "1Mi"}], indirect=True)
def test_a_step_writes_through_at_most_its_byte_budget(side):
    """Two prefills in one step under a 1 MiB step budget: the first writes one chunk through,
    everything else of the step goes behind; the second request's handover is empty."""
    a = make_request("a", 600, kv_transfer_params={"do_remote_decode": True})
    b = make_request("b", 600, seed=1, kv_transfer_params={"do_remote_decode": True})
    for r in (a, b):
        side.num_matched(r, 0)
        allocate(side, r, 0)
    meta = side.build_meta(scheduler_output({"a": 600, "b": 600}))
    durable = [(s.req_id, len(s.keys)) for s in meta.saves if s.durable]
    assert durable == [("a", 1)], durable
    assert sum(len(s.keys) for s in meta.saves if not s.durable and s.req_id in "ab") >= 2
    assert side.stats.data["kvpool_handover_capped"] == {"": 2}
