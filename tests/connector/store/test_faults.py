"""Backends that die, hang, fill up or refuse writes: calls keep returning within their
bound, other tiers keep serving, nothing raises, service comes back by itself.

The elapsed-time checks below are hang detectors with generous slack (several times the
configured 0.3 s timeout), not performance assertions.
"""

from __future__ import annotations

import functools
import os
import signal
import time

import boto3
import pytest

from kvpool_dev.testbed.process import free_port
from tests.connector.store.helpers import build_store

TIMEOUT = 0.3
# A hang detector, not a timing goal: a call that waits on a dead backend without its
# deadline blocks for the OS's timeouts (minutes); a bounded one returns in about TIMEOUT.
# 4 * TIMEOUT + 1 s failed once with 5 test runs sharing the 2 cores (building a boto3
# client alone took over 2 s), so the bound leaves room for a loaded machine.
BOUND = 4 * TIMEOUT + 8.0


build = functools.partial(build_store, layout=b"L", timeout=TIMEOUT,
                          backoff_initial_seconds=0.1, backoff_max_seconds=0.5)


def bounded(fn, *args):
    t0 = time.monotonic()
    res = fn(*args)
    elapsed = time.monotonic() - t0
    assert elapsed < BOUND, f"{getattr(fn, 'func', fn).__name__} took {elapsed:.2f}s"
    return res


def exercise(store, keys, vals):
    """Every API call once, each bounded; returns what get_many saw."""
    bounded(store.put_many, keys, vals)
    got = bounded(store.get_many, keys)
    bounded(store.contains_prefix, keys)
    outs = [bytearray(len(v)) for v in vals]
    bounded(store.get_many_into, keys, outs)
    bounded(store.stats)
    return got


def wait_until(cond, seconds=30.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False


def test_redis_stopped_mid_run_and_restarted(cpu_tier, redis_tier, redis_server, namespace):
    stack = build(namespace, cpu_tier, redis_tier)
    alone = build(namespace, redis_tier)  # redis as the synchronous first tier
    keys, vals = [os.urandom(32) for _ in range(4)], [os.urandom(300_000) for _ in range(4)]
    stack.put_many(keys[:2], vals[:2])
    assert stack.flush(10)
    try:
        redis_server.stop()
        for _ in range(5):
            got = exercise(stack, keys, vals)
            assert [bytes(g) for g in got] == vals  # the cpu tier keeps serving
            assert exercise(alone, keys, vals) == [None] * 4
        assert bounded(stack.flush, BOUND)
        st = stack.stats()["tiers"]["redis"]
        assert not st["healthy"] and st["errors"] >= 1 and st["drops"] >= 1
        assert not alone.stats()["tiers"]["redis"]["healthy"]
    finally:
        redis_server.start()
    # recovery needs no intervention: writes and reads succeed again after the backoff
    key, val = os.urandom(32), os.urandom(1000)

    def recovered():
        alone.put_many([key], [val])
        return alone.get_many([key])[0] == val
    assert wait_until(recovered)

    def stack_recovered():
        stack.put_many(keys, vals)
        stack.flush(5)
        return alone.get_many(keys) == vals
    assert wait_until(stack_recovered)
    assert stack.stats()["tiers"]["redis"]["healthy"]
    stack.close()
    alone.close()


def test_redis_hanging_is_cut_off_at_the_timeout(cpu_tier, redis_tier, redis_server, namespace):
    """A frozen server (SIGSTOP) accepts connections but never answers."""
    stack = build(namespace, cpu_tier, redis_tier)
    alone = build(namespace, redis_tier)
    keys, vals = [os.urandom(32) for _ in range(3)], [os.urandom(100_000) for _ in range(3)]
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        for _ in range(3):
            assert [bytes(g) for g in exercise(stack, keys, vals)] == vals
            assert exercise(alone, keys, vals) == [None] * 3
        assert alone.stats()["tiers"]["redis"]["timeouts"] >= 1
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)

    def recovered():
        alone.put_many(keys, vals)
        return alone.get_many(keys) == vals
    assert wait_until(recovered)
    bounded(stack.close)
    alone.close()


def test_s3_at_a_dead_port(cpu_tier, s3_tier, disk_tier, namespace):
    dead = dict(s3_tier, endpoint=f"http://127.0.0.1:{free_port()}")
    stack = build(namespace, cpu_tier, disk_tier, dead)
    alone = build(namespace, dead)
    keys, vals = [os.urandom(32) for _ in range(4)], [os.urandom(200_000) for _ in range(4)]
    for _ in range(3):
        assert [bytes(g) for g in exercise(stack, keys, vals)] == vals
        assert exercise(alone, keys, vals) == [None] * 4
    assert stack.flush(BOUND)
    st = stack.stats()["tiers"]
    assert not st["s3"]["healthy"] and st["s3"]["errors"] >= 1
    assert st["disk"]["healthy"] and st["disk"]["objects"] == 4
    stack.close()
    alone.close()


def test_full_disk_drops_writes_and_keeps_serving(small_fs, cpu_tier, namespace):
    """A 4 MiB filesystem under a disk tier configured for 64 MiB."""
    disk = {"type": "disk", "path": str(small_fs), "size": "64Mi", "rescan_seconds": 0}
    stack = build(namespace, cpu_tier, disk)
    alone = build(namespace, disk)
    keys, vals = [os.urandom(32) for _ in range(16)], [os.urandom(512 * 1024) for _ in range(16)]
    for i in range(0, 16, 4):
        bounded(stack.put_many, keys[i:i + 4], vals[i:i + 4])
        bounded(alone.put_many, keys[i:i + 4], vals[i:i + 4])
    assert stack.flush(10)
    assert [bytes(g) for g in bounded(stack.get_many, keys)] == vals  # cpu serves all
    st = alone.stats()["tiers"]["disk"]
    assert st["errors"] >= 1 and st["bytes_in"] < 4 << 20
    assert stack.stats()["tiers"]["disk"]["errors"] + stack.stats()["tiers"]["disk"]["drops"] >= 1
    # what made it to disk is intact and still readable; failed writes left no temp files
    readable = [g for g in alone.get_many(keys) if g is not None]
    assert 0 < len(readable) < 16
    assert all(bytes(g) in vals for g in readable)
    assert not os.listdir(small_fs / namespace / ".tmp")
    stack.close()
    alone.close()


def test_one_enospc_does_not_fail_the_next_write(small_fs, namespace):
    """A disk tier whose filesystem is full for one write: that write fails, the next one, once
    there is room, is written at once (before, the failure tripped the write breaker and the
    next write was dropped for the backoff)."""
    disk = {"type": "disk", "path": str(small_fs), "size": "64Mi", "rescan_seconds": 0}
    alone = build(namespace, disk)
    filler = small_fs / "filler"
    filler.write_bytes(b"\0" * ((4 << 20) - (256 << 10)))  # 256 KiB left of 4 MiB
    keys, vals = [os.urandom(32) for _ in range(2)], [os.urandom(512 * 1024) for _ in range(2)]
    assert alone.put_many(keys[:1], vals[:1]) == [False]
    filler.unlink()
    assert alone.put_many(keys[1:], vals[1:]) == [True]
    st = alone.stats()["tiers"]["disk"]
    assert (st["errors"], st["drops"], st["writes_healthy"]) == (1, 1, True)  # the failed one alone
    assert alone.get_many(keys) == [None, vals[1]]
    alone.close()


def test_one_timeout_does_not_fail_the_next_write(redis_tier, redis_server, namespace):
    """Redis frozen for one write (cut off at the deadline), then answering again: the next
    write goes through at once."""
    alone = build(namespace, redis_tier)
    keys, vals = [os.urandom(32) for _ in range(2)], [os.urandom(1000) for _ in range(2)]
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        assert bounded(alone.put_many, keys[:1], vals[:1]) == [False]
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    assert alone.put_many(keys[1:], vals[1:]) == [True]
    st = alone.stats()["tiers"]["redis"]
    assert (st["timeouts"], st["writes_healthy"]) == (1, True)
    assert alone.get_many(keys[1:]) == vals[1:]
    alone.close()


def test_a_tier_that_stays_down_is_backed_off_after_three_failed_writes(redis_tier, redis_server, namespace):
    """Writes to a stopped Redis: the first three fail (each tried), then the breaker trips and
    writes are skipped (dropped, counted) until a probe after the backoff finds it back."""
    alone = build(namespace, redis_tier)
    key, val = os.urandom(32), os.urandom(1000)
    redis_server.stop()
    try:
        for n in range(1, 4):
            assert bounded(alone.put_many, [key], [val]) == [False]
            st = alone.stats()["tiers"]["redis"]
            assert st["errors"] + st["timeouts"] == n and st["writes_healthy"] is (n < 3), (n, st)
        assert alone.put_many([key], [val]) == [False]  # skipped: not tried
        st = alone.stats()["tiers"]["redis"]
        assert st["errors"] + st["timeouts"] == 3 and st["drops"] >= 1
    finally:
        redis_server.start()

    def recovered():
        return alone.put_many([key], [val]) == [True]
    assert wait_until(recovered)
    assert alone.stats()["tiers"]["redis"]["writes_healthy"]
    alone.close()


def test_read_only_directory(make_readonly, cpu_tier, namespace):
    prepare, freeze = make_readonly
    path = prepare()
    disk = {"type": "disk", "path": str(path), "size": "64Mi", "rescan_seconds": 0}
    alone = build(namespace, disk)
    old_keys, old_vals = [os.urandom(32) for _ in range(3)], [os.urandom(70_000) for _ in range(3)]
    alone.put_many(old_keys, old_vals)
    freeze(path)
    stack = build(namespace, cpu_tier, disk)
    keys, vals = [os.urandom(32) for _ in range(3)], [os.urandom(70_000) for _ in range(3)]
    for _ in range(3):
        assert [bytes(g) for g in exercise(stack, keys, vals)] == vals
        exercise(alone, keys, vals)
    assert stack.flush(10)
    assert stack.stats()["tiers"]["disk"]["drops"] >= 1
    assert alone.stats()["tiers"]["disk"]["errors"] >= 1
    assert alone.get_many(keys) == [None] * 3
    # failing writes do not take reads down: what the disk holds is still served
    assert [bytes(g) for g in alone.get_many(old_keys)] == old_vals
    assert alone.stats()["tiers"]["disk"]["reads_healthy"]
    stack.close()
    alone.close()


def test_open_store_never_touches_a_dead_backend(cpu_tier, namespace):
    """Opening a store over unreachable Redis and S3 succeeds at once; config errors do not."""
    dead_redis = {"type": "redis", "url": f"redis://127.0.0.1:{free_port()}/0"}
    dead_s3 = {"type": "s3", "endpoint": f"http://127.0.0.1:{free_port()}", "bucket": "nope",
               "create_bucket": True}
    # botocore reads its service models on a process's first client (seconds on a loaded
    # machine); the hang detector below measures the store's open, not that one-time load.
    boto3.session.Session().client("s3", region_name="us-east-1")
    s = bounded(build, namespace, cpu_tier, dead_redis, dead_s3)
    assert exercise(s, [b"k" * 32], [b"v"]) == [b"v"]
    s.close()
    with pytest.raises(ValueError, match="password_env"):
        build(namespace, dict(dead_redis, password_env="KVPOOL_TEST_UNSET_VARIABLE"))
