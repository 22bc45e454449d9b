"""Stale host regions (native/regions.py): a region left by a killed engine is removed, a live
engine's never, whether it maps the region or only holds it open; real processes, a real
SIGKILL, and the kernel's own answer (a write lease)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from kvpool_connector.native.regions import remove_stale_regions

SIZE = 1 << 20

# A process holding a region as an engine does: "map" creates (or opens) it, maps and writes
# every page, then closes the descriptor; "open" only holds the descriptor (a creator between
# its O_EXCL open and its mmap). It says "ready" and waits for stdin to close.
HOLDER = """
import mmap, os, sys
path, how, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, size)
if how == "map":
    m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    m[:] = b"\\x01" * size
    os.close(fd)
print("ready", flush=True)
sys.stdin.read()
"""


def hold(path: Path, how: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), how, str(SIZE)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def release(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def test_killed_engines_region_is_removed_live_ones_stay(tmp_path):
    killed = hold(tmp_path / "vllm_offload_killed.mmap", "map")
    mapped = hold(tmp_path / "vllm_offload_mapped.mmap", "map")
    opened = hold(tmp_path / "vllm_offload_opened.mmap", "open")
    try:
        os.kill(killed.pid, signal.SIGKILL)  # no cleanup: the file stays, its pages still count
        killed.wait(timeout=30)
        assert (tmp_path / "vllm_offload_killed.mmap").stat().st_size == SIZE
        other = tmp_path / "other.mmap"  # not a region name: never touched
        other.write_bytes(b"x")
        assert remove_stale_regions(tmp_path) == ["vllm_offload_killed.mmap"]
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "other.mmap", "vllm_offload_mapped.mmap", "vllm_offload_opened.mmap"]
        # once their engines are gone, their regions go too
        release(mapped)
        release(opened)
        assert sorted(remove_stale_regions(tmp_path)) == [
            "vllm_offload_mapped.mmap", "vllm_offload_opened.mmap"]
    finally:
        for proc in (killed, mapped, opened):
            release(proc)


def test_links_and_other_files_are_never_followed_or_removed(tmp_path):
    target = tmp_path / "precious"
    target.write_bytes(b"y")
    (tmp_path / "vllm_offload_link.mmap").symlink_to(target)
    (tmp_path / "vllm_offload_dir.mmap").mkdir()
    fifo = tmp_path / "vllm_offload_fifo.mmap"
    os.mkfifo(fifo)  # opened without blocking, never removed
    assert remove_stale_regions(tmp_path) == []
    assert target.read_bytes() == b"y" and (tmp_path / "vllm_offload_link.mmap").is_symlink()
    assert (tmp_path / "vllm_offload_dir.mmap").is_dir() and fifo.exists()


def test_a_missing_directory_never_raises(tmp_path):
    assert remove_stale_regions(tmp_path / "absent") == []
