"""Every rank's part of a chunk under its own key; a hit only when every part is there; a
LoRA adapter's key space from its files' content (keys.py "Ranks" and "Adapters")."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from kvpool_connector.connector.adapters import PENDING, AdapterDigests
from kvpool_connector.connector.config import load_connector_config
from kvpool_connector.connector.keys import KeySpace, chunk_keys, rank_key
from kvpool_connector.connector.metadata import KVPoolWorkerMetadata
from kvpool_connector.connector.ranks import AllRanksLookup, RankedStore
from kvpool_connector.connector.scheduler import SchedulerSide
from kvpool_connector.store import open_store
from tests.conftest import SECURITY
from tests.connector.connector.helpers import BPC, BS, PREFIX, make_request

SPACE = KeySpace("t", "m", "h", "v", "bf16", "fp", 2, "sha256", 256, pp_size=2,
                 pp_layers="0-1,1-2")
TAGS = SPACE.rank_tags()


def _disk(tmp_path, **kw):
    return open_store({"namespace": "t", "security": SECURITY,
                       "tiers": [{"type": "disk", "path": str(tmp_path), "size": "16Mi"}]},
                      layout="fp", **kw)


def test_each_rank_stores_its_part_under_its_key_and_reads_back_its_own(tmp_path):
    store = _disk(tmp_path)
    keys = chunk_keys(SPACE.prefix(), [bytes([i]) * 32 for i in range(4)], BPC)
    ranks = [RankedStore(store, t) if t else store for t in TAGS]
    for i, r in enumerate(ranks):
        assert r.put_many_through(keys, [bytes([i]) * 64] * 2)[1] == [True, True]
    for i, r in enumerate(ranks):  # every rank gets its own bytes back, never another's
        assert [bytes(p) for p in r.get_many(keys)] == [bytes([i]) * 64] * 2
    store.close()


def test_a_chunk_missing_one_ranks_part_is_a_miss_for_the_request(tmp_path):
    store = _disk(tmp_path)
    keys = chunk_keys(SPACE.prefix(), [bytes([i]) * 32 for i in range(6)], BPC)
    for t in TAGS:
        (RankedStore(store, t) if t else store).put_many_through(keys, [b"x" * 64] * 3)
    store.delete_many([rank_key(keys[1], TAGS[3])])  # the last rank lost chunk 1
    lookup = AllRanksLookup(store, TAGS)
    assert lookup.contains_prefix(keys) == 1
    # (a disk tier's answer ends at its first miss: asked apart, chunk 2 is whole)
    assert lookup.contains_many(keys[:2]) == [True, False]
    assert lookup.contains_many(keys[2:]) == [True]
    assert lookup.first_present([keys[1], keys[2]]) == 1  # rank 0 has keys[1]: not enough
    assert lookup.first_present([keys[1]]) is None
    store.close()


def test_a_replica_reads_the_shared_tier_but_never_writes_it(tmp_path):
    """MLA: tensor rank 1 holds the same latent KV as rank 0, which alone writes it."""
    shared = {"type": "disk", "path": str(tmp_path / "shared"), "size": "16Mi"}
    cfg = {"namespace": "t", "security": SECURITY,
           "tiers": [{"type": "cpu", "size": "16Mi"}, shared]}
    writer, replica = open_store(cfg, layout="fp"), open_store(cfg, layout="fp",
                                                              shared_writes=False)
    keys = [PREFIX + bytes([i]) * 32 for i in range(2)]
    assert replica.put_many_through(keys, [b"r" * 64] * 2) == ([True, True], [True, True])
    replica.flush(timeout=5)
    assert not any(writer.contains_many(keys))  # rank 1's copy stayed in its own memory
    assert [bytes(p) for p in replica.get_many(keys)] == [b"r" * 64] * 2  # its cpu tier
    writer.put_many_through(keys, [b"w" * 64] * 2)
    fresh = open_store(cfg, layout="fp", shared_writes=False)
    assert [bytes(p) for p in fresh.get_many(keys)] == [b"w" * 64] * 2  # read from disk
    for s in (writer, replica, fresh):
        s.close()
    only_shared = open_store({"namespace": "t", "security": SECURITY, "tiers": [shared]},
                             layout="fp", shared_writes=False)
    other = [PREFIX + b"\x09" * 32]
    assert only_shared.put_many_through(other, [b"z" * 64])[1] == [True]
    only_shared.flush(timeout=5)
    assert only_shared.contains_many(other) == [False]
    only_shared.close()


def _side(tmp_path, world_size: int) -> SchedulerSide:
    cfg = load_connector_config({"namespace": "t", "security": SECURITY,
                                 "tiers": [{"type": "cpu", "size": "64Mi"},
                                           {"type": "disk", "path": str(tmp_path),
                                            "size": "64Mi"}]})
    lower = open_store(cfg.as_store_config(drop_types=("cpu",)), layout="fp")
    return SchedulerSide(cfg, PREFIX, BS, BPC, chunk_bytes=1 << 20, world_size=world_size,
                         lower_store=lower, block_ids=lambda rid: [], is_async=True)


def test_a_chunk_is_a_hit_once_every_worker_reported_its_part(tmp_path):
    side = _side(tmp_path, world_size=4)
    req = make_request("r", 1000)
    keys = chunk_keys(PREFIX, req.block_hashes, BPC)
    side.on_worker_meta(KVPoolWorkerMetadata(stored_keys=keys[:2] * 3))  # 3 of 4 workers
    assert side.num_matched(req, 0) == (0, False)
    side.on_worker_meta(KVPoolWorkerMetadata(stored_keys=[keys[1], keys[0]]))  # the 4th
    side.reqs.clear()
    assert side.num_matched(make_request("r2", 1000), 0) == (512, False)
    # one worker dropped its part of chunk 2: never a hit, whatever the others report
    side.on_worker_meta(KVPoolWorkerMetadata(stored_keys=[keys[2]], dropped_keys=[keys[2]]))
    side.on_worker_meta(KVPoolWorkerMetadata(stored_keys=[keys[2]] * 3))
    side.reqs.clear()
    assert side.num_matched(make_request("r3", 1000), 0) == (512, False)
    side.close()
    side.lower.close()


def _request(path):
    return SimpleNamespace(lora_name="sql", lora_path=str(path), lora_int_id=1)


def _adapter(path, weights: bytes):
    """Write an adapter's config and weights at `path`; its LoRA request."""
    path.mkdir(exist_ok=True)
    (path / "adapter_config.json").write_text('{"r": 8}')
    (path / "adapter_model.safetensors").write_bytes(weights)
    return _request(path)


def settled(digests: AdapterDigests, request):
    """digest() once the adapter's files were digested (on the digest thread)."""
    got = digests.digest(request)
    if got is PENDING:
        assert digests.wait(30), "the digest did not finish"
        got = digests.digest(request)
    return got


def admitted(side: SchedulerSide, request):
    """The request's record once its adapter's digest is known (num_matched held it back
    until then)."""
    record = side.request_record(request)
    side._adapters.wait(30)
    side.num_matched(request, 0)
    assert record.adapter_wait_since is None
    return record


def test_an_adapter_rewritten_at_its_path_gets_a_new_key_space_in_a_fresh_engine(tmp_path):
    running = AdapterDigests()
    v1 = settled(running, _adapter(tmp_path / "a", b"1" * 4096))
    assert v1 is not None and settled(running, _adapter(tmp_path / "a", b"1" * 4096)) == v1
    st = os.stat(tmp_path / "a" / "adapter_model.safetensors")
    _adapter(tmp_path / "a", b"2" * 4096)  # same name, path and size
    os.utime(tmp_path / "a" / "adapter_model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns))
    v2 = settled(AdapterDigests(), _adapter(tmp_path / "a", b"2" * 4096))  # a fresh engine: content
    assert v2 is not None and v2 != v1
    assert settled(AdapterDigests(), _adapter(tmp_path / "b", b"1" * 4096)) == v1  # not the path


def test_an_adapter_changed_while_the_engine_runs_stays_out_of_the_pool(tmp_path):
    """The running engine may still hold v1 in its LoRA cache and compute v1's KV: saved under
    v2's digest, a fresh engine would load it for v2 (before, the running engine switched to
    v2's key space at once). Out of the pool until the engine restarts, said once."""
    changes: list[int] = []
    running = AdapterDigests(on_changed=lambda: changes.append(1))
    assert settled(running, _adapter(tmp_path / "a", b"1" * 4096)) is not None
    _adapter(tmp_path / "a", b"2" * 4096)
    assert settled(running, _adapter(tmp_path / "a", b"2" * 4096)) is None
    assert settled(running, _adapter(tmp_path / "a", b"1" * 4096)) is None  # even back to v1
    assert changes == [1]
    assert settled(running, _adapter(tmp_path / "b", b"1" * 4096)) is not None  # another path


def test_the_scheduler_keeps_a_changed_adapters_requests_out_and_counts_it(tmp_path):
    side = _side(tmp_path / "pool", world_size=1)
    first = make_request("a", 1000)
    first.lora_request = _adapter(tmp_path / "a", b"1" * 4096)
    assert admitted(side, first).prefix not in (b"", PREFIX)
    later = make_request("b", 1000)
    later.lora_request = _adapter(tmp_path / "a", b"2" * 4096)
    assert admitted(side, later).prefix == b""  # neither looked up nor saved
    assert side.num_matched(later, 0) == (0, False)
    assert side.stats.data["kvpool_lora_adapters_changed"] == {"": 1}
    side.close()
    side.lower.close()


def test_an_in_place_rewrite_keeping_size_mtime_and_inode_is_seen(tmp_path):
    """`cp -p` / `rsync --inplace -t`: the same inode, size and mtime; the ctime moves."""
    running = AdapterDigests()
    assert settled(running, _adapter(tmp_path / "a", b"1" * 4096)) is not None
    weights = tmp_path / "a" / "adapter_model.safetensors"
    st = os.stat(weights)
    with open(weights, "r+b") as f:
        f.write(b"2" * 4096)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = os.stat(weights)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)
    assert settled(running, _request(tmp_path / "a")) is None


def test_only_the_files_vllm_loads_make_the_identity_and_a_huge_adapter_has_none(tmp_path, monkeypatch):
    from kvpool_connector.connector import adapters

    v1 = settled(AdapterDigests(), _adapter(tmp_path / "a", b"1" * 4096))
    (tmp_path / "a" / "README.md").write_text("notes")
    (tmp_path / "a" / "adapter_model.bin").write_bytes(b"not loaded: safetensors comes first")
    assert settled(AdapterDigests(), _request(tmp_path / "a")) == v1
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "adapter_config.json").write_text('{"r": 8}')
    assert settled(AdapterDigests(), _request(tmp_path / "c")) is None  # no weights
    monkeypatch.setattr(adapters, "MAX_BYTES", 1024)
    assert settled(AdapterDigests(), _request(tmp_path / "a")) is None


def test_requests_of_an_adapter_use_its_prefix_and_an_unknown_one_stays_out(tmp_path):
    side = _side(tmp_path / "pool", world_size=1)
    plain = make_request("p", 1000)
    with_v1 = make_request("a", 1000)
    with_v1.lora_request = _adapter(tmp_path / "a", b"1" * 4096)
    remote = make_request("h", 1000)
    remote.lora_request = SimpleNamespace(lora_name="hub", lora_path="org/adapter",
                                          lora_int_id=2)
    side.on_worker_meta(KVPoolWorkerMetadata(
        stored_keys=chunk_keys(PREFIX, plain.block_hashes, BPC)))
    rp, ra, rh = (admitted(side, r) for r in (plain, with_v1, remote))
    assert rp.prefix == PREFIX and ra.prefix not in (b"", PREFIX) and rh.prefix == b""
    assert side.num_matched(plain, 0)[0] == 768
    assert side.num_matched(with_v1, 0) == (0, False)  # the plain prompt's KV is not its
    assert side.num_matched(remote, 0) == (0, False)
    side.close()
    side.lower.close()


def _slow_digest(monkeypatch):
    """adapters._digest held until the returned Event is set; the threads it ran on."""
    import threading

    from kvpool_connector.connector import adapters

    release, threads = threading.Event(), []
    real = adapters._digest

    def held(root, files):
        threads.append(threading.current_thread().name)
        release.wait(10)
        return real(root, files)

    monkeypatch.setattr(adapters, "_digest", held)
    return release, threads


def test_an_adapters_files_are_digested_off_the_scheduler_thread(tmp_path, monkeypatch):
    """A large adapter's digest used to run inside the engine core's scheduling step (every
    request waited). Now its request is held back (its lookup is in flight) while the digest
    thread reads the files, then looked up in the adapter's key space."""
    release, threads = _slow_digest(monkeypatch)
    side = _side(tmp_path / "pool", world_size=1)
    req = make_request("a", 1000)
    req.lora_request = _adapter(tmp_path / "a", b"1" * 4096)
    record = side.request_record(req)
    assert record.prefix == b"" and side.num_matched(req, 0) == (None, False)  # ask again
    release.set()
    assert side._adapters.wait(30)
    assert side.num_matched(req, 0) == (0, False) and record.prefix not in (b"", PREFIX)
    assert threads and all(t.startswith("kvpool-adapter-digest") for t in threads)
    side.close()
    side.lower.close()


def test_a_request_whose_adapter_is_still_digested_after_the_wait_runs_without_the_pool(
        tmp_path, monkeypatch):
    from kvpool_connector.connector import scheduler

    release, _ = _slow_digest(monkeypatch)
    monkeypatch.setattr(scheduler, "ADAPTER_WAIT_S", 0.0)
    side = _side(tmp_path / "pool", world_size=1)
    req = make_request("a", 1000)
    req.lora_request = _adapter(tmp_path / "a", b"1" * 4096)
    record = side.request_record(req)
    assert side.num_matched(req, 0) == (0, False)  # neither looked up nor, later, saved
    assert record.prefix == b"" and side._isolated(record)
    assert side.stats.data["kvpool_lora_digest_late"] == {"": 1}
    release.set()
    assert side._adapters.wait(30)
    later = make_request("b", 1000)
    later.lora_request = req.lora_request
    assert side.request_record(later).prefix not in (b"", PREFIX)  # known now: at once
    side.close()
    side.lower.close()


@pytest.mark.parametrize("attr,option", [("decode_context_parallel_size",
                                          "--decode-context-parallel-size"),
                                         ("prefill_context_parallel_size",
                                          "--prefill-context-parallel-size")])
def test_context_parallelism_is_refused_naming_the_option(attr, option):
    from kvpool_connector.connector.config import ConnectorConfigError
    from kvpool_connector.connector.connector import check_parallel_layout

    check_parallel_layout(SimpleNamespace(decode_context_parallel_size=1,
                                          prefill_context_parallel_size=1))
    with pytest.raises(ConnectorConfigError, match=f"{option} > 1") as e:
        check_parallel_layout(SimpleNamespace(**{"decode_context_parallel_size": 1,
                                                 "prefill_context_parallel_size": 1,
                                                 attr: 2}))
    assert "\n" not in str(e.value)


def test_workers_reports_add_up_one_entry_per_worker():
    """vLLM aggregates the workers' metadata (KVOutputAggregator) before the scheduler
    sees it: each worker's report of a chunk must survive, or no chunk ever completes."""
    k = PREFIX + b"\x01" * 32
    a, b = KVPoolWorkerMetadata(stored_keys=[k]), KVPoolWorkerMetadata(stored_keys=[k])
    assert a.aggregate(b).stored_keys == [k, k]


def test_every_store_method_that_takes_keys_is_rewritten_to_the_rank_and_no_other_passes(tmp_path):
    """RankedStore passed every method it did not wrap through with logical keys: `get`,
    `put`, `get_into`, `first_present` on rank 1 read or wrote rank 0's part with a valid MAC."""
    import inspect

    from kvpool_connector.connector.ranks import KEYLESS
    from kvpool_connector.store.tiered import TieredStore

    public = {n for n, f in inspect.getmembers(TieredStore, inspect.isfunction) if not n.startswith("_")}
    wrapped = {n for n in vars(RankedStore) if not n.startswith("_")} - {"own"}
    assert public <= wrapped | KEYLESS, public - wrapped - KEYLESS  # a new store method is classified
    assert not (wrapped & KEYLESS)
    store = _disk(tmp_path)
    rank1 = RankedStore(store, TAGS[1])
    key = chunk_keys(SPACE.prefix(), [b"k" * 32], 1)[0]
    assert store.put(key, b"0" * 64)  # rank 0's part under the logical key
    assert rank1.get(key) is None and rank1.first_present([key]) is None
    out = bytearray(64)
    assert rank1.get_into(key, out) is None
    assert rank1.put(key, b"1" * 64) and bytes(rank1.get(key)) == b"1" * 64
    assert bytes(store.get(key)) == b"0" * 64  # rank 0's part untouched
    assert rank1.object_names([key]) != store.object_names([key])
    with pytest.raises(AttributeError, match="does not pass 'not_a_method' through"):
        rank1.not_a_method  # noqa: B018
    store.close()


def test_the_scheduler_waits_for_the_engines_own_workers_only():
    """Under external_launcher, vLLM's world_size counts data-parallel ranks too: with it the
    scheduler waited for reports of workers of other engines that never come."""
    from kvpool_connector.connector.ranks import reporting_workers

    dp2 = SimpleNamespace(world_size=8, tensor_parallel_size=2, pipeline_parallel_size=2,
                          data_parallel_size=2)
    assert reporting_workers(dp2) == 4
    assert reporting_workers(SimpleNamespace(world_size=1, tensor_parallel_size=1,
                                             pipeline_parallel_size=1)) == 1


def test_tokens_and_events_are_counted_by_one_worker_of_the_engine_whatever_the_layout():
    """MLA at TP 2: both tensor ranks of stage 0 use the logical keys (no rank tag), and both
    counted every token and reported every KV event (twice the engine's figures)."""
    from kvpool_connector.connector.connector import first_worker

    mla = KeySpace("t", "m", "h", "v", "bf16", "fp", 2, "sha256", 256, tp_replicas=2)
    assert [mla.rank_tag(tp, 0) for tp in (0, 1)] == [b"", b""]  # what `not rank_tag` counted
    assert [first_worker(tp, pp) for tp, pp in ((0, 0), (1, 0), (0, 1), (1, 1))] == [
        True, False, False, False]
