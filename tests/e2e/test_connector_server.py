"""The OpenAI-compatible server with KVPoolConnector: a multi-turn chat whose every turn
reuses the previous history shows external prefix hits, per tier, on /metrics."""

from __future__ import annotations

import random
import re

import pytest

from kvpool_connector.testbed.engine import VllmServer

from .conftest import kv_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

WORDS = ("cache block layer token prefix tier disk memory redis bucket chunk engine model "
         "request stream batch vector tensor shard replica").split()


def _metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory, baseline):  # baseline first: one engine at a time
    tiers = [{"type": "cpu", "size": "256Mi"},
             {"type": "disk", "path": str(tmp_path_factory.mktemp("srv-disk")), "size": "1Gi"}]
    cfg = kv_config(tiers, "server-test")
    cfg["kv_connector_extra_config"]["chunk_tokens"] = 128
    with VllmServer(tiny_model, kv_transfer_config=cfg,
                    extra_args=["--no-enable-prefix-caching"]) as srv:
        yield srv


def test_multi_turn_chat_shows_external_hits_per_tier_on_metrics(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    rng = random.Random(5)
    system = " ".join(rng.choice(WORDS) for _ in range(900))
    messages = [{"role": "system", "content": system}]
    cached = []
    for turn in range(4):
        messages.append({"role": "user", "content": f"Turn {turn}: " +
                         " ".join(rng.choice(WORDS) for _ in range(60))})
        r = client.chat.completions.create(model="local", messages=messages, max_tokens=24,
                                           temperature=0)
        assert r.choices[0].message.content is not None
        details = r.usage.prompt_tokens_details
        cached.append(details.cached_tokens if details else 0)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    assert cached[0] == 0
    assert all(c >= 128 * 7 for c in cached[1:]), cached  # the long history comes back

    text = server.metrics()
    assert _metric(text, "vllm:external_prefix_cache_hits_total") >= sum(cached[1:])
    # vLLM's own per-source split: the history came from host memory (the cpu tier)
    assert _metric(text, "vllm:prompt_tokens_cached_by_source_total", source="host") > 0
    assert _metric(text, "kvpool_tier_hit_chunks_total", tier="cpu") >= 7 * 3
    assert _metric(text, "kvpool_saved_chunks_total") > 0
    assert _metric(text, "kvpool_loaded_chunks_total") >= 7 * 3
    assert _metric(text, "kvpool_lookups_total") >= 4
    assert not re.search(r'^kvpool_load_error_chunks_total\{[^}]*\} [1-9]', text, re.M)
