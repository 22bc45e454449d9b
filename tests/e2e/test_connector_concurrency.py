"""Many concurrent requests sharing a long system prompt, with preemption (a deliberately
small paged KV cache) and a 16k-token prompt: outputs identical to recompute."""

from __future__ import annotations

import pytest

from .conftest import PROMPTS, SYSTEM, connector_engine, full_chunk_tokens

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

NUM_BLOCKS = 256  # 32k tokens of paged KV: 64 x 2.2k-token requests must take turns


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory, baseline, namespace):  # baseline first: one engine at a time
    tiers = [{"type": "cpu", "size": "512Mi"},
             {"type": "disk", "path": str(tmp_path_factory.mktemp("conc-disk")), "size": "2Gi"}]
    with connector_engine(tiny_model, tiers, namespace,
                          num_gpu_blocks_override=NUM_BLOCKS) as eng:
        yield eng


def test_64_concurrent_requests_sharing_a_system_prompt(engine, baseline):
    warm = engine.generate([PROMPTS["conc0"]])[0]
    assert warm["num_cached_tokens"] == 0 and warm["token_ids"] == baseline["conc0"]
    names = [f"conc{i}" for i in range(64)]
    outs = engine.generate([PROMPTS[n] for n in names], timeout=600)
    mismatched = [n for n, o in zip(names, outs) if o["token_ids"] != baseline[n]]
    assert not mismatched, mismatched
    hits = [o["num_cached_tokens"] for o in outs]
    # the shared system prompt (8 chunks) comes from the pool for every request; conc0 has
    # its whole prompt stored
    assert all(h >= len(SYSTEM) for h in hits), hits
    assert hits[0] == full_chunk_tokens(PROMPTS["conc0"])


def test_16k_token_prompt_round_trip(engine, baseline):
    cold = engine.generate([PROMPTS["long16k"]])[0]
    assert cold["token_ids"] == baseline["long16k"]
    hot = engine.generate([PROMPTS["long16k"]])[0]
    assert hot["num_cached_tokens"] == full_chunk_tokens(PROMPTS["long16k"]) == 15872
    assert hot["token_ids"] == baseline["long16k"]
