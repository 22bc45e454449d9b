"""The pool's hot set (store/hotset.py): bounded counts, the manifest format and its merge.
A manifest that does not parse is None, never an exception: it is read from a shared tier."""

from __future__ import annotations

import os
import random
import struct

import pytest

from kvpool_connector.store.hotset import (
    PRUNE_FACTOR,
    HotSet,
    Manifest,
    decode,
    encode,
    merge,
    plan,
)


def test_counts_stay_bounded_and_keep_the_most_hit():
    hot = HotSet(top_k=4)
    hot.add([b"hot"] * 50)
    hot.add([b"warm"] * 20)
    for i in range(1000):
        hot.add([f"cold{i}".encode()])
        assert len(hot) <= PRUNE_FACTOR * 4
    counts = hot.take()
    assert counts[b"hot"] == 50 and counts[b"warm"] == 20
    assert len(hot) == 0 and hot.take() == {}


def test_manifest_round_trips():
    m = Manifest("pool-a", [(os.urandom(32), 7), (b"\x00tail\x03" + os.urandom(32), 1)])
    assert decode(encode(m)) == m
    assert decode(encode(Manifest("p", []))) == Manifest("p", [])


@pytest.mark.parametrize("garbage", [
    b"", b"KVHS", b"XXXX\x01\x00\x00\x00\x00\x00\x00", b"KVHS\x02\x00\x00\x00\x00\x00\x00",
    b"KVHS\x01\xff\xff", b"KVHS\x01\x00\x00\xff\xff\xff\xff",  # truncated name, huge count
    b"KVHS\x01\x00\x00\x01\x00\x00\x00\x00",                   # a zero-length key
    random.Random(7).randbytes(200)], ids=lambda b: f"{len(b)}-bytes-{b[:6].hex()}")
def test_garbage_is_no_manifest(garbage):
    assert decode(garbage) is None


def test_truncated_or_padded_manifests_are_refused():
    blob = encode(Manifest("p", [(b"k" * 32, 3), (b"j" * 32, 2)]))
    for n in range(len(blob)):
        assert decode(blob[:n]) is None
    assert decode(blob + b"\x00") is None
    assert decode(None) is None


def test_merge_ages_stored_counts_adds_new_hits_and_keeps_top_k():
    stored = Manifest("p", [(b"a", 80), (b"b", 40), (b"c", 1)])
    m = merge(stored, {b"b": 50, b"d": 5}, "p", top_k=3)
    assert m.entries == [(b"b", 85), (b"a", 70), (b"d", 5)]  # c aged to 0 and fell off
    assert plan(m, 2) == [b"b", b"a"] and plan(m, 0) == []
    # another pool's manifest (a renamed namespace) is replaced, not merged into
    assert merge(stored, {b"x": 1}, "q", top_k=3) == Manifest("q", [(b"x", 1)])
    assert merge(None, {b"x": 1}, "p", top_k=3).entries == [(b"x", 1)]


def test_counts_saturate_instead_of_overflowing():
    m = merge(Manifest("p", [(b"a", (1 << 32) - 1)]), {b"a": 1 << 33}, "p", top_k=1)
    assert decode(encode(m)) == m
    assert struct.unpack("<I", encode(m)[-4:])[0] == (1 << 32) - 1
