"""Shared test bed: real Redis, a real S3-compatible server, generated models, helm/kubectl.

Everything is session-scoped (engines and servers are expensive on 2 cores) and bound to
loopback on free ports.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from kvpool_connector.testbed.localmodel import ensure_model
from kvpool_connector.testbed.servers import RedisServer, S3Server

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """2 layers, hidden 128: fast correctness tests."""
    return ensure_model("tiny")


@pytest.fixture(scope="session")
def bench_model() -> Path:
    """8 layers, hidden 1024, 4 KV heads: prefill cost that makes cache hits visible."""
    return ensure_model("bench")


@pytest.fixture(scope="session")
def redis_server():
    """A real redis-server with a password; `.stop()`, `.start()`, `.restart()` for fault tests."""
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def s3_server():
    """moto's standalone S3 server on loopback with one bucket; `.client()` is a boto3 client."""
    with S3Server() as server:
        yield server


def _binary(name: str) -> Path:
    path = REPO / "bin" / name
    if not os.access(path, os.X_OK):
        pytest.fail(f"{path} missing: run `make setup` (installs helm and kubectl into ./bin)")
    return path


@pytest.fixture(scope="session")
def helm() -> Path:
    return _binary("helm")


@pytest.fixture(scope="session")
def kubectl() -> Path:
    return _binary("kubectl")
