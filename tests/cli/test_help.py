"""Every `--help` of both CLIs works (exit 0, its own usage) and names only commands that exist:
`kvpool ...` commands of the command table, `kvpool-operator` subcommands, Makefile targets.
Run as users run them (subprocesses), so what they read is what this test reads."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool_cli import main as cli

REPO = Path(__file__).resolve().parents[2]
OPERATOR_COMMANDS = ("run", "render", "crd", "golden")


def helps() -> list[tuple[str, list[str]]]:
    """(how it is typed, argv) for every help screen."""
    out = [("kvpool", ["-m", "kvpool_cli", "--help"])]
    out += [(f"kvpool {group}", ["-m", "kvpool_cli", group, "--help"]) for group in cli.GROUPS]
    out += [(f"kvpool {name}", ["-m", "kvpool_cli", *name.split(), "--help"]) for name in cli.COMMANDS]
    out.append(("kvpool-operator", ["-m", "kvpool_operator.cli", "--help"]))
    out += [(f"kvpool-operator {c}", ["-m", "kvpool_operator.cli", c, "--help"]) for c in OPERATOR_COMMANDS]
    return out


def make_targets() -> set[str]:
    text = (REPO / "Makefile").read_text()
    return set(re.findall(r"^([a-z][\w-]*):", text, re.M))


# A command named in a help text: inside backticks, or starting an indented example line.
MENTION = re.compile(r"(?:`|^\s+)(kvpool-operator|kvpool|make) ([a-z][\w-]*(?: [a-z][\w-]*)?)", re.M)


def exists(prog: str, words: str) -> bool:
    first, _, second = words.partition(" ")
    if prog == "make":
        return all(w in make_targets() for w in words.split())
    if prog == "kvpool-operator":
        return first in OPERATOR_COMMANDS
    if f"{first} {second}" in cli.COMMANDS or first in cli.COMMANDS:
        return True
    return first in cli.GROUPS and not second  # `kvpool bench` alone: the group


@pytest.mark.parametrize(("typed", "argv"), helps(), ids=[typed for typed, _ in helps()])
def test_every_help_works_and_names_only_existing_commands(typed, argv):
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "unknown command" not in proc.stderr + proc.stdout
    assert proc.stdout.startswith(f"usage: {typed} ") or proc.stdout.startswith(f"usage: {typed}\n") \
        or (typed == "kvpool-operator" and proc.stdout.startswith("usage: kvpool-operator")), proc.stdout[:200]
    missing = [f"{prog} {words}" for prog, words in MENTION.findall(proc.stdout) if not exists(prog, words)]
    assert missing == [], f"{typed} --help names commands that do not exist: {missing}"


def test_the_checker_catches_a_command_that_does_not_exist():
    assert not exists("kvpool", "bench turbo") and not exists("kvpool", "deploy")
    assert not exists("kvpool-operator", "apply") and not exists("make", "deploy")
    assert exists("kvpool", "bench") and exists("kvpool", "bench e2e") and exists("make", "golden")
    assert MENTION.findall("see `kvpool bench turbo` and\n  kvpool deploy -f x") == [
        ("kvpool", "bench turbo"), ("kvpool", "deploy")]
