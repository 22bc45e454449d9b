"""Stored object format: a small self-describing header, then the payload.

    offset size field
    0      4    magic b"KVP\\x01"
    4      1    format version (1)
    5      1    flags (0; any other value is unknown to this version)
    6      2    key length K (little endian)
    8      8    payload length N
    16     16   layout digest (xxh3-128 of the caller's layout fingerprint)
    32     8    checksum: xxh3-64 over key, layout digest and payload
    40     K    key
    40+K   N    payload

Every object carries its key and the layout it was written for, so a reader never returns
bytes written for another key (a hash collision of object names, a renamed file) or another
KV layout (a model or vLLM upgrade). `parse` never raises on garbage; it says why it failed.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field

import xxhash

MAGIC = b"KVP\x01"
VERSION = 1
_FIXED = struct.Struct("<4sBBHQ16sQ")
FIXED_SIZE = _FIXED.size  # 40
MAX_KEY = 1024


class Status(enum.Enum):
    OK = "ok"
    CORRUPT = "corrupt"                 # bad magic/version/length/checksum, or another key
    FOREIGN_LAYOUT = "foreign_layout"   # intact, but written for another KV layout


def layout_digest(layout: bytes | str | None) -> bytes:
    """16-byte digest of a caller's layout fingerprint (any length) stored in each header."""
    if layout is None:
        layout = b""
    if isinstance(layout, str):
        layout = layout.encode()
    return xxhash.xxh3_128_digest(layout)


def header_size(key: bytes) -> int:
    return FIXED_SIZE + len(key)


def hasher(key: bytes, layout: bytes) -> "xxhash.xxh3_64":
    """A streaming checksum already fed with key and layout: update() it with the payload."""
    h = xxhash.xxh3_64()
    h.update(key)
    h.update(layout)
    return h


def checksum(key: bytes, layout: bytes, payload) -> int:
    h = hasher(key, layout)
    h.update(payload)
    return h.intdigest()


def pack_header(key: bytes, layout: bytes, payload_len: int, csum: int) -> bytes:
    if len(key) > MAX_KEY:
        raise ValueError(f"key of {len(key)} bytes exceeds {MAX_KEY}")
    return _FIXED.pack(MAGIC, VERSION, 0, len(key), payload_len, layout, csum) + key


def to_view(payload) -> memoryview:
    """A flat byte view of any buffer (bytes, numpy, torch.uint8 CPU tensors) without copying."""
    if isinstance(payload, memoryview):
        mv = payload
    else:
        try:
            mv = memoryview(payload)
        except TypeError:
            mv = _torch_view(payload)
    if mv.ndim == 1 and mv.format == "B":
        return mv
    if not mv.c_contiguous:
        raise ValueError("payload must be contiguous")
    return mv.cast("B")


def _torch_view(t) -> memoryview:
    import torch  # only when the caller passes tensors

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"payload of type {type(t).__name__} has no buffer")
    if t.device.type != "cpu":
        raise ValueError("tensor payloads must be on the CPU")
    if not t.is_contiguous():
        raise ValueError("tensor payloads must be contiguous")
    return memoryview(t.view(torch.uint8).reshape(-1).numpy())


@dataclass
class Record:
    """One object on its way between tiers: payload plus (lazily) its header.

    `blob` is a contiguous header+payload buffer owned by the store once `freeze()` ran (or
    when the record was read from a tier); it is shared, read-only, by every lower tier.
    """

    key: bytes
    layout: bytes
    payload: memoryview
    csum: int | None = None
    blob: memoryview | None = None
    _header: bytes | None = field(default=None, repr=False)

    @property
    def size(self) -> int:
        return len(self.payload)

    def header(self) -> bytes:
        if self._header is None:
            if self.csum is None:
                self.csum = checksum(self.key, self.layout, self.payload)
            self._header = pack_header(self.key, self.layout, len(self.payload), self.csum)
        return self._header

    def freeze(self) -> "Record":
        """Copy header+payload into one owned buffer (the caller may reuse its memory)."""
        if self.blob is None:
            hdr = self.header()
            self.blob = memoryview(hdr + self.payload)  # bytes: clients take it as is
            self.payload = self.blob[len(hdr):]
        return self

    def blob_bytes(self) -> bytes:
        """The blob as `bytes` (no copy when it already is a view of a whole bytes object)."""
        b = self.freeze().blob
        if isinstance(b.obj, bytes) and len(b) == len(b.obj):
            return b.obj
        return bytes(b)


def parse(blob, key: bytes, layout: bytes, *, verify: bool = True) -> tuple[Status, Record | None]:
    """Check a stored object against the expected key and layout; never raises on junk."""
    try:
        mv = to_view(blob)
    except (TypeError, ValueError):
        return Status.CORRUPT, None
    st, n, csum, stored_layout = check_header(mv[:FIXED_SIZE + len(key)], key, layout, len(mv))
    if st is Status.CORRUPT:
        return st, None
    payload = mv[FIXED_SIZE + len(key):]
    if verify and checksum(key, stored_layout, payload) != csum:
        return Status.CORRUPT, None
    if st is not Status.OK:
        return st, None
    return Status.OK, Record(key, layout, payload, csum=csum, blob=mv,
                             _header=bytes(mv[:FIXED_SIZE + len(key)]))


_BAD = (Status.CORRUPT, 0, 0, b"")


def check_header(hdr, key: bytes, layout: bytes, total_len: int) -> tuple[Status, int, int, bytes]:
    """Validate a header (the first header_size(key) bytes) against an object of total_len
    bytes; returns (status, payload length, checksum, stored layout digest).

    FOREIGN_LAYOUT is tentative until the checksum (computed with the stored layout) confirms
    the object is intact; otherwise it is CORRUPT."""
    if len(hdr) < FIXED_SIZE + len(key):
        return _BAD
    magic, version, flags, klen, n, lay, csum = _FIXED.unpack_from(hdr, 0)
    if magic != MAGIC or version != VERSION or flags != 0 or klen != len(key):
        return _BAD
    if FIXED_SIZE + klen + n != total_len:
        return _BAD
    if bytes(hdr[FIXED_SIZE:FIXED_SIZE + klen]) != key:
        return _BAD
    return (Status.OK if lay == layout else Status.FOREIGN_LAYOUT), n, csum, lay
