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


# -- evict-first objects (the connector's tails) ------------------------------------------------

def is_tail(key: bytes) -> bool:
    return key.startswith(b"tail")


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_full_cpu_tier_evicts_tails_before_chunks(policy):
    """Chunks A, B and tails t1, t2 fill 4 slots; each new chunk evicts a tail (the least
    recently used one: t2 after t1 was read), only then chunks, by the policy."""
    s = cpu_store(policy, 4)
    s.set_evict_first(is_tail)
    s.put_many([k("A"), k("tail1"), k("tail2"), k("B")], [os.urandom(SLOT)] * 4)
    s.get_many([k("tail1")])
    s.put_many([k("C")], [os.urandom(SLOT)])
    assert present(s, ["A", "B", "C", "tail1", "tail2"]) == {"A", "B", "C", "tail1"}
    s.put_many([k("D")], [os.urandom(SLOT)])
    assert present(s, ["A", "B", "C", "D", "tail1"]) == {"A", "B", "C", "D"}
    s.put_many([k("E")], [os.urandom(SLOT)])  # no tail left: the policy's victim
    assert len(present(s, "ABCDE")) == 4 and "E" in present(s, "E")
    assert s.stats()["tiers"]["cpu"]["evictions"] == 3
    s.close()


def test_a_tail_stored_again_as_a_chunk_is_a_chunk():
    """The mark follows the latest write of a name (a predicate changed: no stale mark)."""
    s = cpu_store("lru", 2)
    s.set_evict_first(is_tail)
    s.put_many([k("A"), k("tailX")], [os.urandom(SLOT)] * 2)
    s.set_evict_first(None)
    s.put_many([k("tailX")], [os.urandom(SLOT)])  # rewritten, unmarked, most recent
    s.put_many([k("B")], [os.urandom(SLOT)])
    assert present(s, ["A", "B", "tailX"]) == {"B", "tailX"}
    s.close()


def test_a_full_disk_tier_evicts_tails_before_chunks(tmp_path):
    s = open_store({"namespace": "ev", "metrics": False, "security": SECURITY, "tiers": [
        {"type": "disk", "path": str(tmp_path), "size": 4 * SLOT, "rescan_seconds": 0}]})
    s.set_evict_first(is_tail)
    for n in ("A", "tail1", "tail2", "B"):
        s.put_many([k(n)], [os.urandom(SLOT - 200)])
    s.put_many([k("C")], [os.urandom(SLOT - 200)])
    assert present(s, ["A", "B", "C", "tail1", "tail2"]) == {"A", "B", "C", "tail2"}
    s.put_many([k("D")], [os.urandom(SLOT - 200)])
    s.put_many([k("E")], [os.urandom(SLOT - 200)])  # tails gone: the oldest chunk, A
    assert present(s, ["A", "B", "C", "D", "E", "tail2"]) == {"B", "C", "D", "E"}
    assert s.stats()["tiers"]["disk"]["evictions"] == 3
    s.close()


def test_a_tail_promoted_from_disk_into_cpu_stays_evict_first(tmp_path):
    """A lower-tier hit copied into the cpu tier keeps its mark there."""
    s = open_store({"namespace": "ev", "metrics": False, "security": SECURITY, "tiers": [
        {"type": "cpu", "size": 2 * SLOT, "slot_size": SLOT},
        {"type": "disk", "path": str(tmp_path), "size": 64 * SLOT, "rescan_seconds": 0}]})
    s.set_evict_first(is_tail)
    s.put_many([k("tail1"), k("A"), k("B")], [os.urandom(SLOT - 200)] * 3)
    assert s.flush(10)
    cpu = s.runners[0].tier
    assert not any(cpu.contains_many(s.object_names([k("tail1")])))  # evicted first
    assert s.get_many([k("tail1")])[0] is not None  # from disk, promoted (evicts A)
    s.put_many([k("C")], [os.urandom(SLOT - 200)])  # evicts the promoted tail, not B
    assert cpu.contains_many(s.object_names([k("B"), k("C"), k("tail1")])) == [
        True, True, False]
    s.close()


def _disk_store(path, slots: int):
    return open_store({"namespace": "ev", "metrics": False, "security": SECURITY, "tiers": [
        {"type": "disk", "path": str(path), "size": slots * SLOT, "rescan_seconds": 0}]})


def _paths(store, names) -> dict[str, str]:
    """name -> the disk tier's file of it."""
    tier = store.runners[0].tier
    return {n: tier.path(store.object_names([k(n)])[0]) for n in names}


def test_a_reopened_disk_tier_still_evicts_tails_first(tmp_path):
    """The mark lives with the file (its mode), so a restarted engine's scan finds it: the
    tails, the most recent files here, go before the older chunks."""
    s = _disk_store(tmp_path, 4)
    s.set_evict_first(is_tail)
    names = ["A", "B", "tail1", "tail2"]
    for n in names:
        s.put_many([k(n)], [os.urandom(SLOT - 200)])
    paths = _paths(s, names)
    s.close()
    for age, n in enumerate(names):  # oldest first, whatever the clock's resolution
        os.utime(paths[n], (1_000_000 + age, 1_000_000 + age))
    again = _disk_store(tmp_path, 4)  # no predicate: the files alone say what goes first
    again.put_many([k("C")], [os.urandom(SLOT - 200)])
    assert present(again, names + ["C"]) == {"A", "B", "tail2", "C"}
    again.put_many([k("D")], [os.urandom(SLOT - 200)])
    assert present(again, names + ["C", "D"]) == {"A", "B", "C", "D"}
    assert again.get_many([k("A")])[0] is not None
    again.close()


def test_a_forged_mark_changes_only_the_eviction_order(tmp_path):
    """Anyone who can write the directory can flip an object's mode: the object then goes
    first (or last), and is still served only if its tag checks out, like any other."""
    s = _disk_store(tmp_path, 3)
    s.set_evict_first(is_tail)
    data = {n: os.urandom(SLOT - 200) for n in ("A", "tail1", "B")}
    for n, payload in data.items():
        s.put_many([k(n)], [payload])
    path = _paths(s, data)
    s.close()
    for age, n in enumerate(data):
        os.utime(path[n], (1_000_000 + age, 1_000_000 + age))
    os.chmod(path["tail1"], 0o600)  # unmarked: now a plain, newer object than A
    os.chmod(path["B"], 0o400)      # marked: a chunk made to go first
    again = _disk_store(tmp_path, 3)
    assert [bytes(again.get(k(n))) for n in data] == list(data.values())  # all still served
    again.put_many([k("C")], [os.urandom(SLOT - 200)])
    assert present(again, [*data, "C"]) == {"A", "tail1", "C"}
    assert again.stats()["tiers"]["disk"]["corrupt"] == 0
    again.close()


def test_a_tail_another_process_wrote_is_evicted_first_once_found(tmp_path):
    """A store sharing the directory (the engine's scheduler and workers) learns a file's mark
    when a presence check or a read finds it, before any rescan."""
    reader = _disk_store(tmp_path, 3)  # opened first: its scan found nothing
    writer = _disk_store(tmp_path, 8)
    writer.set_evict_first(is_tail)
    for n in ("A", "tail1", "B"):
        writer.put_many([k(n)], [os.urandom(SLOT - 200)])
    writer.close()
    assert reader.contains_prefix([k("A"), k("tail1")]) == 2  # stat'ed: learned
    assert reader.get(k("B")) is not None                     # read: learned
    reader.put_many([k("C")], [os.urandom(SLOT - 200)])
    assert present(reader, ["A", "B", "C", "tail1"]) == {"A", "B", "C"}
    reader.close()


def test_slot_index_makes_room_evict_first_then_by_policy_without_bytes():
    """The cpu tier's bookkeeping alone (what `kvpool plan` replays traces through)."""
    from kvpool_connector.store.slots import SlotIndex

    idx = SlotIndex(capacity=3 * 4096, eviction="lru")
    for name, first in ((b"a", False), (b"tail", True), (b"b", False)):
        t = idx.take(name, 4000)   # the first object sizes the slots: 4000 -> 4096
        assert t is not None and t.evicted == 0 and len(t.slots) == 1
        idx.commit(name, t.slots, 4000, b"L", evict_first=first)
    assert (idx.slot_size, idx.nslots, idx.used_bytes()) == (4096, 3, 3 * 4096)
    idx.touch(b"a")
    t = idx.take(b"c", 100)        # the tail goes first, though "b" is older than "a"
    assert t is not None and t.released == [b"tail"] and t.evicted == 1
    idx.commit(b"c", t.slots, 100, b"L", evict_first=False)
    t = idx.take(b"d", 8000)       # two slots: then LRU order, "b" and then "a"
    assert t is not None and t.released == [b"b", b"a"] and t.evicted == 2
    idx.give_back(t.slots)         # not committed: nothing of "d" held
    assert set(idx.entries) == {b"c"} and idx.free_slots() == 2
    t = idx.take(b"c", 100)        # the same name again: replaced, not an eviction
    assert t is not None and t.released == [b"c"] and t.evicted == 0
    assert idx.take(b"huge", 4 * 4096) is None  # larger than the arena: nothing changes


def test_a_huge_slot_index_lists_no_free_slots_up_front():
    """A planned tier of an exbibyte (kvpool plan --cpu 1Ei) is as cheap as a small one."""
    from kvpool_connector.store.slots import SlotIndex

    idx = SlotIndex(capacity=1 << 60, eviction="arc", slot_size=4096)
    assert idx.nslots == 1 << 48 and idx.free_slots() == 1 << 48
    t = idx.take(b"a", 4096)
    assert t is not None and t.slots == (0,)
    idx.commit(b"a", t.slots, 4096, b"L", evict_first=False)
    assert idx.used_bytes() == 4096
    idx.release(b"a", evicted=False)
    assert idx.take(b"b", 8192).slots == (0, 1)   # the freed slot first, then a fresh one
