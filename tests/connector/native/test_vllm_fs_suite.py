"""vLLM 0.32's own file-system tier tests (its sdist's tests/v1/kv_offload/tiering/test_fs_tier.py,
fetched and checked by `make setup`, never copied here), run against kvpool's native-mode tier.

The only adaptation is what the tests construct: `FileSystemTierManager(root_dir=...)` builds
a `KVPoolTier` whose store is one kvpool disk tier at `root_dir`, and the fs tier's introspection
points name kvpool's equivalents (`file_mapper.get_file_name`: the object's file;
`_lookup_manager`; `_use_o_direct`; `_store_job_keys`). Everything else is vLLM's test code and
assertions, unchanged. Where kvpool differs on purpose the test is a strict xfail naming the
difference (it must keep failing; docs/connector.md, "vLLM's own tier tests").
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from kvpool_connector.native.tier import KVPoolTier
from tests.conftest import SECURITY, skip_or_fail

SUITE = (Path(__file__).parents[3] / ".cache/vllm-0.32.0-tests/tests/v1/kv_offload/tiering/test_fs_tier.py")
NAMESPACE = "vllm-fs-suite"

# kvpool differs from vLLM's fs tier here on purpose (strict xfails: each must keep failing).
DIFFERENCES = {
    "test_factory_forwards_locality_to_fs_tier":
        "vLLM's factory builds its own tier for type 'fs'; kvpool's tier is built by its "
        "module_path (type 'kvpool', tests/connector/native/test_spec.py)",
    "test_batched_load_first_block_fails_marks_whole_batch":
        "a failed batch load names exactly the chunks that loaded, whichever failed (any "
        "subset, as JobResult.successful_keys allows: kvpool loads a job's chunks together), "
        "where vLLM's fs tier stops at the first bad block and reports None",
    "test_transient_load_failure_leaves_file":
        "a link planted at an object's path is deleted (opened O_NOFOLLOW, it is a miss and "
        "is removed): nothing but the tier's own regular files lives in its directory",
    "test_mixed_job_results_emit_event_only_for_successful_job":
        "the failure is injected by patching vLLM's fs I/O function, which kvpool's tier does "
        "not call; kvpool's counterpart injects a real failing backend "
        "(test_tier_contract.py::test_one_failed_store_job_fails_alone and the events tests)",
    "test_partially_failed_store_emits_no_event":
        "the failure is injected by patching vLLM's fs I/O function, which kvpool's tier does "
        "not call (kvpool's counterpart: test_tier_contract.py, a store that did not land)",
}


def _load_suite() -> Any:
    if not SUITE.exists():
        return None
    spec = importlib.util.spec_from_file_location("vllm_0_32_test_fs_tier", SUITE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _disk(tier: KVPoolTier) -> Any:
    (disk,) = [r.tier for r in tier.store.runners if r.tier.type == "disk"]
    return disk


class _ObjectFiles:
    """The fs tier's `file_mapper`, as far as vLLM's tests use it: where a key's object lives,
    and `base_path`, one per key space (kvpool's key prefix: the layout fingerprint's digest)."""

    def __init__(self, tier: KVPoolTier) -> None:
        self._tier = tier
        self.base_path = os.path.join(_disk(tier).root, f"layout-{tier.store_key(b'').hex()}")

    def get_file_name(self, key: Any) -> str:
        (name,) = self._tier.store.object_names([self._tier.store_key(key)])
        return str(_disk(self._tier).path(name))


class KVPoolFsTier(KVPoolTier):
    """vLLM's `FileSystemTierManager(offloading_spec, primary_kv_view, tier_type, root_dir, ...)`
    signature over kvpool's tier with one disk tier at `root_dir`."""

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str, root_dir: str,
                 n_read_threads: int = 4, n_write_threads: int = 4, enable_kv_events: bool = False,
                 locality: str | None = None, backpressure_detector: Any = None, **_fs_options: Any) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, n_read_threads, n_write_threads,
                         enable_kv_events, locality, backpressure_detector, namespace=NAMESPACE,
                         security=SECURITY, tiers=[{"type": "disk", "path": root_dir, "size": "1Gi",
                                                    "rescan_seconds": 0}])
        self.file_mapper = _ObjectFiles(self)

    @property
    def _lookup_manager(self) -> Any:
        return self._lookup

    @property
    def _use_o_direct(self) -> bool:
        return bool(_disk(self)._direct)

    @property
    def _store_job_keys(self) -> dict:
        return {job: keys for job, (is_load, keys) in self._job_keys.items() if not is_load}


suite = _load_suite()
if suite is None:
    def test_vllm_fs_tier_suite_is_present():
        skip_or_fail(f"{SUITE} is missing: run `make setup` (it fetches vLLM 0.32.0's sdist)")
else:
    suite.FileSystemTierManager = KVPoolFsTier
    for _name in dir(suite):
        _obj = getattr(suite, _name)
        if _name.startswith("test_") and callable(_obj):
            if _name in DIFFERENCES:
                _obj = pytest.mark.xfail(strict=True, reason=DIFFERENCES[_name])(_obj)
            globals()[_name] = _obj
        elif _name in ("fs_tier", "fs_tier_with_events"):
            globals()[_name] = _obj
