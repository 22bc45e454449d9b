"""vLLM engines forked from a process that imported vLLM once (the test suite's engines).

Why: an `OfflineEngine` child spent ~6 of its ~9.5 s start importing vLLM and torch, and the
suite starts dozens of them on 2 cores. A zygote imports them once (per test process) and
forks each engine worker from that state: a start took 1.7 s here (an API server with 1 GiB
of KV cache: 9.9 s to /health instead of 18.5 s). Only the import is
shared; every engine still builds its own `vllm.LLM` from scratch in its own process, with
its own environment, session (process group), stdin/stdout pipes and log.

Protocol: one SOCK_SEQPACKET connection per request on a Unix socket (message boundaries
kept, file descriptors passed with SCM_RIGHTS): `{"fork": args, "env", "cwd"}` (an
engine worker) or `{"run_module": name, "argv", "env", "cwd"}` (`python -m name argv...`: a
vLLM API server, its module imported by the zygote first) with the child's stdin, stdout
and stderr descriptors answers `{"pid"}`; `{"started_with": true}` answers `{"env"}`, the environment it started
with (what a process attaching to it compares an engine's with); `{"wait": pid}` answers the child's exit code
once it ended (the zygote is its parent and reaps it).

An engine whose environment differs from the zygote's in a variable that vLLM, torch or the
C runtimes read at import (logging, threads, allocators: IMPORT_TIME_PREFIXES) would not get
what it asked for: `compatible` says so and the caller starts a fresh process instead.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from kvpool_dev.testbed import process

# "1": engines fork from a zygote (set by the test suite); a socket path: from that one (a
# dev tool the tests run uses the test process's zygote: tests/e2e/conftest.py dev_tool_env)
ENV = "KVPOOL_DEV_ENGINE_FORK"
MAX_MESSAGE = 1 << 20
# Read when vLLM, torch and the C runtimes are imported or initialize, so fixed in a zygote;
# VLLM_* variables are read lazily (vllm.envs) except these and logging's.
IMPORT_TIME_PREFIXES = ("VLLM_LOGGING", "VLLM_CONFIGURE_LOGGING", "VLLM_TARGET_DEVICE",
                        "VLLM_USE_PRECOMPILED", "TORCH", "PYTORCH", "OMP_", "KMP_", "GOMP_",
                        "MKL", "PYTHON", "LD_", "MALLOC", "TCMALLOC", "HF_", "TRANSFORMERS",
                        "TOKENIZERS", "CUDA", "TRITON")


def enabled() -> bool:
    value = os.environ.get(ENV, "")
    return value == "1" or value.startswith("/")


def compatible(base: dict[str, str], env: dict[str, str]) -> bool:
    """Whether a child forked from a zygote started with `base` runs as one started with
    `env` would (pure): they differ in no variable read at import time."""
    differ = {k for k in base.keys() | env.keys() if base.get(k) != env.get(k)}
    return not any(k.startswith(IMPORT_TIME_PREFIXES) for k in differ)


# -- the zygote process -----------------------------------------------------------------------


def serve(path: str) -> None:
    """Import vLLM, then fork engine workers on request until killed."""
    from kvpool_dev.testbed import engine_worker

    engine_worker.preload()
    codes: dict[int, int] = {}

    def reap(*_: Any) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            codes[pid] = os.waitstatus_to_exitcode(status)

    signal.signal(signal.SIGCHLD, reap)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path + ".new")
    listener.listen(8)
    os.rename(path + ".new", path)  # the path appears ready: a connect never races the listen
    started_with = dict(os.environ)
    while True:
        conn, _ = listener.accept()
        with conn:
            msg, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 3)
            req = json.loads(msg)
            if "started_with" in req:  # what a process attaching to this zygote compares with
                conn.send(json.dumps({"env": started_with}).encode())
                continue
            if "wait" in req:
                pid = int(req["wait"])
                if pid not in codes:
                    try:
                        _, status = os.waitpid(pid, 0)
                        codes[pid] = os.waitstatus_to_exitcode(status)
                    except ChildProcessError:  # reaped by the handler meanwhile, or not ours
                        pass
                conn.send(json.dumps({"code": codes.pop(pid, None)}).encode())
                continue
            if "run_module" in req:  # imported here once: every later fork has it
                importlib.import_module(req["run_module"])
                gc.freeze()
            pid = os.fork()
            if pid == 0:
                _child(listener, conn, fds, req)  # never returns
            for fd in fds:
                os.close(fd)
            conn.send(json.dumps({"pid": pid}).encode())


def _child(listener: socket.socket, conn: socket.socket, fds: list[int], req: dict) -> None:
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        listener.close()
        conn.close()
        os.setsid()  # its own process group, as Popen(start_new_session=True) gives
        for target, fd in zip((0, 1, 2), fds, strict=True):
            os.dup2(fd, target)
        for fd in fds:
            os.close(fd)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own stdio
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        if "run_module" in req:  # as `python -m MODULE ARGV...` runs it
            sys.argv = [req["run_module"], *req["argv"]]
            runpy.run_module(req["run_module"], run_name="__main__", alter_sys=True)
        else:
            from kvpool_dev.testbed import engine_worker

            engine_worker.main(req["fork"])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported in the engine's log, then exit
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # exiting anyway
                stream.flush()
        os._exit(code)


# -- the caller's side ------------------------------------------------------------------------


def _open_log(path: Path) -> int:
    """The log as process.start opens it (created or truncated)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)


class Zygote:
    """A zygote process: this process's own (started with `env`), or with `attach` one that
    a parent process shares (see the module docstring)."""

    proc: subprocess.Popen | None

    def __init__(self, env: dict[str, str], start_timeout: float) -> None:
        self.env = dict(env)
        self.dir = tempfile.mkdtemp(prefix="kvpool-zygote-")
        self.path = os.path.join(self.dir, "sock")
        self.log_path = process.temp_log("vllm-zygote-")
        self.proc = process.start([sys.executable, "-m", "kvpool_dev.testbed.zygote", self.path],
                                  self.log_path, new_session=True, env=self.env)
        deadline = time.monotonic() + start_timeout
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"engine zygote did not start; log tail:\n"
                                   f"{process.log_tail(self.log_path)}")
            time.sleep(0.1)

    @classmethod
    def attach(cls, path: str) -> Zygote:
        """The zygote listening on `path` (a parent process's; it stops it, not us)."""
        self = cls.__new__(cls)
        self.path, self.proc, self.dir = path, None, ""
        self.env = dict(self._request({"started_with": True})["env"])
        return self

    def _request(self, msg: dict, fds: list[int] | None = None) -> dict:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.connect(self.path)
            socket.send_fds(s, [json.dumps(msg).encode()], fds or [])
            return dict(json.loads(s.recv(MAX_MESSAGE)))

    def alive(self) -> bool:
        return os.path.exists(self.path) if self.proc is None else self.proc.poll() is None

    def fork(self, args: dict, env: dict[str, str], log_path: Path) -> ForkedProcess:
        """An engine worker (engine_worker.main(args)) with `env`, its stdout a pipe to us,
        its stderr `log_path`."""
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        log = _open_log(log_path)
        try:
            pid = int(self._request({"fork": args, "env": env, "cwd": os.getcwd()},
                                    [stdin_r, stdout_w, log])["pid"])
        except BaseException:
            os.close(stdin_w)
            os.close(stdout_r)
            raise
        finally:
            for fd in (stdin_r, stdout_w, log):
                os.close(fd)
        return ForkedProcess(self, pid, open(stdin_w, "w", buffering=1),  # noqa: SIM115
                             open(stdout_r))  # noqa: SIM115

    def run_module(self, module: str, argv: list[str], env: dict[str, str],
                   log_path: Path) -> ForkedProcess:
        """`python -m module *argv` with `env`, its stdout and stderr `log_path`, no stdin."""
        devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        log = _open_log(log_path)
        try:
            pid = int(self._request({"run_module": module, "argv": argv, "env": env,
                                     "cwd": os.getcwd()}, [devnull, log, log])["pid"])
        finally:
            os.close(devnull)
            os.close(log)
        return ForkedProcess(self, pid, None, None)

    def exit_code(self, pid: int) -> int:
        try:
            code = self._request({"wait": pid}).get("code")
        except OSError:  # the zygote is gone: the code is lost
            code = None
        return 255 if code is None else int(code)

    def stop(self) -> None:
        if self.proc is None:  # attached: its owner stops it
            return
        process.stop(self.proc, timeout=5)
        Path(self.path).unlink(missing_ok=True)
        os.rmdir(self.dir)


class ForkedProcess:
    """What `OfflineEngine` and `process.stop` use of a `subprocess.Popen`, for a child of
    the zygote: its end is seen through a pidfd, its exit code asked of the zygote."""

    def __init__(self, zygote: Zygote, pid: int, stdin: Any, stdout: Any) -> None:
        self.zygote, self.pid, self.stdin, self.stdout = zygote, pid, stdin, stdout
        self.returncode: int | None = None
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:  # ended and reaped already
            self._pidfd = None

    def _ended(self, timeout: float | None) -> bool:
        if self._pidfd is None:
            return True
        return bool(select.select([self._pidfd], [], [], timeout)[0])

    def poll(self) -> int | None:
        if self.returncode is None and self._ended(0):
            self._collect()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not self._ended(timeout):
                raise subprocess.TimeoutExpired(f"engine worker {self.pid}", timeout or 0)
            self._collect()
        assert self.returncode is not None
        return self.returncode

    def _collect(self) -> None:
        self.returncode = self.zygote.exit_code(self.pid)
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_zygote: Zygote | None = None


def zygote(base_env: dict[str, str], start_timeout: float) -> Zygote:
    """This process's zygote: the one a parent shares (ENV holds its socket's path: a dev
    tool the tests run), else its own, started on first use with `base_env` (one per test
    process; stopped at exit)."""
    global _zygote
    if _zygote is None or not _zygote.alive():
        shared = os.environ.get(ENV, "")
        if shared.startswith("/"):
            with contextlib.suppress(OSError, ValueError):
                _zygote = Zygote.attach(shared)
                return _zygote
        _zygote = Zygote(base_env, start_timeout)
        atexit.register(_zygote.stop)
    return _zygote


if __name__ == "__main__":
    serve(sys.argv[1])
