"""Stored object format v2: header, payload (or its ciphertext), tag.

    offset   size field
    0        4    magic b"KVP\\x02"
    4        1    format version (2)
    5        1    flags: bit 0 = payload encrypted (AES-256-GCM); other bits unknown
    6        2    name length K (little endian)
    8        8    payload length N
    16       16   layout digest (xxh3-128 of the caller's layout fingerprint)
    32       16   salt: random per write; the object's AES key and nonce derive from it
                  and the pool key
    48       K    object name (derived from the caller's key with the pool key)
    48+K     N    payload, or its ciphertext (same length)
    48+K+N   16   tag: GMAC of header + payload, or, when encrypted, the GCM tag of the
                  ciphertext with the header as associated data

Every object carries its name and the layout it was written for, and the tag covers both,
so a reader never returns bytes written for another name (a renamed file), another KV
layout (a model or vLLM upgrade) or by anyone without the pool key (sealing.py). Version 1
objects (unkeyed xxh3 checksum) are misses. `check_header` and `open_blob` never raise on
garbage; they say why they failed.
"""

from __future__ import annotations

import enum
import os
import struct
from dataclasses import dataclass, field

import numpy as np
import xxhash
from cryptography.exceptions import InvalidTag

from . import blob_pool
from .sealing import SALT_SIZE, TAG_SIZE, PoolKey

MAGIC = b"KVP\x02"
VERSION = 2
FLAG_ENCRYPTED = 1
_FIXED = struct.Struct("<4sBBHQ16s16s")
FIXED_SIZE = _FIXED.size  # 48
MAX_NAME = 1024


class Status(enum.Enum):
    OK = "ok"
    CORRUPT = "corrupt"                 # bad header or length, failed MAC/tag: never served
    FOREIGN_LAYOUT = "foreign_layout"   # authentic, but written for another KV layout


def layout_digest(layout: bytes | str | None) -> bytes:
    """16-byte digest of a caller's layout fingerprint (any length) stored in each header."""
    if layout is None:
        layout = b""
    if isinstance(layout, str):
        layout = layout.encode()
    return xxhash.xxh3_128_digest(layout)


def header_size(name: bytes) -> int:
    return FIXED_SIZE + len(name)


def pack_header(name: bytes, layout: bytes, payload_len: int, encrypted: bool,
                salt: bytes) -> bytes:
    if len(name) > MAX_NAME:
        raise ValueError(f"name of {len(name)} bytes exceeds {MAX_NAME}")
    return _FIXED.pack(MAGIC, VERSION, FLAG_ENCRYPTED if encrypted else 0, len(name),
                       payload_len, layout, salt) + name


def to_view(payload) -> memoryview:
    """A flat byte view of any buffer (bytes, numpy, torch.uint8 CPU tensors) without copying."""
    if isinstance(payload, memoryview):
        view = payload
    else:
        try:
            view = memoryview(payload)
        except TypeError:
            view = _torch_view(payload)
    if view.ndim == 1 and view.format == "B":
        return view
    if not view.c_contiguous:
        raise ValueError("payload must be contiguous")
    return view.cast("B")


def _torch_view(t) -> memoryview:
    import torch  # only when the caller passes tensors

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"payload of type {type(t).__name__} has no buffer")
    if t.device.type != "cpu":
        raise ValueError("tensor payloads must be on the CPU")
    if not t.is_contiguous():
        raise ValueError("tensor payloads must be contiguous")
    return memoryview(t.view(torch.uint8).reshape(-1).numpy())


def uninitialized(n: int) -> memoryview:
    """n writable bytes without zero-filling them first: every byte is written next, and a
    zeroed bytearray costs a memset over freshly faulted pages (2.5x slower for 2 MiB)."""
    return np.empty(n, dtype=np.uint8).data


@dataclass(frozen=True)
class Header:
    """The parsed fixed fields of an object, checked against what the reader expects."""

    status: Status
    payload_len: int = 0
    encrypted: bool = False
    salt: bytes = b""
    raw: bytes = b""  # the header's bytes: authenticated with the payload

    @property
    def size(self) -> int:
        return len(self.raw)


_BAD = Header(Status.CORRUPT)


def check_header(hdr, name: bytes, layout: bytes, total_len: int) -> Header:
    """Validate a header (the first header_size(name) bytes) against an object of total_len
    bytes. FOREIGN_LAYOUT is tentative until the tag confirms the object is authentic."""
    if len(hdr) < FIXED_SIZE + len(name):
        return _BAD
    magic, version, flags, name_len, payload_len, stored_layout, salt = \
        _FIXED.unpack_from(hdr, 0)
    if magic != MAGIC or version != VERSION or flags & ~FLAG_ENCRYPTED or name_len != len(name):
        return _BAD
    encrypted = bool(flags & FLAG_ENCRYPTED)
    if FIXED_SIZE + name_len + payload_len + TAG_SIZE != total_len:
        return _BAD
    if bytes(hdr[FIXED_SIZE:FIXED_SIZE + name_len]) != name:
        return _BAD
    status = Status.OK if stored_layout == layout else Status.FOREIGN_LAYOUT
    return Header(status, payload_len, encrypted, salt, bytes(hdr[:FIXED_SIZE + name_len]))


@dataclass
class Record:
    """One object on its way between tiers: the plaintext payload and, for the shared tiers,
    its sealed form (header, body = payload or ciphertext, tag) under `key`.

    `seal()` makes the sealed form once; `freeze()` makes it one contiguous buffer owned by
    the store (the caller may then reuse its memory), shared read-only by every lower tier.
    A record read from a tier already holds its sealed form (`blob`).
    """

    name: bytes
    layout: bytes
    payload: memoryview
    key: PoolKey | None = None
    encrypt: bool = False
    blob: memoryview | None = None
    # the local tiers (cpu, disk) evict it before every other object when they need room
    # (the store's evict_first predicate: the connector's tail objects)
    evict_first: bool = False
    _parts: tuple[bytes, memoryview, bytes] | None = field(default=None, repr=False)
    _arr: np.ndarray | None = field(default=None, repr=False, compare=False)  # blob_pool's

    def __del__(self) -> None:
        arr, self._arr = self._arr, None
        if arr is not None:  # every view of it dropped first, then it may be reused
            # the payload may be a view of it too; no use of the record follows
            self.blob = self._parts = self.payload = None  # type: ignore[assignment]
            try:  # noqa: SIM105 -- at interpreter teardown contextlib may be gone already
                blob_pool.give(arr)
            except (AttributeError, TypeError):  # the interpreter is tearing modules down
                pass

    @property
    def size(self) -> int:
        return len(self.payload)

    def parts(self) -> tuple[bytes, memoryview, bytes]:
        """(header, body, tag) of the sealed object; body is the payload itself when only
        MAC'd (no copy), the ciphertext when encrypted."""
        if self._parts is None:
            assert self.key is not None, "a record without a key cannot be sealed"
            if self.encrypt:
                self.freeze()
            else:
                salt = os.urandom(SALT_SIZE)
                hdr = pack_header(self.name, self.layout, len(self.payload), False, salt)
                self._parts = (hdr, self.payload, self.key.mac(salt, (hdr, self.payload)))
        assert self._parts is not None  # freeze() set it
        return self._parts

    def sealed_size(self) -> int:
        return header_size(self.name) + len(self.payload) + TAG_SIZE

    def freeze(self) -> Record:
        """One owned header + body + tag buffer (a single copy of the payload)."""
        if self.blob is not None:
            return self
        n = len(self.payload)
        if self.encrypt:
            assert self.key is not None, "a record without a key cannot be sealed"
            salt = os.urandom(SALT_SIZE)
            hdr = pack_header(self.name, self.layout, n, True, salt)
            self._arr = blob_pool.take(len(hdr) + n + TAG_SIZE)
            buf = self._arr.data
            buf[:len(hdr)] = hdr
            self.key.encrypt_into(salt, hdr, self.payload, buf[len(hdr):])
        else:
            hdr, body, tag = self.parts()
            self._arr = blob_pool.take(len(hdr) + n + len(tag))
            buf = self._arr.data
            buf[:len(hdr)] = hdr
            buf[len(hdr):len(hdr) + n] = body
            buf[len(hdr) + n:] = tag
        self.blob = buf.toreadonly()
        h = len(hdr)
        self._parts = (hdr, self.blob[h:h + n], bytes(self.blob[h + n:]))
        if not self.encrypt:
            self.payload = self._parts[1]  # the caller's memory is no longer referenced
        return self

    def blob_bytes(self) -> bytes:
        """The sealed object as `bytes` (what clients like boto3 take): one copy, unless the
        object was read as bytes in the first place."""
        b = self.freeze().blob
        assert b is not None  # freeze() set it
        if isinstance(b.obj, bytes) and len(b) == len(b.obj):
            return b.obj
        return bytes(b)


def open_blob(blob, name: bytes, layout: bytes, key: PoolKey,
              out: memoryview | None = None) -> tuple[Status, Record | None]:
    """Check a stored object and return its plaintext (into `out` when given; a payload
    larger than `out` is CORRUPT for this reader). Never raises on garbage; on any failure
    `out` holds no byte of the object."""
    try:
        view = to_view(blob)
    except (TypeError, ValueError):
        return Status.CORRUPT, None
    h = check_header(view[:header_size(name)], name, layout, len(view))
    if h.status is Status.CORRUPT:
        return Status.CORRUPT, None
    header_len, n = h.size, h.payload_len
    body, tag = view[header_len:header_len + n], view[header_len + n:]
    if out is not None and n > len(out):
        return Status.CORRUPT, None
    if h.encrypted:
        target = out[:n] if out is not None else uninitialized(n)
        try:
            key.decrypt_into(h.salt, h.raw, view[header_len:], target)
        except (InvalidTag, ValueError):
            if out is not None:
                out[:n] = bytes(n)
            return Status.CORRUPT, None
        payload = target
    else:
        auth = key.authenticator(h.salt, bytes(tag))
        auth.authenticate_additional_data(h.raw)
        auth.authenticate_additional_data(body)
        try:
            auth.finalize()
        except InvalidTag:
            return Status.CORRUPT, None
        if out is not None:
            out[:n] = body
            payload = out[:n]
        else:
            payload = body
    if h.status is not Status.OK:
        if out is not None:
            out[:n] = bytes(n)
        return h.status, None
    return Status.OK, Record(name, layout, payload, key=key, encrypt=h.encrypted, blob=view,
                             _parts=(h.raw, body, bytes(tag)))
