"""The test bed's generated models: the hybrid preset is what vLLM's hybrid KV cache manager
sees in a Gemma-3-style model (sliding-window layers beside full attention, issue 58)."""

from __future__ import annotations

import json

from kvpool_dev.testbed.localmodel import PRESETS, ensure_model, kv_bytes_per_token


def test_the_hybrid_preset_has_sliding_window_and_full_attention_layers(tmp_path):
    model = ensure_model("hybrid", tmp_path)
    config = json.loads((model / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"]
    assert config["sliding_window"] == PRESETS["hybrid"].sliding_window == 256
    assert config["head_dim"] * config["num_attention_heads"] == config["hidden_size"]
    # the tokens' KV over every layer (what HMA off allocates for each token of a request)
    assert kv_bytes_per_token(config, "bfloat16") == 2 * 4 * 2 * 32 * 2
    assert ensure_model("hybrid", tmp_path) == model  # built once
