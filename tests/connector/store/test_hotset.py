"""The pool's hot set (store/hotset.py): bounded counts, the manifest format and its merge.
A manifest that does not parse is None, never an exception: it is read from a shared tier."""

from __future__ import annotations

import os
import random
import struct

import pytest

from kvpool_connector.store.hotset import (
    HALF_LIFE_S,
    HIT_UNITS,
    PRUNE_FACTOR,
    HotSet,
    Manifest,
    decode,
    encode,
    merge,
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
    m = Manifest("pool-a", [(os.urandom(32), 7), (b"\x00tail\x03" + os.urandom(32), 1)], 1_700_000_000)
    assert decode(encode(m)) == m
    assert decode(encode(Manifest("p", []))) == Manifest("p", [])


@pytest.mark.parametrize("garbage", [
    b"", b"KVHS", b"XXXX\x02\x00\x00" + bytes(12), b"KVHS\x01\x00\x00" + bytes(12),  # magic, v1
    b"KVHS\x02\xff\xff", b"KVHS\x02\x00\x00" + bytes(8) + b"\xff\xff\xff\xff",  # truncated name, huge count
    b"KVHS\x02\x00\x00" + bytes(8) + b"\x01\x00\x00\x00\x00",    # a zero-length key
    random.Random(7).randbytes(200)], ids=lambda b: f"{len(b)}-bytes-{b[:6].hex()}")
def test_garbage_is_no_manifest(garbage):
    assert decode(garbage) is None


def test_truncated_or_padded_manifests_are_refused():
    blob = encode(Manifest("p", [(b"k" * 32, 3), (b"j" * 32, 2)]))
    for n in range(len(blob)):
        assert decode(blob[:n]) is None
    assert decode(blob + b"\x00") is None
    assert decode(None) is None


def test_merge_ages_stored_counts_by_time_adds_new_hits_and_keeps_top_k():
    t0 = 1_700_000_000
    stored = Manifest("p", [(b"a", 80 * HIT_UNITS), (b"b", 40 * HIT_UNITS), (b"c", 1)], t0)
    m = merge(stored, {b"b": 50, b"d": 5}, "p", top_k=3, now=t0 + HALF_LIFE_S)  # one half-life on
    assert m.entries == [(b"b", 70 * HIT_UNITS), (b"a", 40 * HIT_UNITS), (b"d", 5 * HIT_UNITS)]
    assert m.written_at == t0 + HALF_LIFE_S  # c (a 1024th of a hit) aged to nothing and fell off
    # another pool's manifest (a renamed namespace) is replaced, not merged into
    assert merge(stored, {b"x": 1}, "q", top_k=3, now=t0).entries == [(b"x", HIT_UNITS)]
    assert merge(None, {b"x": 1}, "p", top_k=3, now=t0) == Manifest("p", [(b"x", HIT_UNITS)], t0)
    # a writer whose clock is behind the manifest's ages nothing
    assert merge(stored, {}, "p", top_k=3, now=t0 - 60).entries == stored.entries


def test_one_hit_survives_many_merges_of_a_large_fleet():
    """What the merge-count ageing got wrong: a chunk hit once disappeared at the next merge
    of any engine. Ageing by time, 20 engines merging every minute for ten minutes keep it,
    behind a chunk hit twice, and order the hot set by hits."""
    t0 = 1_700_000_000
    m = merge(None, {b"once": 1, b"twice": 2}, "p", top_k=16, now=t0)
    for n in range(1, 201):  # 200 merges by 20 engines in 10 minutes, each with its own hits
        m = merge(m, {f"other{n % 7}".encode(): 1}, "p", top_k=16, now=t0 + n * 3)
    keys = [k for k, _ in m.entries]
    assert b"once" in keys and keys.index(b"twice") < keys.index(b"once")
    assert dict(m.entries)[b"once"] > HIT_UNITS * 0.85  # ten minutes of a one-hour half-life


def test_counts_saturate_instead_of_overflowing():
    m = merge(Manifest("p", [(b"a", (1 << 64) - 1)]), {b"a": 1 << 60}, "p", top_k=1, now=0)
    assert decode(encode(m)) == m
    assert struct.unpack("<Q", encode(m)[-8:])[0] == (1 << 64) - 1
