"""Redis tier: redis-py (hiredis parser) over a bounded, blocking connection pool.

Writes are pipelined SETs (with EX when ttl_seconds is set) whose values are sent straight
from the header and the payload buffers (no joining copy), reads pipelined MGETs,
presence checks pipelined EXISTS; batches are cut at batch_bytes so one pipeline never
holds the server for long, and deletes use UNLINK (freed off the main thread).
Key names: <key_prefix><namespace>:<key hex>. Password from password_env/password_file
only; rediss:// enables TLS. redis-py's own retries are off: the orchestrator decides.
"""

from __future__ import annotations

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ..format import Record
from .base import Tier, secret

_MGET_KEYS = 8
_JOIN_BELOW = 64 * 1024


class RedisTier(Tier):
    type = "redis"
    remote = True
    needs_blob = False

    def __init__(self, cfg, namespace, stats, timeout: float = 0.5) -> None:
        super().__init__(cfg, namespace, stats)
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

    def name(self, key: bytes) -> bytes:
        return self.prefix + key.hex().encode()

    def _packed_set(self, rec: Record) -> list:
        """SET name header+payload [EX ttl] in RESP, the payload sent from the caller's memory.

        redis-py (with hiredis) would copy each value into the packed command, and the value
        would first have to be joined with its header: two copies of every MB-sized chunk
        that sending header and payload as consecutive buffers avoids.
        """
        name, hdr, payload = self.name(rec.key), rec.header(), rec.payload
        extra = [b"EX", str(self.cfg.ttl_seconds).encode()] if self.cfg.ttl_seconds else []
        head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s" % (
            3 + len(extra), len(name), name, len(hdr) + len(payload), hdr)
        tail = b"\r\n" + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in extra)
        if len(payload) < _JOIN_BELOW:
            return [head + payload + tail]
        return [head, payload, tail]

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

    def get_many(self, keys: list[bytes], layout: bytes) -> list[Record | None]:
        values: list = []
        pipe = self.client.pipeline(transaction=False)
        for i in range(0, len(keys), _MGET_KEYS):
            pipe.mget([self.name(k) for k in keys[i:i + _MGET_KEYS]])
        for reply in pipe.execute():
            values.extend(reply)
        return self.verify_all(keys, layout, values)

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        pipe = self.client.pipeline(transaction=False)
        for k in keys:
            pipe.exists(self.name(k))
        return [bool(n) for n in pipe.execute()]

    def delete_many(self, keys: list[bytes]) -> None:
        if keys:
            self.client.unlink(*[self.name(k) for k in keys])

    def close(self) -> None:
        self.pool.disconnect()
