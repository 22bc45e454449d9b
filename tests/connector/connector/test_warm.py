"""Warm start (connector/warm.py) on a real Redis: the scheduler half counts reused chunks
into the pool's hot set manifest; a starting worker loads the top of it into its cpu tier
(each object verified, a bad one a miss); a starting scheduler half finds those chunks in
its KeyIndex, so the first requests load them within the step from the workers' memory. A
forged or corrupted manifest is a miss like any object."""

from __future__ import annotations

import os

import pytest
import redis
import torch

from kvpool_connector.connector.config import ConnectorConfigError, load_connector_config
from kvpool_connector.connector.keys import PREFIX_LEN, chunk_keys
from kvpool_connector.connector.layout import KVLayout
from kvpool_connector.connector.metadata import ChunkLoad, KVPoolMetadata, LoadJob
from kvpool_connector.connector.warm import (
    MANIFEST_LAYOUT,
    ManifestWriter,
    Prewarmer,
    manifest_key,
    prewarm_keys,
    read_manifest,
)
from kvpool_connector.connector.worker import WorkerSide
from kvpool_connector.store.hotset import HIT_UNITS, Manifest, decode, encode
from tests.connector.connector.conftest import scheduler_side
from tests.connector.connector.helpers import BPC, PREFIX, allocate, answered, make_request
from tests.connector.store.helpers import build_store

WARM = {"enabled": True, "refresh_seconds": 3600, "top_k": 16}


@pytest.fixture
def warm_side(redis_tier, namespace):
    sides = []

    def make(**warm):
        s = scheduler_side(namespace, redis_tier, tail_objects=False,
                           warm_start={**WARM, **warm})
        sides.append(s)
        return s

    yield make
    for s in sides:
        s.close()
        s.lower.close()


def admit(side, req, cached_tokens: int) -> None:
    """A request admitted with `cached_tokens` from vLLM's prefix cache (and whatever the
    pool's lookup, still in flight here, would add: nothing is loaded in these tests)."""
    side.num_matched(req, cached_tokens)
    allocate(side, req, 0)


def _raw_redis(redis_server) -> redis.Redis:
    return redis.Redis.from_url(redis_server.url, password=redis_server.password)


def test_reused_chunks_become_the_manifest_and_the_next_engines_local_hits(warm_side):
    a = warm_side()
    req = make_request("r1", 1000)  # 3 full chunks
    keys = chunk_keys(PREFIX, req.block_hashes, BPC)
    a.lower.put_many(keys[:2], [os.urandom(1000), os.urandom(1000)])  # what the pool holds
    assert a.lower.flush(5)
    # vLLM's prefix cache served 2 chunks of r1 and 3 of its twin: those are hits
    admit(a, req, 512)
    admit(a, make_request("r2", 1000), 768)
    admit(a, make_request("r3", 1000, seed=9), 0)  # computed: no hit, not in the hot set
    assert a.hotset is not None and a.hotset.refresh()
    m = read_manifest(a.lower, manifest_key(PREFIX))
    assert m is not None and m.pool == a.cfg.namespace
    assert m.entries == sorted([(keys[0][PREFIX_LEN:], 2 * HIT_UNITS), (keys[1][PREFIX_LEN:], 2 * HIT_UNITS)],
                               key=lambda e: e[0]) + [(keys[2][PREFIX_LEN:], HIT_UNITS)]

    # a starting engine: the hot set's chunks the shared tier holds are in its KeyIndex
    b = warm_side()
    assert keys[0] in b.index and keys[1] in b.index and keys[2] not in b.index
    fresh = make_request("r4", 1000)
    assert answered(b, fresh) == (512, False)  # loaded in the step from the workers' memory
    assert b.hit_sources(fresh) == (2, 0)


def test_manifest_writes_merge_and_the_last_hits_are_written_at_close(warm_side, namespace):
    a = warm_side()
    req = make_request("r1", 600)  # 2 full chunks
    keys = chunk_keys(PREFIX, req.block_hashes, BPC)
    admit(a, req, 512)
    assert a.hotset is not None and a.hotset.refresh()
    assert not a.hotset.refresh()  # nothing new: no write
    other = warm_side()  # another engine of the pool counts the same chunks
    admit(other, make_request("r2", 600), 512)
    other.close()  # its last hits are written at shutdown
    m = read_manifest(a.lower, manifest_key(PREFIX))
    assert m is not None
    # both engines' hits, the first's aged by the seconds between the two writes
    assert {k: round(c / HIT_UNITS) for k, c in m.entries} == {keys[0][PREFIX_LEN:]: 2, keys[1][PREFIX_LEN:]: 2}


def test_requests_the_pool_isolates_are_not_counted(warm_side):
    """require_cache_salt: an unsalted request neither reads nor writes the pool, nor does it
    count in the hot set; a salted one does (its keys hold the salt)."""
    a = warm_side(top_k=16)
    a.cfg = a.cfg.model_copy(update={"require_cache_salt": True})
    admit(a, make_request("r1", 600), 512)
    assert a.hotset is not None and len(a.hotset.hot) == 0
    admit(a, make_request("r2", 600, cache_salt="tenant"), 512)
    assert len(a.hotset.hot) == 2


def test_a_forged_or_foreign_manifest_is_a_miss(warm_side, redis_server, namespace):
    a = warm_side()
    key = manifest_key(PREFIX)
    name = a.lower.object_names([key])[0]
    r = _raw_redis(redis_server)
    try:
        # what someone without the pool key can write: an unsealed manifest
        r.set(f"kvpool:{namespace}:{name.hex()}", encode(Manifest(namespace, [(b"x" * 32, 9)])))
        assert read_manifest(a.lower, key) is None
        assert a.lower.stats()["tiers"]["redis"]["corrupt"] == 1
        # authentic bytes that are no manifest (another version): ignored
        a.lower.put(key, b"KVHS\x09junk", layout=MANIFEST_LAYOUT)
        assert read_manifest(a.lower, key) is None
        b = warm_side()  # starts anyway, with nothing pre-warmed
        assert len(b.index._d) == 0
    finally:
        r.close()


def test_prewarm_loads_verified_objects_into_the_cpu_tier(cpu_tier, redis_tier, namespace,
                                                          redis_server):
    shared = build_store(namespace, redis_tier)
    store = build_store(namespace, cpu_tier, redis_tier)
    try:
        keys = [PREFIX + os.urandom(32) for _ in range(12)]
        payloads = [os.urandom(4096) for _ in keys]
        assert all(shared.put_many(keys, payloads))
        writer = ManifestWriter(shared, manifest_key(PREFIX), namespace, top_k=16,
                                refresh_seconds=3600)
        writer.add([k[PREFIX_LEN:] for i, k in enumerate(keys) for _ in range(20 - i)])
        assert writer.refresh()
        writer.close()
        # one object of the hot set corrupted in place: a miss, never served
        name = shared.object_names([keys[1]])[0]
        r = _raw_redis(redis_server)
        rkey = f"kvpool:{namespace}:{name.hex()}"
        blob = bytearray(r.get(rkey))
        blob[-20] ^= 1
        r.set(rkey, bytes(blob))
        r.close()
        manifest = read_manifest(store, manifest_key(PREFIX))
        assert store.stats()["tiers"]["cpu"]["objects"] == 0  # the manifest was not promoted
        want = prewarm_keys(manifest, PREFIX, max_objects=10)
        assert want == keys[:10]  # most hit first, within the budget
        result = Prewarmer(store, want, max_bytes=1 << 20).run(max_seconds=30)
        assert result.done and result.objects == 9 and result.misses == 1
        assert result.nbytes == 9 * 4096 and result.keys == keys[:1] + keys[2:10]
        assert store.in_memory(result.keys)  # the cpu tier holds them: no Redis round trip
        assert not store.in_memory([keys[1]]) and not store.in_memory([keys[10]])
        assert store.stats()["tiers"]["redis"]["corrupt"] == 1
        # past the time budget, the rest loads in the background
        late = build_store(namespace, cpu_tier, redis_tier)
        p = Prewarmer(late, keys[2:12], max_bytes=1 << 20)
        assert not p.run(max_seconds=0).done
        p.thread.join(30)
        assert p.result.done and p.result.objects == 10 and late.in_memory(keys[2:12])
        late.close()
    finally:
        shared.close()
        store.close()


def test_the_hot_set_in_s3(cpu_tier, s3_tier, namespace):
    """The same through S3: the manifest written by one store, the pre-warm of another."""
    shared = build_store(namespace, s3_tier)
    store = build_store(namespace, cpu_tier, s3_tier)
    try:
        keys = [PREFIX + os.urandom(32) for _ in range(3)]
        assert all(shared.put_many(keys, [os.urandom(2048) for _ in keys]))
        writer = ManifestWriter(shared, manifest_key(PREFIX), namespace, top_k=2,
                                refresh_seconds=3600)
        writer.add([k[PREFIX_LEN:] for k in keys[1:]])
        writer.close()  # written at close
        want = prewarm_keys(read_manifest(store, manifest_key(PREFIX)), PREFIX, max_objects=8)
        assert sorted(want) == sorted(keys[1:])
        result = Prewarmer(store, want, max_bytes=1 << 20).run(max_seconds=30)
        assert result.objects == 2 and store.in_memory(keys[1:]) and not store.in_memory(keys[:1])
    finally:
        shared.close()
        store.close()


def test_the_worker_reports_prewarmed_chunks_and_counts_their_hits(cpu_tier, redis_tier,
                                                                  namespace):
    caches = {f"layer.{i}": torch.randn(8, 2, 16, 64) for i in range(2)}
    layout = KVLayout(caches, list(caches), 8, "TEST")
    chunk = layout.chunk_nbytes(BPC)
    shared = build_store(namespace, redis_tier, layout=b"l")
    store = build_store(namespace, cpu_tier, redis_tier, layout=b"l")
    keys = [PREFIX + os.urandom(32) for _ in range(3)]
    payload = torch.empty(chunk, dtype=torch.uint8)
    layout.gather(torch.tensor([0, 1]), payload)
    assert all(shared.put_many(keys, [payload.numpy()] * 3))
    side = WorkerSide(store, blocks_per_chunk=BPC, layerwise=False, block_size=16)
    side.register(layout)
    try:
        result = side.prewarm(keys[:2], max_bytes=1 << 20, max_seconds=30)
        assert result.done and result.objects == 2
        meta = side.worker_meta()
        assert meta is not None and meta.stored_keys == keys[:2]  # the scheduler's KeyIndex
        load = LoadJob("req", [ChunkLoad(keys[0], rows=[0, 1], block_ids=[5, 6])],
                       is_async=False)
        side.submit_loads(KVPoolMetadata(loads=[load]))
        side.finish_sync_loads()
        for cache in caches.values():
            assert torch.equal(cache[5:7], cache[0:2])
        stats = side.take_stats()
        assert stats is not None
        data = stats.data
        assert data["kvpool_prewarm_objects"][""] == 2
        assert data["kvpool_prewarm_bytes"][""] == 2 * chunk
        assert data["kvpool_prewarm_hit_objects"][""] == 1
        assert data["kvpool_hit_objects"]["prompt/cpu"] == 1  # served by the cpu tier
    finally:
        side.shutdown()
        store.close()
        shared.close()


def test_warm_start_needs_a_cpu_first_tier_and_a_shared_tier():
    with pytest.raises(ConnectorConfigError, match=r"extra_config\.warm_start: .*enabled: warm start"):
        load_connector_config({"tiers": [{"type": "cpu", "size": "1Gi"}],
                               "warm_start": {"enabled": True}})
    with pytest.raises(ConnectorConfigError, match=r"warm_start: .*enabled: .*promote is false"):
        load_connector_config({"tiers": [{"type": "cpu", "size": "1Gi"}, {"type": "redis", "url": "redis://h"}],
                               "promote": False, "warm_start": {"enabled": True}})
    with pytest.raises(ConnectorConfigError, match="warm_start.top_k"):
        load_connector_config({"tiers": [{"type": "cpu", "size": "1Gi"}],
                               "warm_start": {"top_k": 0}})
    cfg = load_connector_config({"tiers": [{"type": "cpu", "size": "1Gi"},
                                           {"type": "redis", "url": "redis://h:6379"}],
                                 "warm_start": {"enabled": True, "max_bytes": "2Gi"}})
    assert cfg.warm_start.max_bytes == 2 << 30 and cfg.warm_start.max_seconds == 30
    assert cfg.as_store_config() is not None  # the store never sees the connector's keys
    assert decode(b"") is None


def test_engines_with_their_own_disk_share_one_manifest_in_redis(redis_tier, namespace, tmp_path):
    """A disk in front of Redis is a pod's (or a node's): the manifest is read and written in
    Redis only, so one engine's merge never pushes its disk's stale copy over another's hits
    (it did: A adds X, B adds Y, A adds Z left Redis with X and Z)."""
    from kvpool_connector.connector.connector import _manifest_store_config
    from kvpool_connector.connector.scheduler import SchedulerSide
    from kvpool_connector.store import open_store
    from tests.conftest import SECURITY
    from tests.connector.connector.helpers import BS

    sides, stores = [], []
    for name in ("a", "b"):
        cfg = load_connector_config({
            "namespace": namespace, "security": SECURITY, "tail_objects": False,
            "warm_start": WARM, "tiers": [{"type": "cpu", "size": "64Mi"},
                                           {"type": "disk", "path": str(tmp_path / name), "size": "64Mi"},
                                           redis_tier]})
        lower = open_store(cfg.as_store_config(drop_types=("cpu",)), layout="fp")
        manifests = open_store(_manifest_store_config(cfg), layout="fp")
        assert [t.type for t in _manifest_store_config(cfg).tiers] == ["redis"]
        stores += [lower, manifests]
        sides.append(SchedulerSide(cfg, PREFIX, BS, BPC, chunk_bytes=1 << 20, world_size=1,
                                   lower_store=lower, block_ids=lambda rid: [], is_async=True,
                                   manifest_store=manifests))
    a, b = sides
    try:
        x, y, z = (make_request(f"r{i}", 600, seed=i) for i in range(3))
        for side, req in ((a, x), (b, y), (a, z)):
            side.hotset.add([k[PREFIX_LEN:] for k in chunk_keys(PREFIX, req.block_hashes, BPC)])
            assert side.hotset.refresh()
        m = read_manifest(stores[1], manifest_key(PREFIX))
        want = {k[PREFIX_LEN:] for req in (x, y, z) for k in chunk_keys(PREFIX, req.block_hashes, BPC)}
        assert m is not None and {k for k, _ in m.entries} == want
    finally:
        for side in sides:
            side.close()
        for store in stores:
            store.close()


class _ReadTimesOut:
    """The real store, whose reads answer None as the store does when a read times out (a
    fault injected here: a loopback Redis answers too fast to time out on cue)."""

    def __init__(self, store):
        self.store = store

    def get(self, *args, **kwargs):
        return None

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_a_failed_manifest_read_never_overwrites_the_pools_counts(warm_side):
    a = warm_side()
    x, y = make_request("r1", 600), make_request("r2", 600, seed=5)
    admit(a, x, 512)
    assert a.hotset is not None and a.hotset.refresh()
    b = warm_side()
    assert b.hotset is not None
    admit(b, y, 512)
    real = b.hotset.store
    b.hotset.store = _ReadTimesOut(real)
    assert not b.hotset.refresh()  # the manifest is there but unread: nothing written
    xs = {k[PREFIX_LEN:] for k in chunk_keys(PREFIX, x.block_hashes, BPC)}
    ys = {k[PREFIX_LEN:] for k in chunk_keys(PREFIX, y.block_hashes, BPC)}
    assert {k for k, _ in read_manifest(real, manifest_key(PREFIX)).entries} == xs
    b.hotset.store = real
    assert b.hotset.refresh()  # b's hits were kept for the next write
    assert {k for k, _ in read_manifest(real, manifest_key(PREFIX)).entries} == xs | ys


def test_a_frozen_redis_at_engine_start_costs_the_timeouts_not_a_hang(redis_tier, redis_server,
                                                                       namespace):
    """Warm start reads the manifest (both halves) and pre-warms through the store, whose every
    read has its deadline: with Redis frozen (SIGSTOP: it accepts and never answers) the
    scheduler half is built and the worker's pre-warm returns within a few timeouts, cold."""
    import signal
    import time

    from tests.connector.store.test_faults import BOUND

    tier = {**redis_tier}
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        side = scheduler_side(namespace, tier, tail_objects=False, timeout_seconds=0.3,
                              warm_start={**WARM})
        try:
            assert time.monotonic() - t0 < BOUND and side.hotset is not None
        finally:
            side.close()
            side.lower.close()
        store = build_store(namespace, {"type": "cpu", "size": "16Mi"}, tier, timeout=0.3)
        try:
            t0 = time.monotonic()
            manifest = read_manifest(store, manifest_key(PREFIX))
            result = Prewarmer(store, [PREFIX + os.urandom(32) for _ in range(20)], 1 << 30).run(30)
            assert manifest is None and result.objects == 0
            assert time.monotonic() - t0 < BOUND
        finally:
            store.close()
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
