"""Redis tier: redis-py (hiredis parser) over a bounded, blocking connection pool.

Writes are pipelined SETs (with EX when ttl_seconds is set) whose values are sent straight
from the sealed object's header, payload and tag buffers (no joining copy); reads are
pipelined GETRANGEs bounded by the size the reader can accept, so an oversized value (a
flooding attacker, another pool's giant object) is refused after reading at most one byte
more than fits, never read whole; presence checks are pipelined EXISTS; batches are cut at
batch_bytes so one pipeline never holds the server for long, and deletes use UNLINK. Those
four commands (plus connection setup) are all an ACL user for the engines needs.
Names: <key_prefix><namespace>:<object name hex>. Password from password_env/password_file
only; rediss:// enables TLS. redis-py's own retries are off: the orchestrator decides.
"""

from __future__ import annotations

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ..format import Record
from ..sealing import PoolKey
from .base import Tier, secret

_JOIN_BELOW = 64 * 1024


class RedisTier(Tier):
    type = "redis"
    remote = True
    blocking = True
    needs_blob = False

    def __init__(self, cfg, namespace, stats, **kw) -> None:
        super().__init__(cfg, namespace, stats, **kw)
        timeout = self.timeout
        self.prefix = f"{cfg.key_prefix}{namespace}:".encode()
        kwargs = dict(
            password=secret(cfg.password_env, cfg.password_file, "password"),
            username=cfg.username,
            max_connections=cfg.max_connections,
            timeout=timeout,  # waiting for a free pooled connection
            socket_timeout=max(timeout, 1.0),
            socket_connect_timeout=timeout,
            socket_keepalive=True,
        )
        if cfg.url.startswith("rediss://"):
            if cfg.tls_ca_file:
                kwargs["ssl_ca_certs"] = cfg.tls_ca_file
            if cfg.tls_insecure:
                kwargs["ssl_cert_reqs"] = "none"
                kwargs["ssl_check_hostname"] = False
        self.pool = redis.BlockingConnectionPool.from_url(cfg.url, **kwargs)
        self.client = redis.Redis(connection_pool=self.pool, retry=Retry(NoBackoff(), 0))

    def object_key(self, name: bytes) -> bytes:
        """The Redis key of an object."""
        return self.prefix + name.hex().encode()

    def _packed_set(self, rec: Record) -> list:
        """SET key header+payload+tag [EX ttl] in RESP, the payload sent from its own memory.

        redis-py (with hiredis) would copy each value into the packed command, and the value
        would first have to be joined with its header: two copies of every MB-sized chunk
        that sending the parts as consecutive buffers avoids.
        """
        hdr, body, tag = rec.parts()
        name = self.object_key(rec.name)
        extra = [b"EX", str(self.cfg.ttl_seconds).encode()] if self.cfg.ttl_seconds else []
        head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s" % (
            3 + len(extra), len(name), name, len(hdr) + len(body) + len(tag), hdr)
        tail = tag + b"\r\n" + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in extra)
        if len(body) < _JOIN_BELOW:
            return [head + bytes(body) + tail]
        return [head, body, tail]

    def put_many(self, records: list[Record]) -> None:
        conn = self.pool.get_connection()
        try:
            i = 0
            while i < len(records):  # one pipeline per batch_bytes
                batch, nbytes = [], 0
                while i < len(records) and (not batch or nbytes < self.cfg.batch_bytes):
                    batch.append(records[i])
                    nbytes += len(records[i].payload)
                    i += 1
                conn.send_packed_command([p for rec in batch for p in self._packed_set(rec)])
                for _ in batch:
                    conn.read_response()  # raises on an error reply
        except BaseException:
            conn.disconnect()  # replies may be left unread: never reuse this connection
            raise
        finally:
            self.pool.release(conn)
        self.stats.inc("bytes_in", sum(len(r.payload) for r in records))

    def _fetch(self, names: list[bytes], outs: list[memoryview | None]) -> list:
        """Values, each read up to one byte past the largest object the reader accepts;
        longer ones are refused (counted) and never read further."""
        pipe = self.client.pipeline(transaction=False)
        limits = [self.read_limit(n, o) for n, o in zip(names, outs)]
        for name, limit in zip(names, limits):
            pipe.getrange(self.object_key(name), 0, limit)  # limit + 1 bytes at most
        values = []
        for v, limit in zip(pipe.execute(), limits):
            if v is not None and len(v) > limit:
                self.stats.inc("rejected")
                v = None
            values.append(v or None)  # GETRANGE of a missing key is b""
        return values

    def get_many(self, names: list[bytes], layout: bytes, key: PoolKey) -> list[Record | None]:
        return self.verify_all(names, layout, key, self._fetch(names, [None] * len(names)))

    def get_many_into(self, names: list[bytes], layout: bytes, key: PoolKey,
                      outs: list[memoryview]) -> list[Record | None]:
        return self.verify_all(names, layout, key, self._fetch(names, outs), outs)

    def contains_many(self, names: list[bytes]) -> list[bool]:
        pipe = self.client.pipeline(transaction=False)
        for k in names:
            pipe.exists(self.object_key(k))
        return [bool(n) for n in pipe.execute()]

    def delete_many(self, names: list[bytes]) -> None:
        if names:
            self.client.unlink(*[self.object_key(k) for k in names])

    def close(self) -> None:
        self.pool.disconnect()
