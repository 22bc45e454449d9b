"""Redis tier: redis-py (hiredis parser) over bounded, blocking connection pools; a single
server or a Redis Cluster (`cluster: true`).

Every operation is a pipeline of single-key commands sent on a raw pooled connection:
SETs (with EX when ttl_seconds is set) whose values go out straight from the sealed object's
header, payload and tag buffers (no joining copy); GETRANGEs bounded by the size the reader
can accept, so an oversized value (a flooding attacker, another pool's giant object) is
refused after reading at most one byte more than fits, never read whole; EXISTS for
presence; UNLINK for deletes. Those four commands (plus connection setup) are all an ACL
user for the engines needs. Batches are cut at batch_bytes so one pipeline never holds a
server for long.

Cluster mode: redis-py's cluster client keeps the slot map (it reads CLUSTER SLOTS and
COMMAND when it connects, so a cluster ACL user also needs `+cluster|slots +command`); keys
are grouped by the primary that owns their slot, every node's pipeline is sent before any
reply is read (the nodes work in parallel), and a MOVED reply (a resharding) refreshes the
map and resends those keys once. A failed connection refreshes the map on the next call
(a failover). The client is created on first use, so an engine starts while its cluster is
still down.

Names: <key_prefix><namespace>:<object name hex>. Password from password_env/password_file
only; rediss:// enables TLS. redis-py's own retries are off: the orchestrator decides.
"""

from __future__ import annotations

import threading
from typing import Callable

import redis
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import MovedError, ResponseError
from redis.retry import Retry

from ..format import Record
from ..sealing import PoolKey
from .base import Tier, secret

_JOIN_BELOW = 64 * 1024


def resp(*args: bytes) -> bytes:
    """One command in RESP (what redis-py's packer produces, without a connection)."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


class RedisTier(Tier):
    type = "redis"
    remote = True
    blocking = True
    needs_blob = False

    def __init__(self, cfg, namespace, stats, **kw) -> None:
        super().__init__(cfg, namespace, stats, **kw)
        timeout = self.timeout
        self.prefix = f"{cfg.key_prefix}{namespace}:".encode()
        self._kwargs = dict(
            password=secret(cfg.password_env, cfg.password_file, "password"),
            username=cfg.username,
            max_connections=cfg.max_connections,  # per node in a cluster
            timeout=timeout,  # waiting for a free pooled connection
            socket_timeout=max(timeout, 1.0),
            socket_connect_timeout=timeout,
            socket_keepalive=True,
        )
        if cfg.url.startswith("rediss://"):
            if cfg.tls_ca_file:
                self._kwargs["ssl_ca_certs"] = cfg.tls_ca_file
            if cfg.tls_insecure:
                self._kwargs["ssl_cert_reqs"] = "none"
                self._kwargs["ssl_check_hostname"] = False
        self.pool: redis.BlockingConnectionPool | None = None
        self._cluster: redis.RedisCluster | None = None
        self._cluster_lock = threading.Lock()
        self._refresh = False  # a node failed: re-read the slot map before the next call
        if not cfg.cluster:
            self.pool = redis.BlockingConnectionPool.from_url(cfg.url, **self._kwargs)

    def object_key(self, name: bytes) -> bytes:
        """The Redis key of an object."""
        return self.prefix + name.hex().encode()

    # -- routing ----------------------------------------------------------------------------
    def cluster_client(self) -> redis.RedisCluster:
        with self._cluster_lock:
            if self._cluster is None:
                self._cluster = redis.RedisCluster.from_url(
                    self.cfg.url, connection_pool_class=redis.BlockingConnectionPool,
                    retry=Retry(NoBackoff(), 0), **self._kwargs)
            elif self._refresh:
                self._cluster.nodes_manager.initialize()
            self._refresh = False
            return self._cluster

    def _groups(self, keys: list[bytes], todo: list[int]) -> list[tuple[object, list[int]]]:
        """(connection pool, indices) per server: the one server, or each slot's primary."""
        if self.pool is not None:
            return [(self.pool, todo)]
        rc = self.cluster_client()
        by: dict[str, tuple[object, list[int]]] = {}
        for i in todo:
            node = rc.nodes_manager.get_node_from_slot(key_slot(keys[i]))
            if node.name not in by:
                by[node.name] = (rc.get_redis_connection(node).connection_pool, [])
            by[node.name][1].append(i)
        return list(by.values())

    def _batches(self, idx: list[int], cost: Callable[[int], int] | None) -> list[list[int]]:
        if cost is None:
            return [idx]
        out, cur, nbytes = [], [], 0
        for i in idx:
            if cur and nbytes >= self.cfg.batch_bytes:
                out.append(cur)
                cur, nbytes = [], 0
            cur.append(i)
            nbytes += cost(i)
        return out + ([cur] if cur else [])

    def _round(self, batches: list[tuple[object, list[int]]], command, replies: dict) -> None:
        """Send every batch (one per server), then read every reply; an error reply is kept
        as that key's reply, anything else leaves no connection with replies unread."""
        taken = []
        try:
            for pool, idx in batches:
                conn = pool.get_connection()
                taken.append((pool, conn, idx))
                conn.send_packed_command([p for i in idx for p in command(i)])
            for _, conn, idx in taken:
                for i in idx:
                    try:
                        replies[i] = conn.read_response()
                    except ResponseError as e:  # fully read: the connection stays usable
                        replies[i] = e
        except BaseException:
            for _, conn, _ in taken:
                conn.disconnect()
            self._refresh = self.pool is None
            raise
        finally:
            for pool, conn, _ in taken:
                pool.release(conn)

    def _exchange(self, keys: list[bytes], command: Callable[[int], list],
                  cost: Callable[[int], int] | None = None) -> list:
        """Reply to command(i) for every key i; raises the first error reply."""
        if not keys:
            return []
        replies: dict[int, object] = {}
        todo = list(range(len(keys)))
        for attempt in range(2):
            per_node = [(pool, self._batches(idx, cost)) for pool, idx in self._groups(keys, todo)]
            for r in range(max(len(b) for _, b in per_node)):
                self._round([(pool, b[r]) for pool, b in per_node if r < len(b)], command, replies)
            todo = [i for i in todo if isinstance(replies[i], MovedError)]
            if not todo or self.pool is not None or attempt:
                break
            self._refresh = True  # a resharding moved these slots: new map, resend once
        for i in range(len(keys)):
            if isinstance(replies[i], Exception):
                raise replies[i]
        return [replies[i] for i in range(len(keys))]

    # -- operations ---------------------------------------------------------------------------
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
        keys = [self.object_key(r.name) for r in records]
        self._exchange(keys, lambda i: self._packed_set(records[i]),
                       cost=lambda i: len(records[i].payload))
        self.stats.inc("bytes_in", sum(len(r.payload) for r in records))

    def _fetch(self, names: list[bytes], outs: list[memoryview | None]) -> list:
        """Values, each read up to one byte past the largest object the reader accepts;
        longer ones are refused (counted) and never read further."""
        keys = [self.object_key(n) for n in names]
        limits = [self.read_limit(n, o) for n, o in zip(names, outs)]
        got = self._exchange(  # GETRANGE k 0 limit: limit + 1 bytes at most
            keys, lambda i: [resp(b"GETRANGE", keys[i], b"0", b"%d" % limits[i])])
        values = []
        for v, limit in zip(got, limits):
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
        keys = [self.object_key(n) for n in names]
        return [bool(n) for n in self._exchange(keys, lambda i: [resp(b"EXISTS", keys[i])])]

    def delete_many(self, names: list[bytes]) -> None:
        if names:
            keys = [self.object_key(n) for n in names]
            self._exchange(keys, lambda i: [resp(b"UNLINK", keys[i])])

    def close(self) -> None:
        if self.pool is not None:
            self.pool.disconnect()
        if self._cluster is not None:
            self._cluster.close()
