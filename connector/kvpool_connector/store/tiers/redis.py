"""Redis tier: redis-py's connections (setup, AUTH, TLS) over bounded, blocking connection
pools, replies read by hand; a single server or a Redis Cluster (`cluster: true`).

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

Every reply is taken off the socket (TCP, Unix or TLS) by hand (`ReplyStream`, in
redis_protocol.py), within one absolute deadline per exchange (`socket_timeout`, the larger
of the store's bound and 1 s), with a reply's first line capped and a value longer than was
asked for refused: a hostile server or a man in the middle on plain redis:// costs a dropped
connection and a miss, never a tier thread (hiredis would read an endless line, or a drip-
fed value, for as long as it keeps coming). Reads into the caller's buffers (the connector's
loads) move the payload from the socket straight into the caller's buffer in pieces, each
authenticated while cache-hot (or, encrypted, decrypted from a small scratch buffer into
place), and a failed tag zeroes what was written. redis-py (hiredis) would first assemble
each value in its own growing buffer and then copy it into a new bytes object: two copies
and a fresh multi-MiB allocation per chunk, which on the tier's pool threads (malloc arenas
trimmed after each batch) made a read cost 3x a plain GET.

Names: <key_prefix><namespace>:<object name hex>. Password from password_env/password_file
only; rediss:// enables TLS. redis-py's own retries are off: the orchestrator decides.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import redis
from cryptography.exceptions import InvalidTag
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import MovedError, ResponseError
from redis.retry import Retry

from ..credentials import secret
from ..format import Record, Status, check_header, header_size
from ..guard import UNGUARDED, CallGuard, current_guard
from ..sealing import TAG_SIZE, PoolKey
from .base import GCM_SLACK, PieceBuffers, Tier
from .redis_protocol import GaveUp, ReplyStream, resp

_JOIN_BELOW = 64 * 1024
_PIECE = 256 * 1024  # authenticated right after it arrived, while in the CPU's cache
class Streamed(NamedTuple):
    """A reply checked as it was read: the record (payload in the caller's buffer), or why
    not (a Status is counted, and a corrupt object deleted, once the exchange is over)."""

    record: Record | None
    status: Status | None = None
    too_large: bool = False


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
        self._scratch = PieceBuffers(_PIECE)
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

    def _groups(self, keys: list[bytes],
                todo: list[int]) -> list[tuple[redis.ConnectionPool, list[int]]]:
        """(connection pool, indices) per server: the one server, or each slot's primary."""
        if self.pool is not None:
            return [(self.pool, todo)]
        cluster = self.cluster_client()
        by: dict[str, tuple[redis.ConnectionPool, list[int]]] = {}
        for i in todo:
            node = cluster.nodes_manager.get_node_from_slot(key_slot(keys[i]))
            if node.name not in by:
                by[node.name] = (cluster.get_redis_connection(node).connection_pool, [])
            by[node.name][1].append(i)
        return list(by.values())

    def _batches(self, idx: list[int], cost: Callable[[int], int] | None) -> list[list[int]]:
        if cost is None:
            return [idx]
        out: list[list[int]] = []
        cur: list[int] = []
        nbytes = 0
        for i in idx:
            if cur and nbytes >= self.cfg.batch_bytes:
                out.append(cur)
                cur, nbytes = [], 0
            cur.append(i)
            nbytes += cost(i)
        return out + ([cur] if cur else [])

    def _round(self, batches: list[tuple[redis.ConnectionPool, list[int]]], command, replies: dict,
               read: Callable) -> None:
        """Send every batch (one per server), then read every reply with read(stream, i),
        all servers' replies within one deadline; an error reply is kept as that key's
        reply, anything else leaves no connection with replies unread."""
        taken = []
        try:
            for pool, idx in batches:
                conn = pool.get_connection()
                taken.append((pool, conn, idx))
                conn.send_packed_command([p for i in idx for p in command(i)])
            deadline = time.monotonic() + self._kwargs["socket_timeout"]
            for _, conn, idx in taken:
                stream = ReplyStream.of(conn, deadline)
                for i in idx:
                    try:
                        replies[i] = read(stream, i)
                    except ResponseError as e:  # fully read: the connection stays usable
                        replies[i] = e
                stream.finish()
        except BaseException:
            for _, conn, _ in taken:
                conn.disconnect()
            self._refresh = self.pool is None
            raise
        finally:
            for pool, conn, _ in taken:
                pool.release(conn)

    def _exchange(self, keys: list[bytes], command: Callable[[int], list],
                  read: Callable = lambda stream, i: stream.small(),
                  cost: Callable[[int], int] | None = None) -> list:
        """Reply to command(i) for every key i, taken off the stream by read(stream, i) (by
        default a status or integer reply); raises the first error reply."""
        if not keys:
            return []
        replies: dict[int, object] = {}
        todo = list(range(len(keys)))
        for attempt in range(2):
            per_node = [(pool, self._batches(idx, cost)) for pool, idx in self._groups(keys, todo)]
            for r in range(max(len(b) for _, b in per_node)):
                self._round([(pool, b[r]) for pool, b in per_node if r < len(b)], command,
                            replies, read)
            todo = [i for i in todo if isinstance(replies[i], MovedError)]
            if not todo or self.pool is not None or attempt:
                break
            self._refresh = True  # a resharding moved these slots: new map, resend once
        for i in range(len(keys)):
            reply = replies[i]
            if isinstance(reply, Exception):
                raise reply
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

    def _getrange(self, keys: list[bytes], limits: list[int]) -> Callable[[int], list]:
        """GETRANGE k 0 limit: limit + 1 bytes at most, so an oversized value (a flooding
        attacker, another pool's giant object) is refused without being read whole."""
        return lambda i: [resp(b"GETRANGE", keys[i], b"0", b"%d" % limits[i])]

    def _bounded(self, value: bytes, limit: int) -> bytes | None:
        """A fetched value, or None when absent or longer than the reader accepts (counted)."""
        if len(value) > limit:
            self.stats.inc("rejected")
            return None
        return value or None  # GETRANGE of a missing key is b""

    def get_many(self, names: list[bytes], layout: bytes, key: PoolKey) -> list[Record | None]:
        keys = [self.object_key(n) for n in names]
        limits = [self.read_limit(n, None) for n in names]
        got = self._exchange(keys, self._getrange(keys, limits),
                             read=lambda stream, i: stream.bulk(limits[i]))
        return self.verify_all(names, layout, key,
                               [self._bounded(v, lim) for v, lim in zip(got, limits, strict=True)])

    def get_many_into(self, names: list[bytes], layout: bytes, key: PoolKey,
                      outs: list[memoryview]) -> list[Record | None]:
        keys = [self.object_key(n) for n in names]
        limits = [self.read_limit(n, o) for n, o in zip(names, outs, strict=True)]
        guard = current_guard()

        def read(stream: ReplyStream, i: int) -> Streamed:
            return self._read_into(stream, names[i], layout, key, outs[i], limits[i], guard)

        try:
            got = self._exchange(keys, self._getrange(keys, limits), read=read)
        except GaveUp:
            return [None] * len(names)
        out: list[Record | None] = []
        for i, v in enumerate(got):
            if v.too_large:
                self.stats.inc("rejected")
            elif v.status is not None:
                self.reject(names[i], v.status)
            elif v.record is not None:
                self.stats.inc("bytes_out", len(v.record.payload))
            out.append(v.record)
        return out

    def _read_into(self, stream: ReplyStream, name: bytes, layout: bytes, key: PoolKey,
                   out: memoryview, limit: int, guard: CallGuard) -> Streamed:
        """One GETRANGE reply, checked into `out`; the reply is always consumed whole (or an
        exception leaves the connection to be dropped)."""
        total = stream.bulk_length(limit)
        if not total:
            if total == 0:
                stream.exact(2)
            return Streamed(None)
        raw, plain = self._scratch.raw, self._scratch.plain
        consumed, result = 0, Streamed(None, Status.CORRUPT)
        header_len = header_size(name)
        if total > limit:  # limit + 1: a value longer than fits, skipped (bounded)
            result = Streamed(None, too_large=True)
        elif total >= header_len + TAG_SIZE:
            h = check_header(stream.exact(header_len), name, layout, total)
            consumed = header_len
            if h.status is not Status.CORRUPT and h.payload_len > len(out):
                result = Streamed(None, too_large=True)  # cannot be of the caller's layout
            elif h.status is not Status.CORRUPT:
                target = out[:h.payload_len]
                status = self._payload_into(stream, h, key, target, raw, plain, guard)
                consumed = total
                if status is Status.OK:
                    result = Streamed(Record(name, layout, target, key=key,
                                             encrypt=h.encrypted))
                else:  # no unverified byte stays in the caller's buffer
                    with guard.writing() as ok:
                        if not ok:
                            raise GaveUp()
                        target[:] = bytes(len(target))
                    result = Streamed(None, status)
        stream.skip(total - consumed + 2, raw)  # the rest of the value, then CRLF
        return result

    @staticmethod
    def _payload_into(stream: ReplyStream, h, key: PoolKey, target: memoryview,
                      raw: memoryview, plain: memoryview, guard: CallGuard) -> Status:
        """Payload and tag off the stream into target (a MAC'd payload is received in place,
        a ciphertext decrypted there from the scratch buffer); the header's status once the
        tag checks out, else CORRUPT."""
        check = key.checker(h.salt, h.raw, h.encrypted)
        n, done = len(target), 0
        while done < n:
            m = min(_PIECE, n - done)
            if not h.encrypted:
                piece = target[done:done + m]
                stream.into(piece, guard)
                check.authenticate_additional_data(piece)
            else:
                stream.into(raw[:m], UNGUARDED)
                with guard.writing() as ok:
                    if not ok:
                        raise GaveUp()
                    if n - done >= m + GCM_SLACK:
                        check.update_into(raw[:m], target[done:])
                    else:
                        check.update_into(raw[:m], plain)
                        target[done:done + m] = plain[:m]
            done += m
        try:
            check.finalize_with_tag(stream.exact(TAG_SIZE))
        except InvalidTag:
            return Status.CORRUPT
        return h.status

    answers_each = True  # one pipeline of EXISTS, one reply per name

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
