"""Shared pieces of the KVPoolConnector end-to-end tests.

Two oracles (see kvpool_dev.testbed.oracle):
- the KV itself, exactly: every connector engine runs with the KV audit on
  (`KVPOOL_KV_AUDIT_DIR`), and after every test each block a load wrote into a paged cache
  must equal, bit for bit, a block saved under the same chunk key and position;
- outputs against recompute, the way vLLM's own tests compare them: one plain engine (no
  connector) computes every prompt of the suite once (`baseline`), and a connector engine's
  output must be logprob-close to it (its batch schedule and prefill chunking differ).
  Exact token equality is asserted only between runs with the same schedule by
  construction (two hits of the same prompts, alone in the batch).
"""

from __future__ import annotations

import random
import time
import uuid
from pathlib import Path

import pytest

from kvpool_connector.connector.audit import AUDIT_ENV, check_audit
from kvpool_dev.testbed.engine import OfflineEngine
from kvpool_dev.testbed.oracle import check_logprobs_close
from tests.conftest import SECURITY

MAX_TOKENS = 16  # OfflineEngine.generate default
MAX_MODEL_LEN = 20000
CHUNK = 256


def dev_tool_env() -> dict[str, str]:
    """Environment of a dev-tool smoke run (demo, bench serve/chat/fleet): their API servers
    run vLLM's worker inside the engine-core process, as every OfflineEngine test does.

    Why: with V1 multiprocessing on, vLLM's CPU platform turns the `uni` executor into the
    multiprocess one, a third process per server and a third import of vLLM (8-9 s of CPU
    here, ~90 s over the smokes' ten server starts). With it off, the API server still
    runs the engine core in its own process (the stats path to /metrics is unchanged).
    The smokes test the tools' plumbing and reports; the separate-worker layout a
    production server has is covered by the dashboard tests (API servers as started in
    production) and test_connector's SEPARATE_PROCESSES engine."""
    import os

    from kvpool_dev.testbed.engine import shared_zygote_env

    # and their engines fork from this test process's zygote (testbed/zygote.py): each tool
    # importing vLLM for a zygote of its own cost what its forks saved
    return {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **shared_zygote_env()}


def token_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(n)]


SYSTEM = token_prompt(2048, seed=20)

# Every prompt the suite compares with recompute, by name.
PROMPTS: dict[str, list[int]] = {
    "a4k": token_prompt(4000, 1),
    "b4k": token_prompt(4100, 2),
    "y3k": token_prompt(3000, 3),
    **{f"fault{i}": token_prompt(3000, 10 + i) for i in range(5)},
    **{f"conc{i}": SYSTEM + token_prompt(120, 100 + i) for i in range(64)},
    "long16k": token_prompt(16000, 30),
    # 3841 tokens: a hit of 3840 is 15 whole chunks and 30 whole blocks, so a paged
    # prefix-cache hit and a native host-tier hit have the same schedule (test_native.py)
    "aligned": token_prompt(3841, 4),
    # the same shape, each left in only one of kvpool's backends for a fresh engine to find
    **{f"aligned-{b}": token_prompt(3841, 40 + i) for i, b in enumerate(("disk", "redis", "s3"))},
    # 380 tokens: one 256-token chunk and 3 of vLLM's 128-token blocks; decoding crosses into
    # a 4th block, so 20 at once overflow a small paged cache (test_native.py's preemptions)
    **{f"preempt{i}": token_prompt(380, 300 + i) for i in range(20)},
}


def full_chunk_tokens(prompt: list[int], chunk: int = CHUNK) -> int:
    """Tokens of the complete chunks a hit can cover (the last prompt token is computed)."""
    return (len(prompt) - 1) // chunk * chunk


def chunks_of(name: str) -> int:
    return len(PROMPTS[name]) // CHUNK


def kv_config(tiers: list[dict], namespace: str, **extra) -> dict:
    return {"kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool_connector.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"namespace": namespace, "chunk_tokens": CHUNK,
                                          "tiers": tiers, "security": SECURITY,
                                          # moto and Redis on 2 busy cores: no drops or
                                          # misses from a 0.5 s bound meant for production
                                          "timeout_seconds": 5.0, **extra}}


def connector_engine(model: Path, tiers: list[dict], namespace: str, env: dict | None = None,
                     audit_dir: Path | None = None, **kwargs) -> OfflineEngine:
    """An engine with KVPoolConnector; with `audit_dir`, its workers record the KV audit."""
    extra = kwargs.pop("extra", {})
    kwargs.setdefault("enable_prefix_caching", False)  # every hit must come from the pool
    kwargs.setdefault("max_model_len", MAX_MODEL_LEN)
    env = dict(env or {})
    if audit_dir is not None:
        env[AUDIT_ENV] = str(audit_dir)
    return OfflineEngine(model, kv_transfer_config=kv_config(tiers, namespace, **extra),
                         env=env, **kwargs)


def wait_until(pred, timeout: float = 60.0, what: str = "condition"):
    """Poll `pred` until it returns something truthy (bounded): lower tiers are written
    behind the forward pass, so their contents are waited for, never read once."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.25)


@pytest.fixture(scope="session")
def plain_engine(tiny_model):
    """The engine without any connector that engine modules compare with, started once per
    xdist worker and idle in between (an engine start is ~10 s of CPU on 2 cores)."""
    with OfflineEngine(tiny_model, max_model_len=MAX_MODEL_LEN) as eng:
        yield eng


@pytest.fixture(scope="session")
def baseline(plain_engine) -> dict[str, dict]:
    """Outputs (tokens and top-k logprobs) of every prompt in PROMPTS from an engine without
    any connector."""
    names = list(PROMPTS)
    outs = plain_engine.generate([PROMPTS[n] for n in names], max_tokens=MAX_TOKENS)
    return dict(zip(names, outs, strict=True))


def assert_close_to_baseline(outs: list[dict], names: list[str], baseline: dict[str, dict],
                             label: str = "") -> None:
    check_logprobs_close(outs, [baseline[n] for n in names], names=names, label=label)


@pytest.fixture(scope="session")
def audit_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kv-audit")


class Audit:
    """The KV audit of every connector engine of the session (see the module docstring)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def check(self) -> int:
        """Blocks loaded so far; fails if any of them differs from what was saved."""
        n, problems = check_audit(self.directory)
        assert not problems, f"{len(problems)} loaded KV blocks differ from the saved ones:\n  " \
                             + "\n  ".join(problems[:20])
        return n


@pytest.fixture(scope="session")
def audit(audit_dir) -> Audit:
    return Audit(audit_dir)


@pytest.fixture(scope="module")
def namespace() -> str:
    return "e2e-" + uuid.uuid4().hex[:10]


def redis_tier(redis_server) -> dict:
    return {"type": "redis", "url": redis_server.url, "password_env": "KVPOOL_TEST_REDIS_PASSWORD",
            "timeout_seconds": 2.0}


def redis_env(redis_server) -> dict:
    return {"KVPOOL_TEST_REDIS_PASSWORD": redis_server.password}


def s3_tier(s3_server) -> dict:
    return {"type": "s3", "endpoint": s3_server.endpoint, "bucket": s3_server.bucket,
            "region": s3_server.region, "timeout_seconds": 5.0}


def redis_client(redis_server):
    import redis

    return redis.Redis.from_url(redis_server.url, password=redis_server.password)


def redis_keys(redis_server, namespace: str) -> list[bytes]:
    r = redis_client(redis_server)
    try:
        return list(r.scan_iter(match=f"*{namespace}:*", count=1000))
    finally:
        r.close()


def s3_keys(s3_server, namespace: str) -> list[str]:
    c = s3_server.client()
    out = []
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=s3_server.bucket):
        out += [o["Key"] for o in page.get("Contents", []) if f"{namespace}/" in o["Key"]]
    return out


def disk_files(path: Path) -> list[Path]:
    """Stored objects of a disk tier (`<path>/<namespace>/<xx>/<key hex>.kv`)."""
    return sorted(Path(path).rglob("*.kv"))


class SharedObjects:
    """The object names a pool's disk tier and Redis hold (a disk file's stem is the name a
    Redis key ends with): what a writer left where, and a prompt's objects removed from one
    tier so that a fresh engine must find them in the other."""

    def __init__(self, disk_root: Path, redis_server, namespace: str) -> None:
        self.disk_root = Path(disk_root)
        self.redis_server, self.namespace = redis_server, namespace

    def names(self) -> dict[str, set[str]]:
        return {"disk": {p.stem for p in disk_files(self.disk_root)},
                "redis": {k.decode().rsplit(":", 1)[1]
                          for k in redis_keys(self.redis_server, self.namespace)}}

    def new_since(self, before: dict[str, set[str]], enough, what: str) -> dict[str, set[str]]:
        """The names each tier gained since `before`, once `enough(count)` holds in every
        tier (lower tiers are written behind the forward pass: waited for, never read once)."""
        def gained():
            now = self.names()
            new = {t: now[t] - before[t] for t in now}
            return new if all(enough(len(v)) for v in new.values()) else None
        return wait_until(gained, what=what)

    def remove(self, names: set[str], tier: str) -> None:
        if tier == "disk":
            for p in disk_files(self.disk_root):
                if p.stem in names:
                    p.unlink()
            return
        r = redis_client(self.redis_server)
        try:
            for k in redis_keys(self.redis_server, self.namespace):
                if k.decode().rsplit(":", 1)[1] in names:
                    r.delete(k)
        finally:
            r.close()
