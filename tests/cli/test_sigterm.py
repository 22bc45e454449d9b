"""A SIGTERM to `kvpool <command>` stops what the command started (its `finally` blocks run):
the dev tools start vLLM servers in sessions of their own, which outlived a killed bench."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

# A command as the dev tools are written: a child in its own session (the test bed's
# process.start), stopped in `finally`. `kvpool` dispatches to it like to any command.
RUNNER = """
import sys
from kvpool_cli import main as cli

def command(argv):
    from kvpool_dev.testbed import process
    child = process.start(["sleep", "600"], new_session=True)
    try:
        print(child.pid, flush=True)
        child.wait()
    finally:
        process.stop(child)

sys.modules["sigterm_target"] = type(sys)("sigterm_target")
sys.modules["sigterm_target"].main = command
cli.COMMANDS["sigterm-test"] = ("sigterm_target", "test")
sys.exit(cli.main(["sigterm-test"]))
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_sigterm_runs_the_commands_finally_and_stops_its_children():
    proc = subprocess.Popen([sys.executable, "-c", RUNNER], stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    try:
        assert _alive(child)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the command's child outlived the SIGTERM"
    finally:
        proc.kill()
        if _alive(child):
            os.killpg(child, signal.SIGKILL)
