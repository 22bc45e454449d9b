"""Child processes of the test bed (Redis, S3, vLLM engines and servers, the router): how
they start (output to a log file or dropped), how the caller waits for them, and how they
stop (SIGTERM, then SIGKILL past a bound, to the whole process group of a child that
leads one). One copy of what every service class needs."""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path


@functools.cache
def _log_dir() -> Path:
    """One temporary directory for this process's service logs, removed when it exits (a
    test session left hundreds of log files in /tmp before); a failing test has read the
    tail it reports by then."""
    path = Path(tempfile.mkdtemp(prefix="kvpool-logs-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def temp_log(prefix: str) -> Path:
    """A fresh log file in this process's service-log directory."""
    return Path(tempfile.mkstemp(prefix=prefix, suffix=".log", dir=_log_dir())[1])



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: Sequence[str], log: Path | None = None, new_session: bool = False,
          **popen) -> subprocess.Popen:
    """Start `cmd` with stdout and stderr into the file `log` (None: dropped; a `stdout`
    among the Popen arguments leaves only stderr to the log). With `new_session` the child
    leads its own process group, which `stop` ends whole (a vLLM server's engine-core and
    worker processes with it)."""
    # closed on return: the child holds its own copy of the descriptor
    with open(log, "wb") if log is not None else contextlib.nullcontext() as sink:
        out = sink if sink is not None else subprocess.DEVNULL
        stdout = popen.pop("stdout", out)
        return subprocess.Popen(cmd, stdout=stdout,
                                stderr=subprocess.STDOUT if stdout is out else out,
                                start_new_session=new_session, **popen)


def _leads_group(proc: subprocess.Popen) -> bool:
    try:
        return os.getpgid(proc.pid) == proc.pid
    except ProcessLookupError:
        return False


def stop(proc: subprocess.Popen | None, timeout: float = 10.0) -> None:
    """SIGTERM, `timeout` seconds to exit, then SIGKILL; sent to the child's process group
    when it leads one (started with `new_session`), else to the child alone."""
    if proc is None or proc.poll() is not None:
        return
    group = _leads_group(proc)

    def send(sig: int) -> None:
        try:
            if group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
        except ProcessLookupError:
            pass

    send(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        proc.wait(timeout)


SHM = Path("/dev/shm")


def group_pids(pgid: int) -> list[int]:
    """Live processes of process group `pgid` (a child started with `new_session` and
    everything it started that stayed in its group)."""
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if os.getpgid(int(entry.name)) == pgid:
                pids.append(int(entry.name))
        except (ProcessLookupError, PermissionError, ValueError):
            continue
    return pids


def mapped_shm(pids: Sequence[int], glob: str, shm: Path = SHM) -> set[str]:
    """Names of the files in `shm` matching `glob` that any of `pids` maps."""
    return _mapped_by(pids, {p.name for p in shm.glob(glob)} if shm.is_dir() else set(), shm)


def _mapped_by(pids: Sequence[int], names: set[str], shm: Path) -> set[str]:
    found: set[str] = set()
    for pid in pids:
        if not names - found:
            break
        try:
            text = Path(f"/proc/{pid}/maps").read_text()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        found |= {n for n in names if f"{shm}/{n}" in text}
    return found


def remove_unmapped(names: set[str], shm: Path = SHM) -> list[str]:
    """Unlink those of `names` in `shm` that no live process maps any more (one still
    mapped is someone's: it stays)."""
    pids = [int(p.name) for p in Path("/proc").glob("[0-9]*")]
    gone = sorted(names - _mapped_by(pids, set(names), shm))
    for name in gone:
        (shm / name).unlink(missing_ok=True)
    return gone


def log_tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "<no log>"


def wait_port(port: int, timeout: float = 30.0, proc: subprocess.Popen | None = None) -> None:
    """Until something listens on loopback `port`; raises when `proc` exits first or after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before listening "
                               f"on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout}s")


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, what: str,
                 log_tail: Callable[[], str], poll: float = 0.5) -> bool:
    """Poll `url` until it answers 200 (True), or False after `timeout`; raises with
    `log_tail()` when `proc` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}); log tail:\n{log_tail()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            time.sleep(poll)
    return False


class Service:
    """A test-bed service whose child process is `self.proc`: a context manager that starts
    it and always stops it. Subclasses implement `start` (returning self)."""

    proc: subprocess.Popen | None = None
    stop_timeout = 10.0  # seconds between SIGTERM and SIGKILL

    def start(self) -> Service:
        raise NotImplementedError

    def stop(self) -> None:
        stop(self.proc, self.stop_timeout)
        self.proc = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class ServerProcess(Service):
    """Any command that serves on a loopback port: started, waited for until it listens."""

    def __init__(self, cmd: Sequence[str], port: int, log: Path | None = None) -> None:
        self.cmd, self.port, self.log = list(cmd), port, log

    def start(self) -> ServerProcess:
        self.proc = start(self.cmd, self.log)
        try:
            wait_port(self.port, proc=self.proc)
        except BaseException:
            self.stop()
            raise
        return self
