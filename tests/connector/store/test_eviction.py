"""Capacity bounds and eviction order of the cpu arena (lru, arc) and the disk tier."""

from __future__ import annotations

import os

import pytest

from kvpool_connector.store import open_store
from kvpool_connector.store.eviction import ARC, LRU
from tests.conftest import SECURITY

SLOT = 64 * 1024


def k(name: str) -> bytes:
    return name.encode().ljust(32, b"\0")


def cpu_store(policy: str, slots: int):
    return open_store({"namespace": "ev", "metrics": False, "tiers": [
        {"type": "cpu", "size": slots * SLOT, "slot_size": SLOT, "eviction": policy}]})


def present(store, names) -> set[str]:
    return {n for n in names if store.contains_prefix([k(n)]) == 1}


def test_lru_evicts_least_recently_used():
    s = cpu_store("lru", 4)
    for n in "ABCD":
        s.put_many([k(n)], [os.urandom(SLOT)])
    s.get_many([k("A")])                      # A is now the most recent
    s.put_many([k("E")], [os.urandom(SLOT)])  # evicts B
    assert present(s, "ABCDE") == set("ACDE")
    assert s.stats()["tiers"]["cpu"]["evictions"] == 1
    s.close()


def test_arc_resists_a_scan_lru_does_not():
    """A, B read twice, then a one-off scan of C, D, E: ARC keeps the hot keys, LRU drops A."""
    result = {}
    for policy in ("lru", "arc"):
        s = cpu_store(policy, 4)
        s.put_many([k("A"), k("B")], [os.urandom(SLOT)] * 2)
        s.get_many([k("A"), k("B")])
        for n in "CDE":
            s.put_many([k(n)], [os.urandom(SLOT)])
        result[policy] = present(s, "ABCDE")
        s.close()
    assert result["lru"] == set("BCDE")
    assert result["arc"] == set("ABDE")


def test_arc_ghost_hit_adapts_towards_recency():
    arc = ARC(4)
    for n in "ABCD":
        arc.admit(k(n))
        arc.insert(k(n), 1)
    arc.touch(k("A"))
    victim = arc.victim()
    assert victim == k("B")                 # LRU end of the recency list
    arc.remove(victim, evicted=True)        # B becomes a ghost
    arc.admit(k("B"))                       # B asked for again: recency was evicted too early
    assert arc.p > 0
    arc.insert(k("B"), 1)
    assert k("B") in arc.t2 and k("B") not in arc.b1


def test_policies_forget_deleted_keys():
    for policy in (LRU(4), ARC(4)):
        policy.insert(k("A"), 1)
        policy.remove(k("A"), evicted=False)
        assert policy.victim() is None and len(policy) == 0


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_cpu_capacity_is_a_hard_bound(policy):
    s = cpu_store(policy, 8)
    for i in range(50):
        s.put_many([os.urandom(32)], [os.urandom(SLOT - i)])
    st = s.stats()["tiers"]["cpu"]
    assert st["objects"] == 8 and st["used_bytes"] <= 8 * SLOT and st["evictions"] == 42
    s.close()


def test_cpu_multi_slot_objects_and_oversize_rejected():
    s = cpu_store("lru", 8)
    big = os.urandom(3 * SLOT + 5)  # spans 4 slots
    s.put_many([k("big")], [big])
    assert bytes(s.get_many([k("big")])[0]) == big
    out = bytearray(len(big))
    assert s.get_into(k("big"), out) == len(big) and out == big
    s.put_many([k("huge")], [os.urandom(9 * SLOT)])
    assert s.get_many([k("huge")]) == [None]
    assert s.stats()["tiers"]["cpu"]["rejected"] == 1
    s.put_many([k("x"), k("y")], [os.urandom(3 * SLOT)] * 2)  # 4 + 3 + 3 > 8: big goes
    assert present(s, ["big", "x", "y"]) == {"x", "y"}
    s.close()


def test_disk_capacity_bound_evicts_oldest(tmp_path):
    s = open_store({"namespace": "ev", "metrics": False, "security": SECURITY, "tiers": [
        {"type": "disk", "path": str(tmp_path), "size": 5 * SLOT, "rescan_seconds": 0}]})
    names = [f"o{i}" for i in range(8)]
    for n in names:
        s.put_many([k(n)], [os.urandom(SLOT - 200)])
        if n == "o4":
            s.get_many([k("o0")])  # o0 is recent again
    on_disk = sum(len(f) for _, _, f in os.walk(tmp_path / "ev"))
    st = s.stats()["tiers"]["disk"]
    assert st["used_bytes"] <= 5 * SLOT and st["objects"] == 5 and on_disk == 5
    assert present(s, names) == {"o0", "o4", "o5", "o6", "o7"}
    s.close()
