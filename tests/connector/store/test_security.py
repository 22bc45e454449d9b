"""A shared tier is untrusted storage. Whoever can write the directory, the Redis or the
bucket (but lacks the pool key) cannot make the store serve bytes; whoever can read them
cannot tell whose prompt a chunk belongs to, nor (with encryption) read it; a hostile disk
directory cannot redirect or hang the store; a slow tier cannot grow host memory."""

from __future__ import annotations

import functools
import os
import stat
import threading
import time

import pytest
import redis

from kvpool_connector.store import PoolKeyError, open_store
from kvpool_connector.store.format import Record, layout_digest
from kvpool_connector.store.sealing import PoolKey
from tests.conftest import SECURITY, skip_or_fail
from tests.connector.store.helpers import build_store

LAYOUT = b"security-layout"
SHARED = ["disk", "redis", "s3"]


build = functools.partial(build_store, layout=LAYOUT)


def forged(name: bytes, payload: bytes, key: PoolKey, encrypt: bool = False) -> bytes:
    """A well-formed object for `name`, sealed with `key`."""
    rec = Record(name, layout_digest(LAYOUT), memoryview(payload), key=key, encrypt=encrypt)
    return bytes(rec.freeze().blob)


def plant(kind: str, tier: dict, namespace: str, name: bytes, blob: bytes, servers) -> None:
    """Write raw bytes where the tier keeps the object `name` (what an attacker can do)."""
    h = name.hex()
    if kind == "disk":
        d = os.path.join(tier["path"], namespace, h[:2])
        os.makedirs(d, mode=0o700, exist_ok=True)
        with open(os.path.join(d, h + ".kv"), "wb") as f:
            f.write(blob)
    elif kind == "redis":
        r = redis.Redis.from_url(servers["redis"].url, password=servers["redis"].password)
        r.set(f"kvpool:{namespace}:{h}", blob)
        r.close()
    else:
        servers["s3"].client().put_object(Bucket=servers["s3"].bucket,
                                          Key=f"kv/{namespace}/{h}", Body=blob)


@pytest.fixture
def servers(redis_server, s3_server):
    return {"redis": redis_server, "s3": s3_server}


@pytest.mark.parametrize("kind", SHARED)
def test_forged_objects_are_never_served(kind, tier_cfgs, namespace, servers):
    """At the very name the victim's key maps to: an object sealed with another key, a v1
    object with a valid xxh3, and a MAC-less one are all misses, counted as corrupt."""
    s = build(namespace, tier_cfgs[kind])
    key = os.urandom(32)
    name = s.object_names([key])[0]
    attacker = PoolKey(b"the attacker's own key, 32+ chars")
    genuine = forged(name, b"poison" * 1000, s.keyring.current)
    for blob in (forged(name, b"poison" * 1000, attacker),
                 forged(name, b"poison" * 1000, attacker, encrypt=True),
                 genuine[:-16] + bytes(16)):
        plant(kind, tier_cfgs[kind], namespace, name, blob, servers)
        assert s.get_many([key]) == [None]
        plant(kind, tier_cfgs[kind], namespace, name, blob, servers)  # removed: again
        out = bytearray(6000)
        assert s.get_into(key, out) is None and out == bytes(6000)
    st = s.stats()["tiers"][kind]
    assert st["corrupt"] == 6 and st["hits"] == 0
    plant(kind, tier_cfgs[kind], namespace, name, genuine, servers)  # the control
    assert s.get_many([key]) == [b"poison" * 1000]
    s.close()


@pytest.mark.parametrize("encrypt", [False, True], ids=["mac", "aes"])
@pytest.mark.parametrize("kind", SHARED)
def test_a_forged_foreign_layout_header_is_checked_before_it_is_kept(kind, encrypt, tier_cfgs,
                                                                     namespace, servers):
    """An object that claims another KV layout is left in place (another engine of a mixed
    fleet may own it) only once its tag proves a pool member wrote it: a forgery under that
    claim is corrupt and removed, on every shared tier, whether read into a buffer or not."""
    s = build(namespace, tier_cfgs[kind], security={**SECURITY, "encrypt": encrypt})
    key = os.urandom(32)
    name = s.object_names([key])[0]
    attacker = PoolKey(b"the attacker's own key, 32+ chars")

    def foreign(pool_key: PoolKey) -> bytes:
        rec = Record(name, layout_digest(b"another-model"), memoryview(b"poison" * 1000),
                     key=pool_key, encrypt=encrypt)
        return bytes(rec.freeze().blob)

    for read in (lambda: s.get_many([key])[0], lambda: s.get_into(key, bytearray(6000))):
        plant(kind, tier_cfgs[kind], namespace, name, foreign(attacker), servers)
        assert read() is None
        assert _exists(kind, tier_cfgs[kind], namespace, name, servers) is False
    st = s.stats()["tiers"][kind]
    assert (st["corrupt"], st["foreign_layout"]) == (2, 0)
    plant(kind, tier_cfgs[kind], namespace, name, foreign(s.keyring.current), servers)
    assert s.get_into(key, bytearray(6000)) is None  # the genuine one: a miss, kept, counted
    assert _exists(kind, tier_cfgs[kind], namespace, name, servers) is True
    assert s.stats()["tiers"][kind]["foreign_layout"] == 1
    s.close()


def _exists(kind, tier, namespace, name, servers) -> bool:
    try:
        return bool(_read_raw(kind, tier, namespace, name, servers))
    except (FileNotFoundError, servers["s3"].client().exceptions.NoSuchKey):
        return False


@pytest.mark.parametrize("kind", SHARED)
def test_encrypted_objects_hide_the_payload_and_any_tamper_is_a_miss(kind, tier_cfgs, namespace,
                                                                      servers, tmp_path):
    enc = {**SECURITY, "encrypt": True}
    s = build(namespace, tier_cfgs[kind], security=enc)
    key, secret_kv = os.urandom(32), b"PROMPT-DERIVED-KV " * 5000
    s.put_many([key], [secret_kv])
    assert s.flush(10)
    name = s.object_names([key])[0]
    raw = _read_raw(kind, tier_cfgs[kind], namespace, name, servers)
    assert b"PROMPT-DERIVED-KV" not in raw and len(raw) == len(secret_kv) + 48 + 32 + 16
    assert bytes(s.get(key)) == secret_kv
    for pos in (5, 40, 60, len(raw) // 2, len(raw) - 1):  # flags, salt, name, body, tag
        bad = bytearray(raw)
        bad[pos] ^= 0x01
        plant(kind, tier_cfgs[kind], namespace, name, bytes(bad), servers)
        assert s.get_many([key]) == [None], pos
    s.close()
    other = build(namespace, tier_cfgs[kind],
                  security={"key_env": "OTHER_POOL_KEY", "encrypt": True})
    plant(kind, tier_cfgs[kind], namespace, name, raw, servers)
    # another pool's key: other names, and not even the right name would decrypt
    assert other.get_many([key]) == [None]
    assert other.runners[0].tier.get_many([name], layout_digest(LAYOUT),
                                          other.keyring.current) == [None]
    other.close()


@pytest.mark.parametrize("kind", ["redis", "s3"])
def test_after_encryption_is_turned_on_plaintext_is_promoted_encrypted(kind, tier_cfgs,
                                                                       namespace, servers,
                                                                       tmp_path):
    """An object written before `encrypt: true` (MAC only) is still served, but the copy a
    hit promotes into a faster shared tier is encrypted, not the plaintext again."""
    secret_kv = b"PROMPT-DERIVED-KV " * 5000
    key = os.urandom(32)
    before = build(namespace, tier_cfgs[kind])
    before.put_many([key], [secret_kv])
    assert before.flush(10)
    before.close()
    disk = _disk(tmp_path)
    s = build(namespace, disk, tier_cfgs[kind], security={**SECURITY, "encrypt": True})
    assert bytes(s.get(key)) == secret_kv
    assert s.flush(10)
    name = s.object_names([key])[0]
    promoted = _read_raw("disk", disk, namespace, name, servers)
    assert b"PROMPT-DERIVED-KV" not in promoted and promoted[5] & 1  # the flags' encrypted bit
    assert s.stats()["tiers"][kind]["promotions"] == 1
    s.close()


@pytest.mark.parametrize("kind", SHARED)
def test_refuse_plaintext_makes_pre_encryption_objects_misses(kind, tier_cfgs, namespace,
                                                               servers):
    """`security.refuse_plaintext`: once every engine encrypts, MAC-only objects left from
    before are misses (counted as rejected, left to age out), never served."""
    keys, vals = [os.urandom(32) for _ in range(2)], [os.urandom(20_000) for _ in range(2)]
    plain = build(namespace, tier_cfgs[kind])
    plain.put_many(keys[:1], vals[:1])
    assert plain.flush(10)
    plain.close()
    strict = build(namespace, tier_cfgs[kind],
                   security={**SECURITY, "encrypt": True, "refuse_plaintext": True})
    strict.put_many(keys[1:], vals[1:])
    assert strict.flush(10)
    assert strict.get_many(keys)[0] is None
    out = bytearray(b"\xee" * 20_000)
    assert strict.get_into(keys[0], out) is None and out == bytes(20_000)  # nothing of it left
    assert bytes(strict.get_many(keys)[1]) == vals[1]  # its own (encrypted) objects: hits
    st = strict.stats()["tiers"][kind]
    assert st["rejected"] == 3 and st["corrupt"] == 0
    strict.close()
    with pytest.raises(ValueError, match="refuse_plaintext: needs encrypt: true"):
        build(namespace, tier_cfgs[kind], security={**SECURITY, "refuse_plaintext": True})


@pytest.fixture(autouse=True)
def _other_pool_key(monkeypatch):
    monkeypatch.setenv("OTHER_POOL_KEY", "another pool's key with enough characters")


def _read_raw(kind, tier, namespace, name, servers) -> bytes:
    h = name.hex()
    if kind == "disk":
        with open(os.path.join(tier["path"], namespace, h[:2], h + ".kv"), "rb") as f:
            return f.read()
    if kind == "redis":
        r = redis.Redis.from_url(servers["redis"].url, password=servers["redis"].password)
        try:
            return r.get(f"kvpool:{namespace}:{h}")
        finally:
            r.close()
    obj = servers["s3"].client().get_object(Bucket=servers["s3"].bucket, Key=f"kv/{namespace}/{h}")
    return obj["Body"].read()


@pytest.mark.parametrize("kind", SHARED)
def test_key_rotation_never_reseals_what_the_previous_key_signed(kind, tier_cfgs, namespace,
                                                                  servers, monkeypatch):
    """Routine rotation: objects under the previous key stay readable while it is configured
    (then from the process's own cpu tier), but are never sealed again under the new key into
    a shared tier. So whatever the holder of a leaked old key forged is a miss once the
    previous key is removed, like every other old object."""
    monkeypatch.setenv("KEY_OLD", "o" * 40)
    monkeypatch.setenv("KEY_NEW", "n" * 40)
    keys, vals = [os.urandom(32) for _ in range(3)], [os.urandom(50_000) for _ in range(2)]
    old = build(namespace, tier_cfgs[kind], security={"key_env": "KEY_OLD"})
    old.put_many(keys[:2], vals)
    assert old.flush(10)
    poison = b"forged with the leaked old key" * 1000
    name = old.object_names(keys[2:])[0]
    plant(kind, tier_cfgs[kind], namespace, name, forged(name, poison, old.keyring.current),
          servers)
    old.close()
    new_only = build(namespace, tier_cfgs[kind], security={"key_env": "KEY_NEW"})
    assert new_only.get_many(keys) == [None] * 3  # another key: nothing to see
    new_only.close()
    rotating = build(namespace, tier_cfgs["cpu"], tier_cfgs[kind], security={
        "key_env": "KEY_NEW", "previous_key_env": "KEY_OLD"})
    assert rotating.contains_prefix(keys) == 3
    assert [bytes(v) for v in rotating.get_many(keys[:2])] == vals
    out = bytearray(len(poison))
    assert rotating.get_into(keys[2], out) == len(poison)  # served during the rotation ...
    assert [bytes(v) for v in rotating.get_many(keys)] == vals + [poison]
    assert rotating.stats()["tiers"]["cpu"]["hits"] == 3  # ... from this process's own copy
    assert rotating.flush(10)
    rotating.close()
    after = build(namespace, tier_cfgs[kind], security={"key_env": "KEY_NEW"})
    assert after.get_many(keys) == [None] * 3  # nothing was sealed under the new key
    after.close()


def test_a_shared_tier_needs_a_pool_key_of_32_characters(tmp_path, monkeypatch):
    disk = {"type": "disk", "path": str(tmp_path), "size": "1Mi"}
    with pytest.raises(PoolKeyError, match="security.key_env or security.key_file"):
        open_store({"tiers": [disk]})
    monkeypatch.setenv("SHORT_KEY", "too short")
    with pytest.raises(PoolKeyError, match="at least 32 characters"):
        open_store({"tiers": [disk], "security": {"key_env": "SHORT_KEY"}})
    with pytest.raises(ValueError, match="environment variable UNSET_KEY is not set"):
        open_store({"tiers": [disk], "security": {"key_env": "UNSET_KEY"}})
    key_file = tmp_path / "key"
    key_file.write_text("f" * 40 + "\n")
    s = open_store({"tiers": [disk], "security": {"key_file": str(key_file),
                                                  "previous_key_file": str(tmp_path / "none")}})
    s.put_many([b"k" * 32], [b"v"])
    assert s.get_many([b"k" * 32]) == [b"v"]
    s.close()
    cpu_only = open_store({"tiers": [{"type": "cpu", "size": "1Mi"}]})  # in-process: no key
    cpu_only.close()


def test_names_are_unlinkable_without_the_key(tier_cfgs, namespace, monkeypatch):
    """Two pools (keys) store the same chunk key under unrelated names; neither is the key."""
    monkeypatch.setenv("KEY_B", "b" * 40)
    a = build(namespace, tier_cfgs["cpu"])
    b = build(namespace, tier_cfgs["cpu"], security={"key_env": "KEY_B"})
    key = os.urandom(32)
    na, nb = a.object_names([key])[0], b.object_names([key])[0]
    assert na != nb and key not in (na, nb) and key.hex()[:8] not in na.hex() + nb.hex()
    a.close()
    b.close()


# -- the disk tier in a hostile directory --------------------------------------------------


def _disk(tmp_path, **kw) -> dict:
    return {"type": "disk", "path": str(tmp_path / "disk"), "size": "64Mi", "rescan_seconds": 0,
            **kw}


@pytest.mark.parametrize("encrypt", [False, True], ids=["mac", "aes"])
def test_large_objects_checked_piece_by_piece_are_all_or_nothing(tmp_path, namespace, encrypt):
    """Objects of several 512 KiB read pieces, written in a batch (sealed side by side on
    the CPU pool): each reads back exactly; a flipped bit in any piece or the tag, or a
    truncated file, is a miss that leaves the caller's buffer zeroed."""
    s = build(namespace, _disk(tmp_path), security={**SECURITY, "encrypt": encrypt})
    keys = [os.urandom(32) for _ in range(4)]
    payloads = [os.urandom((3 << 19) + 7 * i) for i in range(4)]  # 1.5 MiB + a partial piece
    s.put_many(keys, payloads)
    outs = [bytearray(2 << 20) for _ in keys]
    got = s.get_many_into(keys, outs)
    assert all(g is not None for g in got)
    assert [bytes(o[:len(p)]) for o, p in zip(outs, payloads, strict=True)] == payloads
    name = s.object_names(keys[:1])[0]
    raw = _read_raw("disk", _disk(tmp_path), namespace, name, {})
    body = len(raw) - 16 - len(payloads[0])
    for pos in (body + 1, body + (512 << 10) + 3, len(raw) - 17, len(raw) - 1):
        bad = bytearray(raw)
        bad[pos] ^= 0x01
        plant("disk", _disk(tmp_path), namespace, name, bytes(bad), {})
        out = bytearray(b"\xff" * (2 << 20))
        assert s.get_into(keys[0], out) is None, pos
        assert out[:len(payloads[0])] == bytes(len(payloads[0])), pos  # nothing unverified left
    plant("disk", _disk(tmp_path), namespace, name, raw[:len(raw) // 2], {})
    assert s.get_into(keys[0], bytearray(2 << 20)) is None
    assert s.stats()["tiers"]["disk"]["corrupt"] == 5
    s.close()


@pytest.mark.parametrize("encrypt", [False, True], ids=["mac", "aes"])
def test_a_batch_sealed_side_by_side_reaches_every_lower_tier_intact(tmp_path, namespace,
                                                                      encrypt):
    sec = {**SECURITY, "encrypt": encrypt}
    s = build(namespace, {"type": "cpu", "size": "64Mi"}, _disk(tmp_path), security=sec)
    keys = [os.urandom(32) for _ in range(6)]
    payloads = [os.urandom(1 << 20) for _ in keys]
    s.put_many(keys, payloads)
    assert s.flush(10)
    s.close()
    disk_only = build(namespace, _disk(tmp_path), security=sec)  # what the lower tier holds
    assert [bytes(p) for p in disk_only.get_many(keys)] == payloads
    disk_only.close()


def test_files_and_directories_are_private(tmp_path, namespace):
    s = build(namespace, _disk(tmp_path))
    s.put_many([os.urandom(32) for _ in range(4)], [b"x" * 1000] * 4)
    root = tmp_path / "disk" / namespace
    dirs = [root, root / ".tmp", *[p for p in root.iterdir() if p.name != ".tmp"]]
    assert all(stat.S_IMODE(d.stat().st_mode) == 0o700 for d in dirs)
    files = list(root.rglob("*.kv"))
    assert len(files) == 4 and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    assert not os.listdir(root / ".tmp")
    s.close()


def test_symlink_at_an_object_path_is_a_miss_and_is_removed(tmp_path, namespace):
    """A link pointing at a genuine object elsewhere (or at /etc/shadow) is never followed."""
    s = build(namespace, _disk(tmp_path))
    key, decoy = os.urandom(32), os.urandom(32)
    s.put_many([decoy], [b"decoy-kv" * 100])
    name, decoy_name = s.object_names([key, decoy])
    tier = s.runners[0].tier
    os.makedirs(os.path.dirname(tier.path(name)), mode=0o700, exist_ok=True)
    os.symlink(tier.path(decoy_name), tier.path(name))
    assert s.contains_prefix([key]) == 0
    assert s.get_many([key]) == [None]
    assert not os.path.lexists(tier.path(name))
    assert s.stats()["tiers"]["disk"]["rejected"] == 1
    assert s.get_many([decoy]) == [b"decoy-kv" * 100]  # the link's target is untouched
    s.close()


def test_fifo_at_an_object_path_costs_a_miss_not_a_hang(tmp_path, namespace):
    s = build(namespace, _disk(tmp_path), timeout_seconds=1.0)
    key = os.urandom(32)
    path = s.runners[0].tier.path(s.object_names([key])[0])
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    os.mkfifo(path)
    t0 = time.monotonic()
    assert s.get_many([key]) == [None]
    assert s.get_into(key, bytearray(100)) is None
    assert time.monotonic() - t0 < 1.0
    assert not os.path.lexists(path)
    s.close()


def test_symlinked_temp_or_namespace_directory_is_refused(tmp_path, namespace):
    """Someone who could write the tier's parent directory replaced a directory the store
    writes into with a link (to redirect its files): the store refuses to start there."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (tmp_path / "disk").mkdir()
    os.symlink(elsewhere, tmp_path / "disk" / namespace)
    with pytest.raises(ValueError, match="not a real directory"):
        build(namespace, _disk(tmp_path))
    os.unlink(tmp_path / "disk" / namespace)
    (tmp_path / "disk" / namespace).mkdir(mode=0o700)
    os.symlink(elsewhere, tmp_path / "disk" / namespace / ".tmp")
    with pytest.raises(ValueError, match="not a real directory"):
        build(namespace, _disk(tmp_path))
    assert not os.listdir(elsewhere)


def test_directory_owned_by_someone_else_is_refused(tmp_path, namespace):
    if os.geteuid() != 0:
        skip_or_fail("needs root to create a directory owned by another user")
    root = tmp_path / "disk" / namespace
    root.mkdir(parents=True, mode=0o700)
    os.chown(root, 4242, 4242)
    with pytest.raises(ValueError, match="owned by uid 4242"):
        build(namespace, _disk(tmp_path))


def test_a_hung_disk_read_costs_a_miss_within_the_bound_and_never_writes_late(
        tmp_path, namespace, monkeypatch, reads_finished):
    """A read stuck in the kernel (a hung NFS mount, emulated by a pread that blocks) is
    given up at the store's deadline; when it finally returns, it writes nothing into the
    caller's buffer, which the caller may have reused by then."""
    from kvpool_connector.store.tiers import disk as disk_mod

    s = build(namespace, _disk(tmp_path), timeout_seconds=0.5)
    key = os.urandom(32)
    s.put_many([key], [b"k" * 100_000])
    release = threading.Event()
    real_preadv = os.preadv

    def hung_preadv(fd, bufs, off):
        release.wait(30)  # the mount comes back much later
        return real_preadv(fd, bufs, off)

    finished = reads_finished(s.runners[0].tier)
    monkeypatch.setattr(disk_mod.os, "preadv", hung_preadv)
    out = bytearray(b"\xee" * 100_000)
    t0 = time.monotonic()
    assert s.get_into(key, out) is None
    assert time.monotonic() - t0 < 1.5
    assert out == bytes(100_000)  # a cut-off read leaves no byte of anything behind
    out[:] = b"\xdd" * 100_000  # the caller reuses its buffer
    release.set()
    assert finished.wait(30)  # the stuck read ran to its end ...
    assert out == b"\xdd" * 100_000  # ... and wrote nothing into the caller's buffer
    monkeypatch.setattr(disk_mod.os, "preadv", real_preadv)
    assert s.runners[0].stats.snapshot()["timeouts"] == 1
    s.close()


# -- bounded reads and bounded memory -----------------------------------------------------


def test_oversized_redis_value_is_refused_without_reading_it(redis_tier, namespace, redis_server):
    s = build(namespace, redis_tier)
    key = os.urandom(32)
    name = s.object_names([key])[0]
    r = redis.Redis.from_url(redis_server.url, password=redis_server.password)
    r.set(f"kvpool:{namespace}:{name.hex()}", b"\0" * (64 << 20))  # 64 MiB of flood
    sent_before = r.info("stats")["total_net_output_bytes"]
    assert s.get_into(key, bytearray(1 << 20)) is None  # a reader of 1 MiB chunks
    sent = r.info("stats")["total_net_output_bytes"] - sent_before
    assert sent < 2 << 20, sent
    assert s.stats()["tiers"]["redis"]["rejected"] == 1
    r.close()
    s.close()


def test_oversized_s3_object_is_refused_without_reading_it(s3_tier, namespace, s3_server):
    s = build(namespace, s3_tier)
    key = os.urandom(32)
    name = s.object_names([key])[0]
    s3_server.client().put_object(Bucket=s3_server.bucket, Key=f"kv/{namespace}/{name.hex()}",
                                  Body=b"\0" * (32 << 20))
    lengths = []
    s.runners[0].tier.client.meta.events.register(
        "after-call.s3.GetObject",
        lambda http_response, **kw: lengths.append(int(http_response.headers["content-length"])))
    assert s.get_into(key, bytearray(1 << 20)) is None
    assert lengths and max(lengths) <= (1 << 20) + 200
    assert s.stats()["tiers"]["s3"]["rejected"] == 1
    s.close()


def test_a_slow_tier_keeps_host_memory_bounded(s3_tier, namespace):
    """A steady write load far faster than the lower tier (S3 here) absorbs: its queue holds
    at most queue_bytes, the rest is dropped and counted, and resident memory stays flat."""
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    s = build(namespace, {"type": "cpu", "size": "16Mi"}, {**s3_tier, "queue_size": 100_000},
              queue_bytes="8Mi", metrics=False)
    payload = os.urandom(1 << 20)
    for _ in range(20):  # warm up: the queue fills
        s.put_many([os.urandom(32)], [payload])
    before, peak = rss(), 0
    for _ in range(300):
        s.put_many([os.urandom(32)], [payload])
        peak = max(peak, s.stats()["tiers"]["s3"]["queue_bytes"])
    grown = rss() - before
    st = s.stats()["tiers"]["s3"]
    assert 0 < peak <= 8 << 20 and st["drops"] >= 100 and st["errors"] == 0
    assert grown < 64 << 20, grown  # 300 MiB went through put_many
    assert s.flush(30)
    s.close()


def test_a_tier_without_tls_verification_is_logged_as_such(namespace, caplog):
    """Turning certificate checks off is allowed (private CAs without a bundle) but never
    silent: opening the store logs one warning per such tier, naming it and the key."""
    redis_insecure = {"type": "redis", "url": "rediss://redis.invalid:6380/0",
                      "tls_insecure": True, "name": "shared"}
    s3_unverified = {"type": "s3", "endpoint": "https://s3.invalid", "bucket": "kvp",
                     "verify_tls": False}
    verified = [{"type": "redis", "url": "rediss://redis.invalid:6380/0"},
                {"type": "s3", "endpoint": "https://s3.invalid", "bucket": "kvp"},
                {"type": "redis", "url": "redis://redis.invalid:6379/0", "tls_insecure": True}]
    cpu = {"type": "cpu", "size": "1Mi"}
    with caplog.at_level("WARNING", logger="kvpool.store"):
        build_store(namespace, cpu, *verified).close()
        assert not [r for r in caplog.records if "TLS" in r.getMessage()]
        build_store(namespace, cpu, redis_insecure, s3_unverified).close()
    lines = [r.getMessage() for r in caplog.records if "TLS" in r.getMessage()]
    assert len(lines) == 2, lines
    assert lines[0].startswith("tier shared: TLS certificate verification is off "
                               "(tls_insecure: true)")
    assert lines[1].startswith("tier s3: TLS certificate verification is off "
                               "(verify_tls: false)")
