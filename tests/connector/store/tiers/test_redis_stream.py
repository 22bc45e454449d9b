"""The Redis tier's reads into caller buffers take GETRANGE replies off the socket by hand
(payloads straight into the caller's memory, checked piece by piece). Against a real
redis-server: every kind of reply in one pipeline keeps the connection in step, a value
that fails its check leaves no byte behind, and a server stalling in the middle of a value
costs a miss at the deadline without a single late write into the caller's buffer."""

from __future__ import annotations

import os
import threading
import time

import pytest
import redis

from kvpool_connector.store.format import Record, layout_digest
from kvpool_connector.store.sealing import PoolKey
from tests.conftest import SECURITY
from tests.connector.loopback import LoopbackServer, StallingProxy
from tests.connector.store.helpers import build_store

LAYOUT = b"stream-layout"
BIG = 3 * (256 << 10) + 12345  # several pieces, the last one partial


def build(namespace, tier, encrypt=False, timeout=5.0):
    return build_store(namespace, tier, layout=LAYOUT, timeout=timeout,
                       security={**SECURITY, "encrypt": encrypt})


def redis_key(namespace: str, name: bytes) -> str:
    return f"kvpool:{namespace}:{name.hex()}"


@pytest.mark.parametrize("encrypt", [False, True], ids=["mac", "aes"])
def test_every_kind_of_reply_in_one_pipeline_keeps_the_connection_in_step(
        encrypt, redis_tier, redis_server, namespace):
    s = build(namespace, redis_tier, encrypt)
    keys = [os.urandom(32) for _ in range(8)]
    good = {0: os.urandom(BIG), 3: os.urandom(100), 7: os.urandom(BIG)}
    s.put_many([keys[i] for i in good] + [keys[1]], list(good.values()) + [os.urandom(BIG)])
    names = s.object_names(keys)
    r = redis.Redis.from_url(redis_server.url, password=redis_server.password)
    # 1: one flipped payload byte; 2: a valid object of another layout (authentic, not ours);
    # 4: sealed with another pool's key; 5: empty value; 6: absent
    flipped = bytearray(r.get(redis_key(namespace, names[1])))
    flipped[-1000] ^= 1  # late in the payload: the pieces before it already landed
    r.set(redis_key(namespace, names[1]), bytes(flipped))
    other = Record(names[2], layout_digest(b"another-model"), memoryview(os.urandom(BIG)),
                   key=s.keyring.current, encrypt=encrypt)
    r.set(redis_key(namespace, names[2]), bytes(other.freeze().blob))
    stranger = Record(names[4], layout_digest(LAYOUT), memoryview(os.urandom(BIG)),
                      key=PoolKey(os.urandom(32)), encrypt=encrypt)
    r.set(redis_key(namespace, names[4]), bytes(stranger.freeze().blob))
    r.set(redis_key(namespace, names[5]), b"")

    outs = [bytearray(b"\xee" * BIG) for _ in keys]
    got = s.get_many_into(keys, outs)
    assert got == [BIG, None, None, 100, None, None, None, BIG]
    assert bytes(outs[0]) == good[0] and bytes(outs[7]) == good[7]
    assert bytes(outs[3][:100]) == good[3]
    for i in (1, 2, 4):  # checked in place and failed: nothing of them stays behind
        assert outs[i] == bytes(BIG), i
    for i in (5, 6):  # nothing was read: untouched
        assert outs[i] == b"\xee" * BIG, i
    stats = s.stats()["tiers"]["redis"]
    assert stats["corrupt"] == 2 and stats["foreign_layout"] == 1 and stats["errors"] == 0
    assert stats["bytes_out"] == 2 * BIG + 100
    # the corrupt objects were removed, the foreign one left for its owner
    assert r.exists(redis_key(namespace, names[1]), redis_key(namespace, names[4])) == 0
    assert r.exists(redis_key(namespace, names[2])) == 1
    # the same pooled connections serve the next pipeline correctly
    again = [bytearray(BIG) for _ in keys]
    assert s.get_many_into(keys, again) == [BIG, None, None, 100, None, None, None, BIG]
    assert bytes(again[7]) == good[7] and s.stats()["tiers"]["redis"]["errors"] == 0
    r.close()
    s.close()


def test_an_error_reply_fails_the_read_and_the_next_one_succeeds(redis_tier, redis_server,
                                                                 namespace):
    """A key of the wrong type answers GETRANGE with an error reply in the middle of the
    pipeline: the call fails (counted), the connection stays usable."""
    s = build(namespace, redis_tier)
    keys = [os.urandom(32) for _ in range(3)]
    vals = [os.urandom(BIG) for _ in keys]
    s.put_many(keys, vals)
    r = redis.Redis.from_url(redis_server.url, password=redis_server.password)
    wrong = redis_key(namespace, s.object_names([keys[1]])[0])
    r.delete(wrong)
    r.rpush(wrong, b"x")
    outs = [bytearray(BIG) for _ in keys]
    assert s.get_many_into(keys, outs) == [None, None, None]
    assert all(o == bytes(BIG) for o in outs)  # a failed call leaves nothing behind
    assert s.stats()["tiers"]["redis"]["errors"] == 1
    r.delete(wrong)
    s2 = build(namespace, redis_tier)  # a fresh store: no backoff after the failure
    s2.put_many([keys[1]], [vals[1]])
    outs = [bytearray(BIG) for _ in keys]
    assert s2.get_many_into(keys, outs) == [BIG] * 3
    assert [bytes(o) for o in outs] == vals
    r.close()
    s.close()
    s2.close()


def test_a_server_stalling_mid_value_costs_a_miss_and_never_writes_late(
        redis_tier, redis_server, namespace, reads_finished):
    proxy = StallingProxy(redis_server.port)
    tier = {**redis_tier, "url": f"redis://127.0.0.1:{proxy.port}/0"}
    key, val = os.urandom(32), os.urandom(BIG)
    writer = build(namespace, tier)  # a generous bound: the object must be there
    writer.put_many([key], [val])
    assert writer.stats()["tiers"]["redis"]["bytes_in"] == BIG
    writer.close()
    s = build(namespace, tier, timeout=0.5)
    finished = reads_finished(s.runners[0].tier)
    proxy.budget = 300_000  # the header and the first piece of the payload, then a stall
    out = bytearray(b"\xee" * BIG)
    t0 = time.monotonic()
    assert s.get_into(key, out) is None
    assert time.monotonic() - t0 < 2.5  # a hang detector: the bound is 0.5 s
    assert out == bytes(BIG)  # the pieces received before the deadline were wiped
    out[:] = b"\xdd" * BIG  # the caller reuses its buffer
    proxy.budget = None
    proxy.released.set()
    assert finished.wait(30)  # the stalled read went on once the server did ...
    assert out == b"\xdd" * BIG  # ... and wrote nothing more into the caller's buffer
    assert s.stats()["tiers"]["redis"]["timeouts"] == 1
    s.close()
    s2 = build(namespace, tier)  # the server answers again: a hit, bit for bit
    out2 = bytearray(BIG)
    assert s2.get_into(key, out2) == BIG and bytes(out2) == val
    s2.close()
    proxy.close()


class HostileRedis(LoopbackServer):
    """A loopback TCP (or TLS) server that speaks just enough RESP for redis-py to connect,
    then answers the first GETRANGE with `mode`: an endless first line, a bulk length far
    beyond what was asked followed by an endless value, a value dripping one byte every
    50 ms, or nothing at all. `closed` is set once the client drops the connection, which
    is how the test sees that the tier's thread stopped reading."""

    def __init__(self, mode: str, tls_dir=None) -> None:
        self.mode = mode
        self.ctx = None
        if tls_dir is not None:
            import ssl

            from tests.conftest import self_signed_cert

            self.cert, key = self_signed_cert(tls_dir)
            self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self.ctx.load_cert_chain(self.cert, key)
        self.answering = threading.Event()  # the hostile reply has started
        self.closed = threading.Event()
        super().__init__()

    def handle(self, conn) -> None:
        buf = b""

        def command() -> list[bytes]:
            nonlocal buf

            def line() -> bytes:
                nonlocal buf
                while b"\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        raise ConnectionError
                    buf += data
                out, buf = buf.split(b"\r\n", 1)
                return out

            args = []
            for _ in range(int(line()[1:])):
                n = int(line()[1:])
                while len(buf) < n + 2:
                    buf += conn.recv(65536)
                args.append(buf[:n])
                buf = buf[n + 2:]
            return args

        try:
            if self.ctx is not None:
                conn = self.ctx.wrap_socket(conn, server_side=True)
            with conn:
                while not self.stop.is_set():
                    if command()[0].upper() != b"GETRANGE":
                        conn.sendall(b"+OK\r\n")  # CLIENT SETINFO and the like
                        continue
                    self.answering.set()
                    self._misbehave(conn)
        except (OSError, ConnectionError, ValueError):
            self.closed.set()

    def _misbehave(self, conn) -> None:
        if self.mode == "stall":
            while conn.recv(65536):  # answers nothing; returns once the client hangs up
                pass
            raise ConnectionError
        if self.mode == "drip":
            conn.sendall(b"$100000\r\n")
        head, body = {"endless-line": (b"$", b"9" * 65536),
                      "huge-bulk": (b"$" + b"9" * 18 + b"\r\n", bytes(65536)),
                      "drip": (b"", b"x")}[self.mode]
        conn.sendall(head)
        while True:  # raises once the client dropped the connection
            conn.sendall(body)
            if self.mode == "drip":
                time.sleep(0.05)


@pytest.mark.parametrize("read", ["into", "whole"])
@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
@pytest.mark.parametrize("mode", ["endless-line", "huge-bulk", "drip", "stall"])
def test_a_hostile_server_costs_a_miss_within_the_bound_and_frees_the_tier(mode, tls, read,
                                                                         tmp_path, namespace):
    """A malicious server (or a man in the middle on plaintext redis://) cannot keep a tier
    thread reading: every exchange has an absolute deadline, a reply's first line is capped
    and a value longer than was asked for drops the connection, on TCP and TLS, for reads
    into the caller's buffer and whole ones alike."""
    server = HostileRedis(mode, tmp_path if tls else None)
    url = f"{'rediss' if tls else 'redis'}://127.0.0.1:{server.port}/0"
    tier = {"type": "redis", "url": url, **({"tls_ca_file": str(server.cert)} if tls else {})}
    s = build(namespace, tier, timeout=0.5)
    # connected first (TLS handshake and all, outside the store's bound on a busy machine):
    # the pooled connection then carries the GETRANGE the server answers with its attack
    s.runners[0].tier.contains_many([os.urandom(32)])
    key = os.urandom(32)
    out = bytearray(b"\xee" * 1000)
    t0 = time.monotonic()
    got = s.get_into(key, out) if read == "into" else s.get_many([key])[0]
    assert got is None and time.monotonic() - t0 < 2.5  # a hang detector: the bound is 0.5 s
    assert server.answering.wait(5)
    assert server.closed.wait(5), "the tier's thread is still reading from the server"
    assert time.monotonic() - t0 < 5
    assert out == b"\xee" * 1000 or out == bytes(1000)  # nothing of the server's bytes
    st = s.stats()["tiers"]["redis"]
    assert st["timeouts"] + st["errors"] == 1 and st["hits"] == 0
    s.close()
    server.close()
