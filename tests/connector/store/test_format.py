"""Object format v2: round trip (MAC'd and encrypted), every kind of damage or forgery
detected, random bytes never crash, v1 objects are misses."""

from __future__ import annotations

import os
import struct

import pytest
import xxhash
from hypothesis import given, settings, strategies as st

from kvpool_connector.store.format import (
    FIXED_SIZE,
    Record,
    Status,
    layout_digest,
    open_blob,
    to_view,
)
from kvpool_connector.store.sealing import PoolKey

NAME = bytes(range(32))
LAYOUT_ID = layout_digest(b"model|bf16|layout-A")
KEY = PoolKey(b"k" * 43)
MODES = pytest.mark.parametrize("encrypt", [False, True], ids=["mac", "aes-gcm"])


def blob(payload: bytes, name: bytes = NAME, layout: bytes = LAYOUT_ID, key: PoolKey = KEY,
         encrypt: bool = False) -> bytes:
    return bytes(Record(name, layout, memoryview(payload), key=key, encrypt=encrypt).freeze().blob)


def status(b, name=NAME, layout=LAYOUT_ID, key=KEY, out=None) -> Status:
    return open_blob(b, name, layout, key, out)[0]


@MODES
def test_round_trip_and_sizes(encrypt):
    payload = os.urandom(10_000)
    b = blob(payload, encrypt=encrypt)
    assert len(b) == FIXED_SIZE + len(NAME) + len(payload) + 16
    result, rec = open_blob(b, NAME, LAYOUT_ID, KEY)
    assert result is Status.OK and bytes(rec.payload) == payload
    out = bytearray(len(payload) + 5)
    result, rec = open_blob(b, NAME, LAYOUT_ID, KEY, memoryview(out))
    assert result is Status.OK and out[:len(payload)] == payload
    assert status(blob(b"", encrypt=encrypt)) is Status.OK
    assert (payload in b) is not encrypt  # encrypted: the plaintext is nowhere in the object


def test_parts_send_the_payload_without_a_copy():
    payload = bytearray(os.urandom(1000))
    rec = Record(NAME, LAYOUT_ID, memoryview(payload), key=KEY)
    hdr, body, tag = rec.parts()
    assert body.obj is payload and len(tag) == 16
    assert status(bytes(hdr) + bytes(body) + tag) is Status.OK


@MODES
def test_other_name_or_other_pool_key_fails(encrypt):
    b = blob(b"x" * 100, encrypt=encrypt)
    assert status(b, name=bytes(32)) is Status.CORRUPT
    assert status(b, key=PoolKey(b"another pool key, also 32 chars+")) is Status.CORRUPT


def test_forged_header_and_tag_without_the_key_fail():
    """An attacker who can write the tier but lacks the key: a well-formed object with a tag
    from another key, with no tag, or with the encryption flag flipped, is never served."""
    good = bytearray(blob(b"secret KV" * 100))
    forged = blob(b"attacker KV" * 100, key=PoolKey(b"attacker-chosen key of 32+ chars!"))
    assert status(forged) is Status.CORRUPT
    assert status(bytes(good[:-16]) + bytes(16)) is Status.CORRUPT  # zero tag
    flipped = bytearray(good)
    flipped[5] |= 1  # claim it is encrypted
    assert status(bytes(flipped)) is Status.CORRUPT


def test_v1_objects_with_a_valid_xxh3_checksum_are_misses():
    """The unkeyed v1 format: anyone could recompute its checksum, so it is never read."""
    payload = b"v1 payload" * 10
    csum = xxhash.xxh3_64(NAME + LAYOUT_ID + payload).intdigest()
    v1 = struct.pack("<4sBBHQ16sQ", b"KVP\x01", 1, 0, len(NAME), len(payload), LAYOUT_ID, csum)
    assert status(v1 + NAME + payload) is Status.CORRUPT


def test_other_layout_is_foreign():
    other = layout_digest(b"model|fp8|layout-B")
    assert open_blob(blob(b"x" * 100, layout=other), NAME, LAYOUT_ID, KEY) == (Status.FOREIGN_LAYOUT,
                                                                        None)


@MODES
def test_truncated_and_extended_are_corrupt(encrypt):
    b = blob(os.urandom(5000), encrypt=encrypt)
    for bad in (b[:-1], b[:FIXED_SIZE], b[:3], b"", b + b"\0"):
        assert status(bad) is Status.CORRUPT


@MODES
def test_every_single_byte_flip_is_detected(encrypt):
    b = bytearray(blob(os.urandom(300), encrypt=encrypt))
    for i in range(len(b)):
        b[i] ^= 0x40
        assert status(bytes(b)) is not Status.OK, f"flip at {i} went unnoticed"
        b[i] ^= 0x40


@MODES
def test_a_failed_read_leaves_no_byte_in_the_callers_buffer(encrypt):
    payload = os.urandom(4096)
    b = bytearray(blob(payload, encrypt=encrypt))
    b[FIXED_SIZE + len(NAME) + 2000] ^= 1
    out = bytearray(4096)
    assert status(bytes(b), out=memoryview(out)) is Status.CORRUPT
    assert out == bytes(4096)


def test_payload_types_viewed_without_copy():
    import numpy as np
    import torch

    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert to_view(arr).tobytes() == arr.tobytes()
    t = torch.arange(16, dtype=torch.uint8)
    v = to_view(t)
    t[0] = 99
    assert v[0] == 99  # same memory
    assert to_view(torch.ones(4, dtype=torch.bfloat16)).nbytes == 8


def test_names_depend_on_the_pool_key():
    a, b = PoolKey(b"a" * 32), PoolKey(b"b" * 32)
    assert a.object_name(NAME) != b.object_name(NAME) != NAME
    assert a.object_name(NAME) == PoolKey(b"a" * 32).object_name(NAME)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=2048), st.binary(min_size=1, max_size=64))
def test_random_bytes_never_crash(data, name):
    result, rec = open_blob(data, name, LAYOUT_ID, KEY)
    assert result is not Status.OK


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512), st.integers(min_value=0), st.integers(min_value=1, max_value=255),
       st.booleans())
def test_mutated_objects_never_parse_as_ok(payload, pos, xor, encrypt):
    b = bytearray(blob(payload, encrypt=encrypt))
    b[pos % len(b)] ^= xor
    assert status(bytes(b)) is not Status.OK


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=512), st.binary(min_size=1, max_size=64), st.binary(max_size=64),
       st.booleans())
def test_valid_objects_round_trip(payload, name, layout, encrypt):
    layout_id = layout_digest(layout)
    result, rec = open_blob(blob(payload, name, layout_id, encrypt=encrypt), name, layout_id, KEY)
    assert result is Status.OK and bytes(rec.payload) == payload


def test_sealed_buffers_are_reused_only_once_no_view_of_them_is_left():
    """Freeze's buffer goes back to blob_pool when its record dies (no page faults for the
    next write), never while a memoryview of it is still around."""
    from kvpool_connector.store import blob_pool

    key = PoolKey(b"a pool key of at least 32 characters!!")
    payload = memoryview(os.urandom(1 << 20))

    def frozen(encrypt: bool) -> Record:
        return Record(b"n" * 32, b"l" * 16, payload, key=key, encrypt=encrypt).freeze()

    rec = frozen(True)
    buf, size = id(rec._arr), rec._arr.nbytes  # no reference kept: that would pin it
    before = blob_pool.held_bytes()
    del rec
    assert blob_pool.held_bytes() == before + size
    again = frozen(False)  # the same size: the same buffer, rewritten
    assert id(again._arr) == buf and blob_pool.held_bytes() == before
    ok, got = open_blob(again.blob, b"n" * 32, b"l" * 16, key)
    assert ok is Status.OK and bytes(got.payload) == bytes(payload)
    escaped = again.blob[100:200]  # header (80 bytes), then the payload in the clear
    del again
    assert blob_pool.held_bytes() == before  # a view is alive: not reused
    other = Record(b"n" * 32, b"l" * 16, memoryview(bytes(1 << 20)), key=key).freeze()
    assert bytes(escaped) == bytes(payload[20:120])  # never overwritten by the next write
    del other
