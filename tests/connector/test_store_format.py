"""Object format: round trip, every kind of damage detected, random bytes never crash."""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool_connector.store.format import (FIXED_SIZE, Record, Status, layout_digest, parse,
                                           to_view)

KEY = bytes(range(32))
LAY = layout_digest(b"model|bf16|layout-A")


def blob(payload: bytes, key: bytes = KEY, layout: bytes = LAY) -> bytes:
    return bytes(Record(key, layout, memoryview(payload)).freeze().blob)


def test_round_trip_and_header_size():
    payload = os.urandom(10_000)
    b = blob(payload)
    assert len(b) == FIXED_SIZE + len(KEY) + len(payload)
    status, rec = parse(b, KEY, LAY)
    assert status is Status.OK and bytes(rec.payload) == payload
    assert parse(blob(b""), KEY, LAY)[0] is Status.OK


def test_other_key_is_corrupt():
    assert parse(blob(b"x" * 100), KEY, LAY)[0] is Status.OK
    assert parse(blob(b"x" * 100), bytes(32), LAY)[0] is Status.CORRUPT


def test_other_layout_is_foreign():
    other = layout_digest(b"model|fp8|layout-B")
    assert parse(blob(b"x" * 100, layout=other), KEY, LAY) == (Status.FOREIGN_LAYOUT, None)


def test_truncated_and_extended_are_corrupt():
    b = blob(os.urandom(5000))
    for bad in (b[:-1], b[:FIXED_SIZE], b[:3], b"", b + b"\0"):
        assert parse(bad, KEY, LAY)[0] is Status.CORRUPT


def test_every_single_byte_flip_is_detected():
    b = bytearray(blob(os.urandom(300)))
    for i in range(len(b)):
        b[i] ^= 0x40
        assert parse(bytes(b), KEY, LAY)[0] is not Status.OK, f"flip at {i} went unnoticed"
        b[i] ^= 0x40


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


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=2048), st.binary(min_size=1, max_size=64))
def test_random_bytes_never_crash(data, key):
    status, rec = parse(data, key, LAY)
    assert status is not Status.OK or rec is not None


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512), st.integers(min_value=0), st.integers(min_value=1, max_value=255))
def test_mutated_objects_never_parse_as_ok(payload, pos, xor):
    b = bytearray(blob(payload))
    b[pos % len(b)] ^= xor
    assert parse(bytes(b), KEY, LAY)[0] is not Status.OK


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=512), st.binary(min_size=1, max_size=64), st.binary(max_size=64))
def test_valid_objects_round_trip(payload, key, layout):
    lay = layout_digest(layout)
    status, rec = parse(blob(payload, key, lay), key, lay)
    assert status is Status.OK and bytes(rec.payload) == payload
