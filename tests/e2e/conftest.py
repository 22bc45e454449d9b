"""Shared pieces of the KVPoolConnector end-to-end tests.

Every test compares greedy outputs with a recompute baseline: one plain engine (no
connector) computes all prompts of the suite once per session (`baseline`), so the connector
engines never run next to it.
"""

from __future__ import annotations

import random
import time
import uuid
from pathlib import Path

import pytest

from kvpool_connector.testbed.engine import OfflineEngine

MAX_TOKENS = 16  # OfflineEngine.generate default
MAX_MODEL_LEN = 20000
CHUNK = 256


def token_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(n)]


SYSTEM = token_prompt(2048, seed=20)

# Every prompt the suite compares with recompute, by name.
PROMPTS: dict[str, list[int]] = {
    "a4k": token_prompt(4000, 1),
    "b4k": token_prompt(4100, 2),
    "y3k": token_prompt(3000, 3),
    **{f"fault{i}": token_prompt(4000, 10 + i) for i in range(4)},
    **{f"conc{i}": SYSTEM + token_prompt(120, 100 + i) for i in range(64)},
    "long16k": token_prompt(16000, 30),
}


def full_chunk_tokens(prompt: list[int], chunk: int = CHUNK) -> int:
    """Tokens of the complete chunks a hit can cover (the last prompt token is computed)."""
    return (len(prompt) - 1) // chunk * chunk


def kv_config(tiers: list[dict], namespace: str, **extra) -> dict:
    return {"kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool_connector.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"namespace": namespace, "chunk_tokens": CHUNK,
                                          "tiers": tiers, **extra}}


def connector_engine(model: Path, tiers: list[dict], namespace: str, env: dict | None = None,
                     **kwargs) -> OfflineEngine:
    extra = kwargs.pop("extra", {})
    kwargs.setdefault("enable_prefix_caching", False)  # every hit must come from the pool
    kwargs.setdefault("max_model_len", MAX_MODEL_LEN)
    return OfflineEngine(model, kv_transfer_config=kv_config(tiers, namespace, **extra),
                         env=env, **kwargs)


def wait_until(pred, timeout: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.25)


@pytest.fixture(scope="session")
def baseline(tiny_model) -> dict[str, list[int]]:
    """Greedy outputs of every prompt in PROMPTS from an engine without any connector."""
    names = list(PROMPTS)
    with OfflineEngine(tiny_model, max_model_len=MAX_MODEL_LEN) as eng:
        outs = eng.generate([PROMPTS[n] for n in names], max_tokens=MAX_TOKENS)
    return {n: o["token_ids"] for n, o in zip(names, outs)}


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


def redis_keys(redis_server, namespace: str) -> list[bytes]:
    import redis

    r = redis.Redis.from_url(redis_server.url, password=redis_server.password)
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
