"""Round trips through each tier alone and the full stack, promotion, prefix lookups,
namespace isolation, restart of the disk tier, processes sharing one directory."""

from __future__ import annotations

import functools
import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvpool_connector.store import open_store
from kvpool_dev.testbed.process import ServerProcess, free_port
from tests.conftest import SECURITY
from tests.connector.store.helpers import build_store

SIZES = [1, 4095, 4096, 70_001, 1 << 20, (2 << 20) + 3]
LAYOUT = b"test-model|bf16|L2xH4xD64|blk16"


def rand_keys(n: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(n)]


def payloads_of(sizes) -> list[bytes]:
    return [random.randbytes(s) for s in sizes]


build = functools.partial(build_store, layout=LAYOUT)


@pytest.mark.parametrize("kind", ["cpu", "disk", "redis", "s3"])
def test_round_trip_single_tier(kind, tier_cfgs, namespace):
    s = build(namespace, tier_cfgs[kind])
    keys, vals = rand_keys(len(SIZES)), payloads_of(SIZES)
    s.put_many(keys, vals)
    assert s.flush(10)
    got = s.get_many(keys)
    assert [bytes(g) for g in got] == vals
    assert s.get_many(rand_keys(2)) == [None, None]
    outs = [bytearray(len(v) + 7) for v in vals]
    assert s.get_many_into(keys, outs) == [len(v) for v in vals]
    assert all(o[:len(v)] == v for o, v in zip(outs, vals, strict=True))
    assert s.get_into(keys[-1], bytearray(10)) is None  # cannot be the caller's layout
    st = s.stats()["tiers"][kind]
    assert st["rejected"] == 1 and st["errors"] == 0
    assert st["hits"] == 2 * len(SIZES) and st["misses"] == 3
    assert bytes(s.get(keys[-1])) == vals[-1]  # refused, not removed
    assert st["bytes_in"] == sum(SIZES)
    s.close()


def test_full_stack_round_trip_and_lower_tiers_filled(tier_cfgs, namespace):
    s = build(namespace, *tier_cfgs.values())
    keys, vals = rand_keys(len(SIZES)), payloads_of(SIZES)
    s.put_many(keys, vals)
    assert s.flush(20)
    assert [bytes(g) for g in s.get_many(keys)] == vals
    st = s.stats()["tiers"]
    assert st["cpu"]["hits"] == len(SIZES)
    for name in ("disk", "redis", "s3"):
        assert st[name]["bytes_in"] == sum(SIZES) and st[name]["drops"] == 0
    s.close()
    # each lower tier alone holds everything the stack wrote
    for name in ("disk", "redis", "s3"):
        alone = build(namespace, tier_cfgs[name])
        assert [bytes(g) for g in alone.get_many(keys)] == vals, name
        alone.close()


@pytest.mark.parametrize("lower", ["disk", "redis", "s3"])
def test_hit_in_lower_tier_is_promoted(lower, tier_cfgs, namespace):
    keys, vals = rand_keys(3), payloads_of([5000, 70_000, 1 << 20])
    writer = build(namespace, tier_cfgs[lower])
    writer.put_many(keys, vals)
    writer.close()
    s = build(namespace, tier_cfgs["cpu"], tier_cfgs[lower])
    assert s.contains_prefix(keys) == 3
    assert [bytes(g) for g in s.get_many(keys)] == vals
    st = s.stats()["tiers"]
    assert st[lower]["hits"] == 3 and st[lower]["promotions"] == 3
    assert st["cpu"]["objects"] == 3
    assert [bytes(g) for g in s.get_many(keys)] == vals
    assert s.stats()["tiers"]["cpu"]["hits"] == 3 and s.stats()["tiers"][lower]["hits"] == 3
    s.close()


def test_promotion_through_get_into_and_into_middle_tiers(tier_cfgs, namespace):
    keys, vals = rand_keys(2), payloads_of([1 << 20, 1 << 20])
    w = build(namespace, tier_cfgs["redis"])
    w.put_many(keys, vals)
    w.close()
    s = build(namespace, tier_cfgs["cpu"], tier_cfgs["disk"], tier_cfgs["redis"])
    outs = [bytearray(1 << 20) for _ in keys]
    assert s.get_many_into(keys, outs) == [1 << 20] * 2 and outs == vals
    assert s.flush(10)
    st = s.stats()["tiers"]
    assert st["cpu"]["objects"] == 2 and st["disk"]["objects"] == 2
    s.close()


def test_promotion_into_a_remote_first_tier(tier_cfgs, namespace):
    """Redis first, S3 below: an S3 hit is served and copied up into Redis (queued)."""
    keys, vals = rand_keys(2), payloads_of([70_000, 1 << 20])
    w = build(namespace, tier_cfgs["s3"])
    w.put_many(keys, vals)
    w.close()
    s = build(namespace, tier_cfgs["redis"], tier_cfgs["s3"])
    outs = [bytearray(len(v)) for v in vals]
    assert s.get_many_into(keys, outs) == [len(v) for v in vals] and outs == vals
    assert s.flush(10)
    st = s.stats()["tiers"]
    assert st["s3"]["promotions"] == 2 and st["redis"]["errors"] == 0
    assert [bytes(g) for g in s.get_many(keys)] == vals
    assert s.stats()["tiers"]["redis"]["hits"] == 2
    only_redis = build(namespace, tier_cfgs["redis"])
    assert [bytes(g) for g in only_redis.get_many(keys)] == vals
    only_redis.close()
    s.close()


def test_payload_types(tier_cfgs, namespace):
    s = build(namespace, tier_cfgs["cpu"], tier_cfgs["disk"])
    arr = np.arange(4096, dtype=np.float32)
    t = torch.arange(8192, dtype=torch.int16).view(torch.uint8)
    items = {b"n" * 32: arr, b"t" * 32: t, b"b" * 32: bytearray(b"xyz"),
             b"m" * 32: memoryview(b"0123456789")[2:8], b"2d" * 16: np.ones((3, 5), np.int64)}
    s.put_many(list(items), list(items.values()))
    expect = {k: memoryview(v.numpy() if isinstance(v, torch.Tensor) else v).tobytes()
              for k, v in items.items()}
    assert {k: bytes(v) for k, v in zip(items, s.get_many(list(items)), strict=True)} == expect
    dst = torch.empty(t.numel(), dtype=torch.uint8)
    assert s.get_into(b"t" * 32, dst) == t.numel() and torch.equal(dst, t)
    with pytest.raises(TypeError):
        s.put_many(["not-bytes"], [b"x"])
    with pytest.raises(ValueError):
        s.put_many([b"k" * 32], [])
    s.close()


def test_caller_may_reuse_its_buffer_after_put(tier_cfgs, namespace):
    s = build(namespace, tier_cfgs["cpu"], tier_cfgs["redis"])
    buf = bytearray(random.randbytes(100_000))
    original = bytes(buf)
    key = os.urandom(32)
    s.put_many([key], [buf])
    buf[:] = bytes(len(buf))  # the connector reuses staging buffers at once
    assert s.flush(10)
    s.close()
    lower = build(namespace, tier_cfgs["redis"])
    assert bytes(lower.get_many([key])[0]) == original
    lower.close()


@pytest.mark.parametrize("kinds", [("cpu",), ("disk",), ("redis",), ("s3",), ("cpu", "disk"),
                                   ("cpu", "redis", "s3")])
def test_contains_prefix(kinds, tier_cfgs, namespace):
    s = build(namespace, *(tier_cfgs[k] for k in kinds))
    keys = rand_keys(40)
    assert s.contains_prefix(keys) == 0
    s.put_many(keys[:10] + keys[11:20], [b"v"] * 19)
    assert s.flush(10)
    assert s.contains_prefix(keys) == 10
    assert s.contains_prefix(keys[11:]) == 9
    assert s.contains_prefix([]) == 0
    s.close()


def test_contains_prefix_unions_tiers(tier_cfgs, namespace):
    """Key 0 only in redis, key 1 only in cpu: the prefix spans both tiers."""
    keys = rand_keys(3)
    r = build(namespace, tier_cfgs["redis"])
    r.put_many([keys[0]], [b"zero"])
    r.close()
    s = build(namespace, tier_cfgs["cpu"], tier_cfgs["redis"], promote=False)
    s.runners[0].tier.put_many([_rec(s.object_names([keys[1]])[0], b"one", s.layout)])
    assert s.contains_prefix(keys) == 2
    s.close()


@pytest.mark.parametrize("kinds", [("cpu",), ("disk",), ("redis",), ("s3",), ("disk", "redis"),
                                   ("disk", "s3")])
def test_first_present_asks_each_key_on_its_own(kinds, tier_cfgs, namespace, monkeypatch):
    """Unrelated keys (the connector's tail candidates, longest first): the first one some
    tier holds, whatever is missing before it; a tier that answers every name (Redis) is
    asked for all of them in one call."""
    s = build(namespace, *(tier_cfgs[k] for k in kinds))
    keys = rand_keys(6)
    assert s.first_present(keys) is None and s.first_present([]) is None
    s.put_many([keys[3], keys[5]], [b"v"] * 2)
    assert s.flush(10)
    assert s.contains_prefix(keys) == 0
    calls: list[int] = []
    for r in s.runners:
        real = r.tier.contains_many
        monkeypatch.setattr(r.tier, "contains_many",
                            functools.partial(lambda real, names: (calls.append(len(names)),
                                                                   real(names))[1], real))
    assert s.first_present(keys) == 3
    assert calls[0] == 6  # every name in the first call (S3: one wave of HEADs)
    if kinds == ("redis",):
        assert calls == [6]  # one pipeline of EXISTS
    s.close()


def test_first_present_unions_tiers(tier_cfgs, namespace):
    """Key 1 only in Redis, key 2 on disk: Redis's answer wins, being first."""
    keys = rand_keys(4)
    for kind, key in (("redis", keys[1]), ("disk", keys[2])):
        one = build(namespace, tier_cfgs[kind])
        one.put_many([key], [b"v"])
        one.close()
    s = build(namespace, tier_cfgs["disk"], tier_cfgs["redis"], promote=False)
    assert s.first_present(keys) == 1
    assert s.first_present(keys[2:]) == 0
    s.close()


def _rec(name, payload, layout):
    from kvpool_connector.store.format import Record

    return Record(name, layout, memoryview(payload))


@pytest.mark.parametrize("kind", ["disk", "redis", "s3"])
def test_namespaces_are_isolated(kind, tier_cfgs, namespace):
    a = build(namespace + "-a", tier_cfgs[kind])
    b = build(namespace + "-b", tier_cfgs[kind])
    key = os.urandom(32)
    a.put_many([key], [b"from a"])
    a.flush(10)
    assert b.get_many([key]) == [None] and b.contains_prefix([key]) == 0
    b.put_many([key], [b"from b"])
    b.flush(10)
    assert bytes(a.get_many([key])[0]) == b"from a"
    assert bytes(b.get_many([key])[0]) == b"from b"
    a.close()
    b.close()


def test_s3_objects_live_under_prefix_and_namespace(tier_cfgs, namespace, s3_server):
    s = build(namespace, tier_cfgs["s3"])
    key = os.urandom(32)
    s.put_many([key], [b"payload"])
    s.close()
    listed = s3_server.client().list_objects_v2(Bucket=s3_server.bucket,
                                                Prefix=f"kv/{namespace}/")
    name = s.object_names([key])[0].hex()
    assert [o["Key"] for o in listed["Contents"]] == [f"kv/{namespace}/{name}"]
    assert key.hex() not in name  # the key (a prompt's hash) cannot be read off the bucket


def test_s3_creates_its_bucket(tier_cfgs, namespace, s3_server):
    cfg = dict(tier_cfgs["s3"], bucket="made-by-kvpool-" + namespace[2:], create_bucket=True)
    s = build(namespace, cfg)
    key = os.urandom(32)
    s.put_many([key], [b"v"])
    assert bytes(s.get_many([key])[0]) == b"v"
    s.close()


def test_redis_ttl(tier_cfgs, namespace, redis_server):
    import redis

    s = build(namespace, dict(tier_cfgs["redis"], ttl_seconds=3600))
    key = os.urandom(32)
    s.put_many([key], [b"v"])
    s.close()
    r = redis.Redis.from_url(redis_server.url, password=redis_server.password)
    assert 0 < r.ttl(f"kvpool:{namespace}:{s.object_names([key])[0].hex()}") <= 3600


def test_disk_restart_finds_objects(tmp_path, namespace):
    cfg = {"type": "disk", "path": str(tmp_path), "size": "64Mi", "rescan_seconds": 0}
    keys, vals = rand_keys(200), payloads_of([random.randrange(1, 50_000) for _ in range(200)])
    s = build(namespace, cfg)
    s.put_many(keys, vals)
    s.close()
    s2 = build(namespace, cfg)
    assert s2.stats()["tiers"]["disk"]["objects"] == 200
    assert s2.contains_prefix(keys) == 200
    assert [bytes(g) for g in s2.get_many(keys)] == vals
    s2.close()


_WRITER = """
import os, sys
from kvpool_connector.store import open_store
from kvpool_dev.testbed.process import ServerProcess, free_port
s = open_store({"namespace": sys.argv[2], "metrics": False, "tiers": [{"type": "disk",
    "path": sys.argv[1], "size": "64Mi", "rescan_seconds": 0}],
    "security": {"key_env": "KVPOOL_TEST_POOL_KEY"}}, layout=b"L")
for r in range(30):
    for i in range(20):
        s.put_many([bytes([i]) * 32], [bytes([i, r % 5]) * (50_000 + i)])
s.close()
"""


def test_processes_share_a_directory(tmp_path, namespace):
    """Two writer processes overwrite the same objects while this one reads: every read is
    either a miss or the whole right object; afterwards this process sees all of them."""
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), namespace])
             for _ in range(2)]
    reader = open_store({"namespace": namespace, "security": SECURITY, "tiers": [
        {"type": "disk", "path": str(tmp_path), "size": "64Mi", "rescan_seconds": 0.2}]},
        layout=b"L")
    keys = [bytes([i]) * 32 for i in range(20)]
    variants = [{bytes([i, r]) * (50_000 + i) for r in range(5)} for i in range(20)]
    while any(p.poll() is None for p in procs):
        for i, g in enumerate(reader.get_many(keys)):
            assert g is None or bytes(g) in variants[i]
    assert [p.wait() for p in procs] == [0, 0]
    final = reader.get_many(keys)
    assert all(g is not None and bytes(g) in variants[i] for i, g in enumerate(final))
    assert reader.stats()["tiers"]["disk"]["corrupt"] == 0
    assert not os.listdir(tmp_path / namespace / ".tmp")
    assert reader.contains_prefix(keys) == 20
    reader.close()


def test_disk_presence_written_by_another_process(tmp_path, namespace):
    """The scheduler's store finds what a worker's store just wrote, with no rescan."""
    cfg = {"type": "disk", "path": str(tmp_path), "size": "64Mi", "rescan_seconds": 0}
    scheduler, worker = build(namespace, cfg), build(namespace, cfg)
    keys = rand_keys(5)
    assert scheduler.contains_prefix(keys) == 0
    worker.put_many(keys[:3], [b"kv"] * 3)
    assert scheduler.contains_prefix(keys) == 3
    assert scheduler.stats()["tiers"]["disk"]["objects"] == 3
    scheduler.close()
    worker.close()


def test_layout_per_call_overrides_default(tier_cfgs, namespace):
    s = build(namespace, tier_cfgs["cpu"])
    key = os.urandom(32)
    s.put_many([key], [b"v"], layout=b"other-layout")
    assert s.get_many([key], layout=b"other-layout")[0] == b"v"
    assert s.get_many([key]) == [None]  # default layout: foreign, removed
    assert s.stats()["tiers"]["cpu"]["foreign_layout"] == 1
    s.close()


# Run in a fresh interpreter: measured inside a pytest worker, the resident size also moved
# with what earlier tests of that worker left behind (it grew 300 MB during one soak there).
SOAK = """
import json, os, sys
import numpy as np
from kvpool_connector.store import open_store
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
s = open_store({"namespace": sys.argv[1], "metrics": False,
                "tiers": [{"type": "cpu", "size": "4Mi", "slot_size": "64Ki"}]}, layout=b"L")
keys = [os.urandom(32) for _ in range(256)]
payload = np.random.bytes(60_000)
out = bytearray(64 * 1024)
def cycle():
    for i in range(0, len(keys), 8):
        s.put_many(keys[i:i + 8], [payload] * 8)
        s.get_many(keys[max(0, i - 32):i + 8])
        s.get_into(keys[i], out)
for _ in range(3):
    cycle()
before = rss()
for _ in range(40):
    cycle()
print(json.dumps({"grew": rss() - before, "used": s.stats()["tiers"]["cpu"]["used_bytes"]}))
s.close()
"""


def test_cpu_soak_keeps_memory_flat(namespace):
    """Thousands of puts and gets through a 4 MiB arena: resident memory stays put."""
    proc = subprocess.run([sys.executable, "-c", SOAK, namespace], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["grew"] < 8 << 20 and result["used"] <= 4 << 20, result


def test_prometheus_series_and_several_stores(tier_cfgs, namespace):
    from prometheus_client import REGISTRY, generate_latest

    stores = [build(namespace, tier_cfgs["cpu"]) for _ in range(3)]
    for s in stores:
        s.put_many([b"k" * 32], [b"v"])
        s.get_many([b"k" * 32, b"j" * 32])
    text = generate_latest(REGISTRY).decode()
    assert (f'kvpool_store_events_total{{event="hits",store="{namespace}",tier="cpu"}} 3.0'
            in text)
    assert f'kvpool_store_tier_healthy{{store="{namespace}",tier="cpu"}} 1.0' in text
    assert "kvpool_store_op_seconds_bucket" in text
    assert f'kvpool_store_tier_used_bytes{{store="{namespace}",tier="cpu"}}' in text
    assert all(s.stats()["tiers"]["cpu"]["hits"] == 1 for s in stores)
    for s in stores:
        s.close()


def test_disk_direct_io(tmp_path, namespace):
    """O_DIRECT writes through a page-aligned copy; the alignment padding is trimmed."""
    keys, vals = rand_keys(3), payloads_of([1, 4096 + 17, (1 << 20) + 5])
    s = build(namespace, {"type": "disk", "path": str(tmp_path), "size": "3Mi",
                          "direct_io": True, "rescan_seconds": 0})
    s.put_many(keys, vals)
    tier = s.runners[0].tier  # O_DIRECT where the filesystem takes it, else buffered writes
    assert [bytes(g) for g in s.get_many(keys)] == vals
    assert [os.path.getsize(tier.path(n)) for n in s.object_names(keys)] == \
        [len(v) + 48 + 32 + 16 for v in vals]  # header, name, tag
    s.close()


def test_concurrent_callers_never_see_wrong_bytes(tier_cfgs, namespace):
    """Threads writing, reading and probing one store whose arena keeps evicting: every
    answer is a miss or exactly the bytes of its key."""
    import threading

    s = build(namespace, {"type": "cpu", "size": "1Mi", "slot_size": "64Ki",
                          "eviction": "arc"}, tier_cfgs["disk"], tier_cfgs["redis"])
    keys = rand_keys(64)
    value = {k: k * (1000 + i) for i, k in enumerate(keys)}
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        out = bytearray(64 * 1024)
        for _ in range(150):
            batch = rng.sample(keys, 4)
            op = rng.random()
            if op < 0.4:
                s.put_many(batch, [value[k] for k in batch])
            elif op < 0.7:
                for k, g in zip(batch, s.get_many(batch), strict=True):
                    if g is not None and bytes(g) != value[k]:
                        errors.append("get_many")
            elif op < 0.9:
                n = s.get_into(batch[0], out)
                if n is not None and out[:n] != value[batch[0]]:
                    errors.append("get_into")
            else:
                s.contains_prefix(batch)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert s.flush(20)
    assert not errors
    st = s.stats()["tiers"]
    assert st["cpu"]["evictions"] > 0 and st["cpu"]["used_bytes"] <= 1 << 20
    assert all(t["errors"] == 0 and t["corrupt"] == 0 for t in st.values())
    s.close()


def test_redis_over_tls(tmp_path, namespace):
    """rediss:// against a real TLS redis-server, verified with its CA file (and insecure)."""
    from tests.conftest import self_signed_cert

    cert, key = self_signed_cert(tmp_path)
    port = free_port()
    with ServerProcess(
            ["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
             "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file",
             str(cert), "--tls-auth-clients", "no", "--save", "", "--dir", str(tmp_path)],
            port):
        url = f"rediss://127.0.0.1:{port}/0"
        key_ = os.urandom(32)
        s = build(namespace, {"type": "redis", "url": url, "tls_ca_file": str(cert)})
        s.put_many([key_], [b"over tls"])
        assert bytes(s.get_many([key_])[0]) == b"over tls"
        s.close()
        s = build(namespace, {"type": "redis", "url": url, "tls_insecure": True})
        assert bytes(s.get_many([key_])[0]) == b"over tls"
        s.close()
        s = build(namespace, {"type": "redis", "url": url})  # system CAs: not trusted
        assert s.get_many([key_]) == [None]
        assert s.stats()["tiers"]["redis"]["errors"] == 1
        s.close()


def test_s3_over_tls_with_a_ca_file(tmp_path, namespace, monkeypatch):
    """https:// against a real S3 server (moto) with a self-signed certificate: trusted
    through tls_ca_file, refused with the system CAs."""
    from tests.conftest import self_signed_cert

    cert, key = self_signed_cert(tmp_path)
    port = free_port()
    with ServerProcess([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port),
                        "-c", str(cert), "-k", str(key)], port):
        monkeypatch.setenv("TLS_AK", "test")
        monkeypatch.setenv("TLS_SK", "test")
        tier = {"type": "s3", "endpoint": f"https://127.0.0.1:{port}", "bucket": "tls-bucket",
                "create_bucket": True, "access_key_env": "TLS_AK", "secret_key_env": "TLS_SK"}
        s = build(namespace, {**tier, "tls_ca_file": str(cert)})
        k = os.urandom(32)
        s.put_many([k], [b"over tls"])
        assert bytes(s.get_many([k])[0]) == b"over tls"
        s.close()
        untrusted = build(namespace, tier)
        assert untrusted.get_many([k]) == [None]
        assert untrusted.stats()["tiers"]["s3"]["errors"] == 1
        untrusted.close()


def test_s3_presence_cache_saves_requests(tier_cfgs, namespace, s3_server):
    """Repeated lookups of one prefix: the first asks S3, the next ones do not; an object
    deleted behind the store's back is then a miss at read time, never wrong bytes."""
    s = build(namespace, tier_cfgs["s3"])
    keys = rand_keys(20)
    s.put_many(keys[:12], [b"v"] * 12)
    other = build(namespace, tier_cfgs["s3"])  # a fresh process: knows nothing yet
    heads = []
    other.runners[0].tier.client.meta.events.register(
        "before-call.s3.HeadObject", lambda **kw: heads.append(1))
    assert other.contains_prefix(keys) == 12
    asked = len(heads)
    assert asked >= 13
    assert other.contains_prefix(keys) == 12 and len(heads) == asked
    s3_server.client().delete_object(Bucket=s3_server.bucket,
                                     Key=f"kv/{namespace}/{s.object_names(keys)[0].hex()}")
    assert other.contains_prefix(keys) == 12  # cached presence ...
    assert other.get_many(keys[:1]) == [None]  # ... costs a miss, and is corrected
    assert other.contains_prefix(keys) == 0
    # a miss is remembered too, until someone reports the key stored (the connector's
    # scheduler does, for chunks its workers just saved)
    s.put_many(keys[:1], [b"v"])
    assert other.contains_prefix(keys) == 0
    other.forget_absent(keys[:1])
    assert other.contains_prefix(keys) == 12
    s.close()
    other.close()


def test_disk_lookups_of_indexed_objects_need_no_call_into_the_tier(tmp_path, namespace):
    """The scheduler's lookup of a cached prefix is answered from the disk tier's index in
    the caller's thread; only a name the index lacks (another process may have written it)
    goes to the tier's pool, with its deadline."""
    s = build(namespace, {"type": "disk", "path": str(tmp_path), "size": "16Mi",
                          "rescan_seconds": 0})
    keys = [os.urandom(32) for _ in range(4)]
    s.put_many(keys, [b"kv" * 1000] * len(keys))
    tier = s.runners[0].tier
    calls = []
    real = tier.contains_many
    tier.contains_many = lambda names: calls.append(len(names)) or real(names)
    assert s.contains_prefix(keys) == 4 and calls == []
    assert s.contains_prefix(keys + [os.urandom(32)]) == 4 and calls == [5]
    s.close()


def test_read_in_place_lends_the_cpu_tiers_bytes_and_nothing_else(tier_cfgs, namespace):
    """read_in_place: the cpu tier's own bytes, read-only, to a callback; an object only in a
    lower tier, of another layout, spanning slots or refused by the callback is not taken
    (the caller reads it with get_many_into); the callback's error is not the tier's."""
    s = build(namespace, {"type": "cpu", "size": "1Mi", "slot_size": "64Ki"}, tier_cfgs["disk"],
              promote=False)
    small, big, lower, absent, other = rand_keys(5)
    data = {small: random.randbytes(5000), big: random.randbytes(100_000),
            lower: random.randbytes(5000)}
    s.put_many([small, big, lower], [data[small], data[big], data[lower]])
    s.put_many([other], [b"x" * 10], layout=b"other-layout")
    assert s.flush(5)
    s.runners[0].tier.delete_many(s.object_names([lower]))  # lower: in the disk tier only
    seen = {}

    def use(i, view):
        assert view.readonly
        seen[i] = bytes(view)
        return True

    keys = [small, big, lower, absent, other]
    assert s.read_in_place(keys, use) == [True, False, False, False, False]
    assert seen == {0: data[small]}
    assert s.stats()["tiers"]["cpu"]["hits"] == 1
    assert s.read_in_place([small], lambda i, v: False) == [False]  # refused: not taken

    def broken(i, view):
        raise RuntimeError("the reader's bug")

    assert s.read_in_place([small], broken) == [False]
    assert s.read_in_place([small], use) == [True]  # the tier is still healthy
    assert [bytes(v) for v in s.get_many([big, lower])] == [data[big], data[lower]]  # the rest
    s.close()


def test_nothing_overwrites_a_slot_while_it_is_lent(namespace):
    """A put that must evict the lent object waits until the callback returns: the bytes
    it reads are the object's, whole."""
    import threading

    s = build(namespace, {"type": "cpu", "size": "64Ki", "slot_size": "64Ki"}, metrics=False)
    first, second = rand_keys(2)
    s.put_many([first], [b"a" * 60_000])
    lent, put_started, put_done = threading.Event(), threading.Event(), threading.Event()
    copies = []

    def use(i, view):
        lent.set()
        assert put_started.wait(5)  # the put is under way (not merely not started yet)
        assert not put_done.wait(0.3)  # and held off for as long as we read
        copies.append(bytes(view))
        return True

    def put():
        put_started.set()
        s.put_many([second], [b"b" * 60_000])
        put_done.set()

    t = threading.Thread(target=put)
    reader = threading.Thread(target=s.read_in_place, args=([first], use))
    reader.start()
    assert lent.wait(5)
    t.start()
    reader.join(5)
    t.join(5)
    assert copies == [b"a" * 60_000] and put_done.is_set()
    assert s.get_many([first, second]) == [None, b"b" * 60_000]  # evicted only afterwards
    s.close()


def test_write_in_place_fills_a_slot_of_a_memory_only_store(tier_cfgs, namespace):
    """write_in_place: the slot is the caller's to fill, then the object is stored (and
    reads back); an object larger than a slot, a store with lower tiers to write behind or
    slots not sized yet -> None (put_many's job); a fill that refuses or raises stores
    nothing and frees its slot; the evict-first predicate still holds."""
    s = build(namespace, {"type": "cpu", "size": "256Ki", "slot_size": "64Ki"}, metrics=False)
    a, b, c, t = rand_keys(4)
    data = random.randbytes(60_000)

    def fill(i, view):
        assert not view.readonly and len(view) == 60_000
        view[:] = data
        return True

    assert s.write_in_place([a], [60_000], fill) == [True]
    assert bytes(s.get_many([a])[0]) == data
    assert s.write_in_place([b], [70_000], fill) is None  # larger than a slot
    assert s.write_in_place([b], [60_000], lambda i, v: False) == [False]

    def broken(i, view):
        raise RuntimeError("the writer's bug")

    assert s.write_in_place([b], [60_000], broken) == [False]
    assert s.get_many([b]) == [None]
    assert s.stats()["tiers"]["cpu"]["used_bytes"] == 64 << 10  # a's slot only
    # a name already held (a content address) is kept: fill is not called, so a fill that
    # would fail cannot lose it
    assert s.write_in_place([a], [60_000], broken) == [True]
    assert bytes(s.get_many([a])[0]) == data
    s.set_evict_first(lambda k: k == t)
    assert s.write_in_place([t, b, c], [60_000] * 3, fill) == [True] * 3
    assert s.put_many(rand_keys(1), [data]) == [True]  # the arena is full: t goes first
    assert s.get_many([t]) == [None] and None not in s.get_many([a, b, c])
    s.close()
    lower = build(namespace, {"type": "cpu", "size": "256Ki", "slot_size": "64Ki"},
                  tier_cfgs["disk"])
    assert lower.write_in_place([a], [10], fill) is None  # lower tiers: put_many writes them
    lower.close()
    unsized = build(namespace, {"type": "cpu", "size": "256Ki"}, metrics=False)
    assert unsized.write_in_place([a], [10], fill) is None
    unsized.close()


def test_a_write_through_skips_what_the_shared_tier_holds(cpu_tier, redis_tier, redis_server, namespace):
    """A handover's write-through (put_many_through) of objects Redis already holds sends none
    of them again (a cached 2048-token prompt re-wrote 10 objects per request); one gone from
    Redis is written again; every one is reported durable."""
    import redis as redis_py

    client = redis_py.Redis.from_url(redis_server.url, password=redis_server.password)
    store = build_store(namespace, cpu_tier, redis_tier, layout=b"L")

    def sets() -> int:
        return int(client.info("commandstats").get("cmdstat_set", {}).get("calls", 0))

    keys, vals = [os.urandom(32) for _ in range(4)], [os.urandom(4096) for _ in range(4)]
    assert store.put_many_through(keys, vals) == ([True] * 4, [True] * 4)
    before = sets()
    assert store.put_many_through(keys, vals) == ([True] * 4, [True] * 4)
    assert sets() == before  # nothing sent again
    names = list(client.scan_iter(match=f"*{namespace}*"))
    assert len(names) == 4, names
    client.delete(names[0])
    assert store.put_many_through(keys, vals)[1] == [True] * 4
    assert sets() == before + 1  # only the object that was gone
    assert store.get_many(keys) == vals
    store.close()


def test_a_write_through_goes_in_deadline_sized_calls(cpu_tier, redis_tier, redis_server, namespace,
                                                      monkeypatch):
    """Each call to a shared tier carries at most THROUGH_BATCH_BYTES (a 512 MiB handover in one
    call ran past the deadline whole); the records keep their order and all land."""
    from kvpool_connector.store import tiered

    class Sized:
        def __init__(self, size: int) -> None:
            self.size = size

    cut = tiered._batches([Sized(n) for n in (30, 30, 30, 100, 10)], 64)
    assert [[r.size for r in b] for b in cut] == [[30, 30], [30], [100], [10]]
    assert tiered._batches([], 64) == []

    calls: list[int] = []
    monkeypatch.setattr(tiered, "THROUGH_BATCH_BYTES", 10_000)
    store = build_store(namespace, cpu_tier, redis_tier, layout=b"L")
    redis_runner = store.runners[1]
    put_now = redis_runner.put_now
    monkeypatch.setattr(redis_runner, "put_now", lambda recs: calls.append(len(recs)) or put_now(recs))
    keys, vals = [os.urandom(32) for _ in range(5)], [os.urandom(4096) for _ in range(5)]
    assert store.put_many_through(keys, vals) == ([True] * 5, [True] * 5)
    assert calls == [2, 2, 1]  # about 4.1 KiB sealed each: two per 10 kB call
    assert store.get_many(keys) == vals
    store.close()
