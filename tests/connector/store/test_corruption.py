"""Damaged or forged objects in every tier: a miss, counted, and removed from that tier;
authentic objects of another layout: a miss, counted, and left in place."""

from __future__ import annotations

import functools
import os
import random

import pytest
import redis

from tests.connector.store.helpers import build_store

build = functools.partial(build_store, layout=b"layout-A")


def written(namespace, tier, size=200_000):
    key, val = os.urandom(32), random.randbytes(size)
    s = build(namespace, tier)
    s.put_many([key], [val])
    s.close()
    return key, val


def flip(data: bytes, pos: int) -> bytes:
    b = bytearray(data)
    b[pos] ^= 0x01
    return bytes(b)


def assert_bad_read(namespace, tier, key, counter, into=False):
    s = build(namespace, tier)
    if into:
        out = bytearray(1 << 20)
        assert s.get_into(key, out) is None
    else:
        assert s.get_many([key]) == [None]
    st = s.stats()["tiers"][tier["type"]]
    assert st[counter] == 1 and st["hits"] == 0 and st["misses"] == 1
    assert s.contains_prefix([key]) == 0  # removed
    s.close()


def name_of(namespace, tier, key) -> str:
    """Hex of the object name the pool key gives this key."""
    s = build(namespace, tier)
    try:
        return s.object_names([key])[0].hex()
    finally:
        s.close()


def disk_file(tier, namespace, key):
    h = name_of(namespace, tier, key)
    return os.path.join(tier["path"], namespace, h[:2], h + ".kv")


@pytest.mark.parametrize("into", [False, True], ids=["get_many", "get_into"])
@pytest.mark.parametrize("where", ["payload", "header", "key"])
def test_disk_flipped_byte(disk_tier, namespace, where, into):
    key, _ = written(namespace, disk_tier)
    path = disk_file(disk_tier, namespace, key)
    pos = {"payload": -1000, "header": 10, "key": 50}[where]
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(flip(data, pos))
    assert_bad_read(namespace, disk_tier, key, "corrupt", into)
    assert not os.path.exists(path)


@pytest.mark.parametrize("into", [False, True], ids=["get_many", "get_into"])
def test_disk_truncated_file(disk_tier, namespace, into):
    key, _ = written(namespace, disk_tier)
    path = disk_file(disk_tier, namespace, key)
    os.truncate(path, os.path.getsize(path) - 4096)
    assert_bad_read(namespace, disk_tier, key, "corrupt", into)
    assert not os.path.exists(path)


def test_redis_flipped_byte(redis_tier, namespace, redis_server):
    key, _ = written(namespace, redis_tier)
    r = redis.Redis.from_url(redis_server.url, password=redis_server.password)
    name = f"kvpool:{namespace}:{name_of(namespace, redis_tier, key)}"
    r.set(name, flip(r.get(name), 100_000))
    assert_bad_read(namespace, redis_tier, key, "corrupt")
    assert not r.exists(name)


def test_s3_flipped_byte(s3_tier, namespace, s3_server):
    key, _ = written(namespace, s3_tier)
    c = s3_server.client()
    name = f"kv/{namespace}/{name_of(namespace, s3_tier, key)}"
    data = c.get_object(Bucket=s3_server.bucket, Key=name)["Body"].read()
    c.put_object(Bucket=s3_server.bucket, Key=name, Body=flip(data, len(data) - 1))
    assert_bad_read(namespace, s3_tier, key, "corrupt")
    assert c.list_objects_v2(Bucket=s3_server.bucket, Prefix=name)["KeyCount"] == 0


@pytest.mark.parametrize("kind", ["cpu", "disk", "redis", "s3"])
def test_foreign_layout(kind, tier_cfgs, namespace):
    tier = tier_cfgs[kind]
    s = build(namespace, tier, layout=b"layout-A")
    key = os.urandom(32)
    s.put_many([key], [b"x" * 5000])
    if kind == "cpu":  # memory tier: read it back through the same store
        assert s.get_many([key], layout=b"layout-B") == [None]
        st = s.stats()["tiers"]["cpu"]
        assert st["foreign_layout"] == 1 and st["corrupt"] == 0
        assert s.contains_prefix([key]) == 0
        s.close()
        return
    s.close()
    other = build(namespace, tier, layout=b"layout-B")
    assert other.get_many([key]) == [None]
    st = other.stats()["tiers"][kind]
    assert st["foreign_layout"] == 1 and st["corrupt"] == 0
    assert other.contains_prefix([key]) == 1  # left for the engines of layout A
    other.close()
    again = build(namespace, tier, layout=b"layout-A")
    assert again.get_many([key]) == [b"x" * 5000]
    again.close()


def test_object_renamed_to_another_key_is_corrupt(disk_tier, namespace):
    """A file that claims another key (a rename, a collision) never serves that key."""
    key, _ = written(namespace, disk_tier)
    other = os.urandom(32)
    target = disk_file(disk_tier, namespace, other)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    os.rename(disk_file(disk_tier, namespace, key), target)
    s = build(namespace, disk_tier)
    assert s.get_many([other]) == [None]
    assert s.stats()["tiers"]["disk"]["corrupt"] == 1 and not os.path.exists(target)
    s.close()
