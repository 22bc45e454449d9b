"""kvpool's native-mode tier against vLLM 0.32's secondary-tier contract, method by method
(`vllm.v1.kv_offload.tiering.base.SecondaryTierManager` and its docstrings), the way vLLM's
own tier tests drive its `fs` tier: the tier alone over a primary view of host rows, with
real backends (Redis, moto's S3, files) and failing ones (Redis stopped, a full or
read-only filesystem), bad chunk ids and a backend that stalls.

- lookup: HIT when present, MISS when absent, RETRY while the answer is pending; a failing
  backend is a MISS, never an exception.
- submit_store / submit_load: return at once (the transfer runs on the tier's threads);
  out-of-range chunk ids fail the job before any byte moves, as vLLM's tiers do.
- get_finished_jobs: every job exactly once; success only when every chunk was stored or
  loaded; a partial load names its `successful_keys` and marks the rest missing for the
  request (vLLM's livelock guard).
- take_events: BlockStored exactly for the chunks a store job put into the store.
- drain_jobs: every submitted job's result is ready afterwards.
- on_new_request / on_request_finished / on_schedule_end: per-request lookup state.
- shutdown: the tier's threads end.
"""

from __future__ import annotations

import os
import subprocess
import time

import numpy as np
import pytest
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvpool_connector.native.tier import KVPoolTier
from tests.conftest import SECURITY
from tests.connector.loopback import StallingProxy
from tests.connector.native.harness import (
    BLOCK_BYTES,
    BLOCKS_PER_CHUNK,
    chunk_keys,
    offloading_config,
    poll,
)

ROW = BLOCK_BYTES * BLOCKS_PER_CHUNK  # one chunk: 32 KiB
ROWS = 16
MARK = 0xAA  # what a primary row holds before a load


@pytest.fixture
def backends(redis_tier, s3_tier, tmp_path) -> dict:
    return {"redis": redis_tier, "s3": s3_tier,
            "disk": {"type": "disk", "path": str(tmp_path / "disk"), "size": "64Mi",
                     "rescan_seconds": 0}}


class Tier:
    """A KVPoolTier over ROWS primary rows (a numpy array standing for vLLM's host region)."""

    def __init__(self, store_tier: dict, namespace: str, events: bool = False,
                 timeout: float = 5.0) -> None:
        self.rows = np.full((ROWS, ROW), MARK, dtype=np.uint8)
        spec = TieringOffloadingSpec(offloading_config({"cpu_bytes_to_use": ROWS * ROW},
                                                       kv_events=events))
        self.tier = KVPoolTier(spec, memoryview(self.rows), "kvpool", n_read_threads=2,
                               n_write_threads=2, enable_kv_events=events, locality="LOCAL",
                               namespace=namespace, security=SECURITY,
                               timeout_seconds=timeout, tiers=[store_tier])
        self.jobs = 0

    def job(self, keys, chunk_ids, load: bool, req: str = "req") -> TransferJob:
        self.jobs += 1
        return TransferJob(job_id=self.jobs, keys=list(keys),
                           chunk_ids=np.array(chunk_ids, dtype=np.int64),
                           is_promotion=load, req_context=ReqContext(req_id=req))

    def store(self, keys, chunk_ids):
        self.tier.submit_store(self.job(keys, chunk_ids, False))
        return self.finished()

    def load(self, keys, chunk_ids, req: str = "req"):
        self.tier.submit_load(self.job(keys, chunk_ids, True, req))
        return self.finished()

    def finished(self) -> list:
        self.tier.drain_jobs()
        return list(self.tier.get_finished_jobs())

    def lookup(self, keys, req: str = "req", timeout: float = 20.0) -> list[LookupResult]:
        """Lookups as vLLM's tiering manager makes them: RETRY means ask again next step."""
        ctx = ReqContext(req_id=req)

        def attempt() -> list[LookupResult] | None:
            got = [self.tier.lookup(k, ctx) for k in keys]
            return None if LookupResult.RETRY in got else got

        return poll(attempt, lambda: self.tier.on_schedule_end(
            ScheduleEndContext(new_req_ids=(), preempted_req_ids=())), "the lookups", timeout)

    def fill(self, chunk_ids) -> list[bytes]:
        data = [os.urandom(ROW) for _ in chunk_ids]
        for c, d in zip(chunk_ids, data, strict=True):
            self.rows[c] = np.frombuffer(d, dtype=np.uint8)
        return data

    def close(self) -> None:
        self.tier.shutdown()

    def __enter__(self) -> Tier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def fresh_lookup(store_tier: dict, namespace: str, keys) -> list[LookupResult]:
    """What another engine of the pool finds."""
    with Tier(store_tier, namespace) as other:
        return other.lookup(keys, req="fresh")


@pytest.mark.parametrize("backend", ["disk", "redis", "s3"])
def test_store_then_load_round_trip(backend, backends, namespace):
    keys = chunk_keys(f"round-{backend}", 4)
    with Tier(backends[backend], namespace, events=True) as t:
        assert isinstance(t.tier.on_new_request(ReqContext(req_id="req")),
                          RequestOffloadingContext)
        assert t.lookup(keys) == [LookupResult.MISS] * 4
        t.tier.on_request_finished(ReqContext(req_id="req"))
        data = t.fill([0, 1, 2, 3])
        [res] = t.store(keys, [0, 1, 2, 3])
        assert (res.job_id, res.success) == (1, True)
        [event] = t.tier.take_events()
        assert (list(event.keys), event.medium, event.removed, event.locality) == (
            keys, Medium.STORAGE, False, Locality.LOCAL)
        assert t.lookup(keys, req="again") == [LookupResult.HIT] * 4
        [res] = t.load(keys, [8, 9, 10, 11])
        assert (res.job_id, res.success, res.successful_keys) == (2, True, None)
        assert [bytes(t.rows[c]) for c in (8, 9, 10, 11)] == data
        assert (t.rows[4:8] == MARK).all() and (t.rows[12:] == MARK).all()
        assert list(t.tier.get_finished_jobs()) == []  # reported once
    assert fresh_lookup(backends[backend], namespace, keys) == [LookupResult.HIT] * 4


@pytest.fixture
def failing(request, backends):
    """(store tier config, break it, mend it): Redis stopped, a full or a read-only disk."""
    kind = request.param
    if kind == "redis-stopped":
        redis_server = request.getfixturevalue("redis_server")
        yield backends["redis"], redis_server.stop, redis_server.start
        if redis_server.proc is None:  # the test failed before mending it
            redis_server.start()
        return
    if kind == "disk-full":
        small_fs = request.getfixturevalue("small_fs")
        tier = {"type": "disk", "path": str(small_fs), "size": "64Mi", "rescan_seconds": 0}

        def fill_up():  # what is left of the 4 MiB filesystem is less than one chunk
            subprocess.run(["dd", "if=/dev/zero", f"of={small_fs}/filler", "bs=64k"],
                           capture_output=True)
            os.truncate(f"{small_fs}/filler", os.path.getsize(f"{small_fs}/filler") - ROW // 2)

        yield tier, fill_up, lambda: os.unlink(f"{small_fs}/filler")
        return
    prepare, freeze = request.getfixturevalue("make_readonly")
    path = prepare()
    yield ({"type": "disk", "path": str(path), "size": "64Mi", "rescan_seconds": 0},
           lambda: freeze(path), None)


@pytest.mark.parametrize("failing", ["redis-stopped", "disk-full", "disk-readonly"],
                         indirect=True)
def test_a_store_that_did_not_land_fails_its_job_and_is_not_announced(failing, namespace):
    """vLLM's contract: success means every chunk was stored. A store whose backend fails
    is reported failed (vLLM counts it, its backpressure sees it) and no KV event announces
    a chunk that is not there; lookups of a failing backend are misses, not errors."""
    store_tier, break_it, mend_it = failing
    keys = chunk_keys(f"fail-{namespace}", 4)
    with Tier(store_tier, namespace, events=True, timeout=1.0) as t:
        t.fill([0, 1, 2, 3])
        break_it()
        [res] = t.store(keys, [0, 1, 2, 3])
        assert res.success is False
        announced = [k for e in t.tier.take_events() for k in e.keys]
        assert announced == []
        assert t.lookup(keys) == [LookupResult.MISS] * 4
        [res] = t.load(keys, [4, 5, 6, 7], req="load")
        assert res.success is False and res.successful_keys is None
        assert (t.rows[4:8] == MARK).all()
        if mend_it is None:
            return
        mend_it()
        t.tier.store.runners[0].write_health.ok()  # no waiting out the backoff
        [res] = t.store(keys, [0, 1, 2, 3])
        assert res.success is True
        assert [k for e in t.tier.take_events() for k in e.keys] == keys


@pytest.mark.parametrize("failing", ["disk-full"], indirect=True)
def test_one_failed_store_job_fails_alone(failing, namespace):
    """vLLM 0.32's `test_mixed_job_results_emit_event_only_for_successful_job`, with a real
    failure: a store job that hits ENOSPC fails, the next, independent job succeeds and is the
    only one announced. Before, the failure tripped the disk tier's write breaker, which
    dropped the next job too (reported failed, its chunks never stored)."""
    store_tier, break_it, mend_it = failing
    keys = chunk_keys(f"mixed-{namespace}", 2)
    with Tier(store_tier, namespace, events=True, timeout=1.0) as t:
        t.fill([0, 1])
        break_it()
        [first] = t.store(keys[:1], [0])
        mend_it()
        [second] = t.store(keys[1:], [1])  # at once: no backoff to wait out
        assert (first.success, second.success) == (False, True)
        [event] = t.tier.take_events()
        assert list(event.keys) == keys[1:]
        assert t.lookup(keys[1:]) == [LookupResult.HIT]
        assert t.lookup(keys[:1], req="other") == [LookupResult.MISS]


def test_out_of_range_chunk_ids_fail_the_job_and_store_nothing(backends, namespace):
    """Like vLLM's own tiers: a chunk id past the primary tier (or a key without an id) is
    refused before any byte moves; no empty object is stored under a real key."""
    keys = chunk_keys(f"range-{namespace}", 2)
    with Tier(backends["redis"], namespace, events=True) as t:
        for ids in ([ROWS, 0], [0, -1], [0]):
            [res] = t.store(keys, ids)
            assert res.success is False, ids
        assert list(t.tier.take_events()) == []
        assert t.lookup(keys) == [LookupResult.MISS] * 2
        data = t.fill([0, 1])
        assert t.store(keys, [0, 1])[0].success
        t.rows[2:] = MARK
        [res] = t.load(keys, [2, ROWS], req="load")
        assert res.success is False and res.successful_keys is None
        assert (t.rows[2:] == MARK).all()  # nothing moved
        assert t.lookup(keys, req="load") == [LookupResult.MISS] * 2  # marked for the request
        [res] = t.load(keys, [2, 3], req="other")
        assert res.success and [bytes(t.rows[c]) for c in (2, 3)] == data
    assert fresh_lookup(backends["redis"], namespace, keys) == [LookupResult.HIT] * 2


def test_a_partial_load_names_what_loaded_and_marks_the_rest_missing(backends, namespace,
                                                                     redis_server):
    import redis

    keys = chunk_keys(f"partial-{namespace}", 3)
    with Tier(backends["redis"], namespace) as t:
        data = t.fill([0, 1, 2])
        assert t.store(keys, [0, 1, 2])[0].success
        client = redis.Redis.from_url(redis_server.url, password=redis_server.password)
        victim = f"kvpool:{namespace}:{t.tier.store.object_names([t.tier.store_key(keys[1])])[0].hex()}"
        blob = bytearray(client.get(victim))
        blob[-100] ^= 1
        client.set(victim, bytes(blob))
        client.close()
        assert t.lookup(keys, req="load") == [LookupResult.HIT] * 3
        [res] = t.load(keys, [4, 5, 6], req="load")
        assert res.success is False and list(res.successful_keys) == [keys[0], keys[2]]
        assert bytes(t.rows[4]) == data[0] and bytes(t.rows[6]) == data[2]
        assert t.lookup(keys, req="load") == [LookupResult.HIT, LookupResult.MISS,
                                               LookupResult.HIT]


def test_submit_returns_at_once_and_drain_collects_every_job(backends, redis_server, namespace):
    """submit_* only queue (a backend stalling on its replies does not hold the scheduler);
    drain_jobs waits for them all; get_finished_jobs then reports each exactly once."""
    proxy = StallingProxy(redis_server.port)
    tier = {**backends["redis"], "url": f"redis://127.0.0.1:{proxy.port}/0"}
    keys = chunk_keys(f"drain-{namespace}", 6)
    try:
        with Tier(tier, namespace, timeout=1.0) as t:
            t.fill(range(6))
            assert t.store(keys[:2], [0, 1])[0].success  # connected before the stall
            proxy.budget = 0  # from now on the server's replies are held back
            t0 = time.monotonic()
            t.tier.submit_store(t.job(keys[2:4], [2, 3], False))
            t.tier.submit_load(t.job(keys[:2], [8, 9], True))
            t.tier.submit_store(t.job(keys[4:], [4, 5], False))
            assert time.monotonic() - t0 < 0.5
            assert list(t.tier.get_finished_jobs()) == []  # nothing back yet
            t.tier.drain_jobs()
            proxy.budget = None
            proxy.released.set()
            results = list(t.tier.get_finished_jobs())
            assert sorted(r.job_id for r in results) == [2, 3, 4]
            assert not any(r.success for r in results)  # the stall outlasted the deadline
            assert list(t.tier.get_finished_jobs()) == []
    finally:
        proxy.close()


def test_request_state_is_released_when_the_request_finishes(backends, namespace):
    keys = chunk_keys(f"state-{namespace}", 1)
    with Tier(backends["redis"], namespace) as t:
        assert t.lookup(keys, req="first") == [LookupResult.MISS]
        t.fill([0])
        assert t.store(keys, [0])[0].success
        assert t.lookup(keys, req="first") == [LookupResult.MISS]  # the request's verdict
        t.tier.on_request_finished(ReqContext(req_id="first"))
        assert t.lookup(keys, req="second") == [LookupResult.HIT]  # asked again


def test_shutdown_ends_the_tiers_threads(backends, namespace):
    t = Tier(backends["redis"], namespace)
    threads = list(t.tier._pool._threads)
    t.close()
    assert threads and not any(th.is_alive() for th in threads)


@pytest.mark.parametrize("backend", ["disk", "redis", "s3"])
def test_unverified_bytes_never_reach_vllms_shared_host_rows(backend, backends, namespace):
    """vLLM's host tier is a shared mapping other processes read: a load is received into
    the tier's own scratch and copied there only once its tag checked out, so a tampered
    object leaves the row as it was (not even zeroed: nothing was written)."""
    keys = chunk_keys(f"scratch-{backend}", 2)
    with Tier(backends[backend], namespace) as t:
        data = t.fill([0, 1])
        assert t.store(keys, [0, 1])[0].success
        store = t.tier.store
        name = store.object_names([t.tier.store_key(keys[1])])[0]
        tier = store.runners[0].tier
        blob = bytearray(tier.get_many([name], store.layout, store.keyring.current)[0]
                         .freeze().blob)
        blob[-100] ^= 1  # late in the payload: the pieces before it would have landed
        plant_blob(backend, tier, name, bytes(blob))
        [res] = t.load(keys, [4, 5])
        assert res.success is False and list(res.successful_keys) == [keys[0]]
        assert bytes(t.rows[4]) == data[0]
        assert (t.rows[5] == MARK).all()


def plant_blob(backend: str, tier, name: bytes, blob: bytes) -> None:
    """Replace an object's bytes in its backend (what someone with write access can do)."""
    if backend == "disk":
        with open(tier.path(name), "wb") as f:
            f.write(blob)
    elif backend == "redis":
        import redis

        client = redis.Redis(connection_pool=tier.pool)
        client.set(tier.object_key(name), blob)
    else:
        tier.client.put_object(Bucket=tier.bucket, Key=tier.object_key(name), Body=blob)
