"""Proof that the test bed is real: a vLLM engine on the generated model, the OpenAI API,
and vLLM's in-tree ExampleConnector as the cross-process baseline kvpool must beat."""

from __future__ import annotations

import random

import pytest

from kvpool_connector.testbed.engine import OfflineEngine, VllmServer

pytestmark = pytest.mark.vllm


def _token_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(n)]


@pytest.fixture(scope="module")
def plain_server(tiny_model):
    with VllmServer(tiny_model) as server:
        yield server


def test_openai_completions_and_chat(plain_server):
    from openai import OpenAI

    client = OpenAI(base_url=plain_server.base_url + "/v1", api_key="unused")
    comp = client.completions.create(model="local", prompt="The KV cache", max_tokens=8, temperature=0)
    assert comp.choices[0].text, "empty completion"
    assert comp.usage.completion_tokens == 8
    chat = client.chat.completions.create(
        model="local", messages=[{"role": "user", "content": "Say something about caches."}],
        max_tokens=8, temperature=0,
    )
    assert chat.choices[0].message.content is not None
    assert chat.usage.prompt_tokens > 5  # the chat template wrapped the message


def test_example_connector_cross_process_hit_is_token_identical(plain_server, tiny_model, tmp_path):
    """A fresh engine process loads a 2k-token prefix that another process saved."""
    import requests

    prompt = _token_prompt(2048, seed=7)
    # Recompute baseline without any connector (greedy).
    r = requests.post(plain_server.base_url + "/v1/completions", timeout=300, json={
        "model": "local", "prompt": prompt, "max_tokens": 16, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True,
    })
    r.raise_for_status()
    baseline = r.json()["choices"][0]["token_ids"]
    assert len(baseline) == 16

    kv = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
          "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "example")}}
    with OfflineEngine(tiny_model, kv_transfer_config=kv) as first:
        cold = first.generate([prompt], max_tokens=16)[0]
    assert cold["num_cached_tokens"] == 0
    assert cold["token_ids"] == baseline

    with OfflineEngine(tiny_model, kv_transfer_config=kv) as second:
        hit = second.generate([prompt], max_tokens=16)[0]
    assert hit["num_cached_tokens"] >= 1900, hit["num_cached_tokens"]
    assert hit["token_ids"] == baseline
