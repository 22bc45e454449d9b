"""The test bed: only tests marked `vllm` start engines (make test-fast skips them), and its
child processes start, log and stop the same way (testbed/process.py)."""

import signal
import socket
import subprocess
import sys
import time

import pytest

from kvpool_dev.testbed import process


def test_an_unmarked_test_cannot_start_an_engine(tiny_model):
    from kvpool_dev.testbed.engine import OfflineEngine, VllmServer

    for engine in (OfflineEngine(tiny_model), VllmServer(tiny_model)):
        with pytest.raises(RuntimeError, match="not marked @pytest.mark.vllm"):
            engine.launch()


# -- the test bed's child processes ---------------------------------------------------------


def _gone(pid: int, timeout: float = 10.0) -> bool:
    """Whether `pid` ended (exited, or a zombie waiting for its reaper) within `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.02)
    return False


def test_stop_ends_the_whole_process_group_of_a_child_that_leads_one():
    """A vLLM server's engine-core and workers are its children: they end with it."""
    proc = process.start(["sh", "-c", "sleep 300 & echo $!; wait"], new_session=True,
                         stdout=subprocess.PIPE, text=True)
    grandchild = int(proc.stdout.readline())
    process.stop(proc, timeout=5)
    assert proc.returncode == -signal.SIGTERM
    assert _gone(grandchild)


def test_stop_kills_a_child_that_ignores_sigterm_after_the_bound():
    proc = process.start(["sh", "-c", "trap '' TERM; echo ready; while :; do sleep 0.05; done"],
                         stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"  # the trap is set
    t0 = time.monotonic()
    process.stop(proc, timeout=0.5)
    assert proc.returncode == -signal.SIGKILL and time.monotonic() - t0 < 5
    process.stop(proc)  # stopping a stopped child is a no-op


def test_a_childs_output_goes_to_its_log(tmp_path):
    log = tmp_path / "child.log"
    proc = process.start(["sh", "-c", "echo out; echo err >&2"], log)
    assert proc.wait(10) == 0
    assert log.read_text().splitlines() == ["out", "err"]
    assert process.log_tail(log, 1) == "err" and process.log_tail(tmp_path / "none") == "<no log>"
    piped = process.start(["sh", "-c", "echo out; echo err >&2"], log, stdout=subprocess.PIPE)
    assert piped.communicate(timeout=10)[0] == b"out\n" and log.read_text() == "err\n"


def test_a_server_that_exits_before_listening_fails_its_start_and_leaves_nothing_running():
    port = process.free_port()
    server = process.ServerProcess(["sh", "-c", "exit 3"], port)
    with pytest.raises(RuntimeError, match=f"exited with code 3 before listening on {port}"):
        server.start()
    assert server.proc is None
    with process.ServerProcess([sys.executable, "-m", "http.server", "-b", "127.0.0.1",
                                str(port)], port) as listening:
        proc = listening.proc
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    assert proc.returncode is not None and listening.proc is None


MAPPER = """
import mmap, sys
f = open(sys.argv[1], "r+b")
m = mmap.mmap(f.fileno(), 4096)
print("mapped", flush=True)
sys.stdin.read()
"""


def test_a_stopped_groups_host_regions_go_only_once_nobody_maps_them(tmp_path):
    """What the engines' stop does with vLLM's native host regions (engine.py,
    ReleasesHostRegions): find the files its process group maps, then remove only those that
    no process maps any more."""
    shm = tmp_path
    for name in ("vllm_offload_a.mmap", "vllm_offload_b.mmap", "other.mmap"):
        (shm / name).write_bytes(b"\0" * 4096)
    child = process.start([sys.executable, "-c", MAPPER, str(shm / "vllm_offload_a.mmap")],
                          new_session=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline() == b"mapped\n"
        assert child.pid in process.group_pids(child.pid)
        mine = process.mapped_shm(process.group_pids(child.pid), "vllm_offload_*.mmap", shm)
        assert mine == {"vllm_offload_a.mmap"}  # b: nobody maps it; other: not the glob
        assert process.remove_unmapped(mine, shm) == []  # still mapped: stays
        assert (shm / "vllm_offload_a.mmap").exists()
    finally:
        child.stdin.close()
        process.stop(child)
    assert process.remove_unmapped(mine, shm) == ["vllm_offload_a.mmap"]
    assert sorted(p.name for p in shm.iterdir()) == ["other.mmap", "vllm_offload_b.mmap"]


def test_service_logs_go_with_the_process_that_made_them():
    """A test session used to leave every engine's log in /tmp (hundreds per run)."""
    from pathlib import Path

    code = ("from kvpool_dev.testbed import process\n"
            "p = process.temp_log('vllm-server-'); p.write_text('x')\n"
            "assert p.parent == process.temp_log('vllm-router-').parent\n"
            "print(p)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    log = Path(out.stdout.strip())
    assert log.name.startswith("vllm-server-") and not log.parent.exists()
