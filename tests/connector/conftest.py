"""Fixtures of the store tests: per-test namespaces on the shared Redis/S3 servers, tier
configs, and small filesystems that really fill up or really refuse writes."""

from __future__ import annotations

import os
import subprocess
import threading
import uuid

import pytest

from tests.conftest import skip_or_fail

REDIS_PASSWORD_ENV = "KVPOOL_TEST_REDIS_PASSWORD"


@pytest.fixture
def namespace() -> str:
    """A fresh namespace: tests sharing the session's Redis and bucket never see each other."""
    return "t-" + uuid.uuid4().hex[:12]


@pytest.fixture
def reads_finished(monkeypatch):
    """reads_finished(tier) -> an Event set whenever a get_many_into of that tier returns or
    raises: a read the store gave up on is waited for, never slept on."""

    def watch(tier) -> threading.Event:
        finished = threading.Event()
        real_read = tier.get_many_into

        def read_then_signal(*args):
            try:
                return real_read(*args)
            finally:
                finished.set()

        monkeypatch.setattr(tier, "get_many_into", read_then_signal)
        return finished

    return watch


@pytest.fixture
def redis_tier(redis_server, monkeypatch) -> dict:
    monkeypatch.setenv(REDIS_PASSWORD_ENV, redis_server.password)
    return {"type": "redis", "url": redis_server.url, "password_env": REDIS_PASSWORD_ENV}


@pytest.fixture
def s3_tier(s3_server, monkeypatch) -> dict:
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    return {"type": "s3", "endpoint": s3_server.endpoint, "bucket": s3_server.bucket,
            "region": s3_server.region, "prefix": "kv"}


@pytest.fixture
def disk_tier(tmp_path) -> dict:
    return {"type": "disk", "path": str(tmp_path / "disk"), "size": "256Mi", "rescan_seconds": 0}


@pytest.fixture
def cpu_tier() -> dict:
    return {"type": "cpu", "size": "64Mi"}


@pytest.fixture
def tier_cfgs(cpu_tier, disk_tier, redis_tier, s3_tier) -> dict:
    return {"cpu": cpu_tier, "disk": disk_tier, "redis": redis_tier, "s3": s3_tier}


def _mount_tmpfs(path, size: str) -> bool:
    if os.geteuid() != 0:
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True)
    return r.returncode == 0


@pytest.fixture
def small_fs(tmp_path):
    """A 4 MiB tmpfs: writes beyond it fail with ENOSPC like a full NVMe would."""
    path = tmp_path / "small"
    path.mkdir()
    if not _mount_tmpfs(path, "4m"):
        skip_or_fail("cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN)")
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def make_readonly(tmp_path):
    """Returns a function that turns a directory read-only for real, even for root
    (a read-only remount of a tmpfs; chmod is enough for other users)."""
    mounts = []

    def prepare():
        path = tmp_path / "ro"
        path.mkdir()
        if _mount_tmpfs(path, "16m"):
            mounts.append(path)
        elif os.geteuid() == 0:
            skip_or_fail("root ignores file modes and mounting a tmpfs is not allowed here")
        return path

    def freeze(path):
        if path in mounts:
            subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)
        else:
            for root, dirs, _ in os.walk(path):
                for d in dirs:
                    os.chmod(os.path.join(root, d), 0o555)
            os.chmod(path, 0o555)

    yield prepare, freeze
    for path in mounts:
        subprocess.run(["umount", "-l", str(path)], check=False)
