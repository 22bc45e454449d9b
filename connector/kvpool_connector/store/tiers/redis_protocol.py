"""Redis's wire protocol (RESP) as the Redis tier speaks it: `resp()` packs a command, and
`ReplyStream` takes the replies of one pipelined exchange off the socket by hand.

Its own module because it is the tier's defence against a hostile server (or a man in the
middle on plain redis://), not tier logic: every wait counts against one absolute deadline
per exchange, a reply's first line is capped, and a value longer than the GETRANGE asked for
is refused; any of those raises and the caller drops the connection. The tier
(`redis.py`) decides what to send and what a reply means.
"""

from __future__ import annotations

import select
import ssl
import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from redis.exceptions import ResponseError, TimeoutError as RedisTimeoutError

from ..guard import UNGUARDED, CallGuard

_T = TypeVar("_T")

_LINE_READ = 64  # read-ahead for a reply's first line: at most this much of a value is copied
_LINE_MAX = 512  # "$<length>", ":<n>", "+OK" or an error message: anything longer is hostile


def resp(*args: bytes) -> bytes:
    """One command in RESP (what redis-py's packer produces, without a connection)."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


class GaveUp(Exception):
    """The caller stopped waiting (its deadline passed): nothing more may be written into
    its buffers, and the connection, holding unread replies, is dropped."""


class ReplyStream:
    """The replies of one pipelined exchange, read off the connection's socket (TCP, Unix or
    TLS) by hand, so that a malicious server (or a man in the middle on plain redis://)
    cannot keep the reading thread: every wait counts against one absolute deadline for the
    whole exchange (a server dripping a byte at a time cannot stretch it), a reply's first
    line may hold at most `_LINE_MAX` bytes, and the caller refuses a bulk reply longer than
    it asked for. Any of those raises, and the caller drops the connection.

    Small reads for a reply's first line and the object's header and tag (kept in `buf`),
    `into()` for payloads: whatever is buffered, then `recv_into` the caller's memory. The
    socket is non-blocking while the stream reads it: each receive into the caller's memory
    waits for data first without holding the call's guard, then takes what is there while
    holding it (a TLS record not yet complete is "wait again"), so a stalled server never
    keeps a caller from giving up. The connection's own parser holds no unread bytes at the
    start (every earlier reply on it was read whole); bytes left here at the end mean the
    stream is out of step, and the caller drops the connection.
    """

    def __init__(self, sock, deadline: float, parse_error: Callable) -> None:
        self.sock = sock
        self.deadline = deadline
        self.parse_error = parse_error
        self.buf = bytearray()
        self.pos = 0
        self._tls = isinstance(sock, ssl.SSLSocket)
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        self._blocking_timeout = sock.gettimeout()
        sock.settimeout(0.0)

    @classmethod
    def of(cls, conn, deadline: float) -> ReplyStream:
        """A stream over a connected redis-py connection's socket."""
        parser = getattr(conn, "_parser", None)
        parse_error = getattr(parser, "parse_error", None) or ResponseError
        return cls(conn._get_socket(), deadline, parse_error)

    def _wait(self) -> None:
        if self._tls and self.sock.pending():
            return  # decrypted bytes are waiting inside the TLS layer, not on the socket
        left = self.deadline - time.monotonic()
        if left <= 0 or not self._poll.poll(max(1, int(left * 1000))):
            raise RedisTimeoutError("Timeout reading from socket")

    def _recv(self, receive: Callable[..., _T], *args: Any) -> _T | None:
        """One receive that never waits: None when nothing could be taken yet."""
        try:
            return receive(*args)
        except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return None

    def _more(self) -> None:
        while True:
            self._wait()
            data = self._recv(self.sock.recv, _LINE_READ)
            if data is None:
                continue
            if not data:
                raise redis.ConnectionError("Connection closed by server.")
            if self.pos:
                del self.buf[:self.pos]
                self.pos = 0
            self.buf += data
            return

    def line(self) -> bytes:
        while True:
            end = self.buf.find(b"\r\n", self.pos)
            if end >= 0:
                out = bytes(self.buf[self.pos:end])
                self.pos = end + 2
                return out
            if len(self.buf) - self.pos > _LINE_MAX:
                raise redis.ConnectionError(f"reply line longer than {_LINE_MAX} bytes")
            self._more()

    def exact(self, n: int) -> bytes:
        while len(self.buf) - self.pos < n:
            self._more()
        out = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return out

    def into(self, view: memoryview, guard: CallGuard) -> None:
        """Fill view whole from the stream; GaveUp once the guard's caller gave up."""
        done = min(len(view), len(self.buf) - self.pos)
        if done:
            with guard.writing() as ok:
                if not ok:
                    raise GaveUp()
                view[:done] = self.buf[self.pos:self.pos + done]
            self.pos += done
        while done < len(view):
            self._wait()
            with guard.writing() as ok:
                if not ok:
                    raise GaveUp()
                m = self._recv(self.sock.recv_into, view[done:])
            if m is None:
                continue
            if m == 0:
                raise redis.ConnectionError("Connection closed by server.")
            done += m

    def skip(self, n: int, scratch: memoryview) -> None:
        while n > 0:
            m = min(n, len(scratch))
            self.into(scratch[:m], UNGUARDED)
            n -= m

    def _first(self, expected: bytes) -> tuple[bytes, bytes]:
        """(kind, rest) of the next reply's first line, `kind` one of `expected`; an error
        reply raises as redis-py would (MovedError for a resharded slot)."""
        first = self.line()
        kind, rest = first[:1], first[1:]
        if kind == b"-":
            err = self.parse_error(rest.decode("utf-8", "replace"))
            raise err if isinstance(err, BaseException) else ResponseError(str(err))
        if not kind or kind not in expected:
            raise redis.ConnectionError(f"unexpected reply {first[:32]!r}")
        return kind, rest

    def _number(self, text: bytes) -> int:
        try:
            return int(text)
        except ValueError:
            raise redis.ConnectionError(f"not a number in a reply: {text[:32]!r}") from None

    def bulk_length(self, limit: int) -> int | None:
        """The length of the next bulk reply (None: nil). GETRANGE returns at most `limit`
        + 1 bytes (one past what the reader accepts): anything longer is no real reply."""
        _, rest = self._first(b"$")
        n = self._number(rest)
        if n > limit + 1:
            raise redis.ConnectionError(f"a bulk reply of {n} bytes to a GETRANGE of at most "
                                        f"{limit + 1}")
        return None if n < 0 else n

    def bulk(self, limit: int) -> bytes | None:
        """A whole bulk reply (b"" for nil), into a new buffer of its announced length."""
        n = self.bulk_length(limit)
        if n is None:
            return b""
        value = bytearray(n + 2)
        self.into(memoryview(value), UNGUARDED)
        if value[n:] != b"\r\n":
            raise redis.ConnectionError("a bulk reply without its CRLF: stream out of step")
        del value[n:]
        return bytes(value)

    def small(self) -> bytes | int:
        """A status (`+OK`) or integer (`:1`) reply: SET, EXISTS, UNLINK."""
        kind, rest = self._first(b"+:")
        return rest if kind == b"+" else self._number(rest)

    def finish(self) -> None:
        if self.pos != len(self.buf):
            raise redis.ConnectionError("bytes left after the last reply: stream out of step")
        self.sock.settimeout(self._blocking_timeout)  # in step: redis-py may use it again
