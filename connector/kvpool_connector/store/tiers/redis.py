"""Redis tier: redis-py (hiredis parser) over a bounded, blocking connection pool.

Writes are pipelined SETs (with EX when ttl_seconds is set), reads pipelined MGETs,
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


class RedisTier(Tier):
    type = "redis"
    remote = True

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

    def put_many(self, records: list[Record]) -> None:
        ttl = self.cfg.ttl_seconds
        limit = self.cfg.batch_bytes
        pipe, pending, nbytes = self.client.pipeline(transaction=False), 0, 0
        for rec in records:
            blob = rec.freeze().blob
            pipe.set(self.name(rec.key), blob, ex=ttl)
            pending += len(blob)
            nbytes += len(rec.payload)
            if pending >= limit:
                pipe.execute()
                pipe, pending = self.client.pipeline(transaction=False), 0
        if len(pipe):
            pipe.execute()
        self.stats.inc("bytes_in", nbytes)

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
