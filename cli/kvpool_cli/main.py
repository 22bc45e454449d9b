"""`kvpool`: the umbrella CLI over the connector, the operator and the dev tooling.

  kvpool demo [...]            the main job on one machine: vLLM + kvpool connector, chat workload
  kvpool bench store [...]     tier throughput against raw baselines
  kvpool bench e2e [...]       TTFT: recompute vs hits from each tier vs ExampleConnector
  kvpool bench fleet [...]     routing policies (vllm-router) in front of engines sharing Redis
  kvpool bench serve [...]     vLLM bench serve: plain vs kvpool cpu tier vs native offloading
  kvpool bench dtype [...]     prefill tokens/s in bfloat16 vs float32 (why engines pick a dtype)
  kvpool bench chat [...]      multi-turn chat, token-exact history: computed tokens and TTFT per turn
  kvpool bench warm [...]      a new engine with warm start vs without vs a plain cold replica
  kvpool bench copy [...]      chunk copies cache <-> host vs a plain copy (CUDA or CPU)
  kvpool bench pd [...]        prefill/decode through the pool vs colocated engines vs NIXL, pinned
  kvpool render -f pool.yaml   print the manifests the operator would apply for a KVCachePool
  kvpool validate FILE         check a connector config or a KVCachePool manifest
  kvpool model [--preset P]    generate the local random-weight model used by demo/bench
  kvpool plan TRACE [...]      size a pool from a request trace: hit ratio per tier vs the bound

It dispatches to every part of kvpool, so it lives in none of them: each command is a
"module:function" target imported only when used, so the CLI starts fast and works in images
that lack the other parts (no vLLM in the operator image, no kopf in the engine image). demo,
bench and model are dev tooling, in the separate `kvpool-dev` distribution (dev/ in a kvpool
checkout, package kvpool_dev) that no image carries: without it they exit with a one-line error.
"""

from __future__ import annotations

import signal
import sys
from importlib import import_module
from typing import Any

# "<command>" or "<group> <command>" -> (target, help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("kvpool_dev.demo", "run vLLM with the kvpool connector on a chat workload"),
    "bench store": ("kvpool_dev.bench.store_bench", "tier throughput vs raw baselines"),
    "bench e2e": ("kvpool_dev.bench.e2e_bench", "TTFT per tier vs recompute and ExampleConnector"),
    "bench fleet": ("kvpool_dev.bench.fleet_bench", "cache-aware routing vs round robin on 2 engines"),
    "bench serve": ("kvpool_dev.bench.serve_bench", "vLLM bench serve: plain / kvpool / native offloading"),
    "bench dtype": ("kvpool_dev.bench.dtype_bench", "prefill tokens/s in bfloat16 vs float32"),
    "bench chat": ("kvpool_dev.bench.chat_bench", "multi-turn chat per turn: plain, kvpool "
                   "chunks, kvpool tails+decode, native"),
    "bench warm": ("kvpool_dev.bench.warm_bench", "a new engine: warm start / shared tier only / "
                   "plain cold replica"),
    "bench copy": ("kvpool_dev.bench.copy_bench", "the connector's chunk copies (cache <-> "
                   "host) vs a plain copy of the bytes; CUDA where there is a GPU"),
    "bench pd": ("kvpool_dev.bench.pd_bench", "prefill/decode through kvpool vs colocated "
                 "engines vs NIXL: TTFT, ITL, handover"),
    "render": ("kvpool_operator.cli:render_main", "render a KVCachePool's child manifests (kvpool-operator render)"),
    "validate": ("kvpool_cli.validate", "validate a connector config or a KVCachePool"),
    "model": ("kvpool_dev.testbed.localmodel", "generate the local demo/bench model"),
    "plan": ("kvpool_cli.plan", "size a pool from a request trace (Mooncake, Bailian): "
             "hit ratio per tier and size vs the infinite-cache bound"),
}
GROUPS = tuple(dict.fromkeys(name.split()[0] for name in COMMANDS if " " in name))  # ("bench",)
HELP = ("-h", "--help", "help")

DEV_PACKAGE = "kvpool_dev"  # the commands whose module is in it are dev tooling
DEV_HINT = "pip install -e ./dev from a kvpool checkout"


def load(target: str) -> Any:
    """The function a "module:function" target names ("module" alone: its main)."""
    module_name, _, func_name = target.partition(":")
    return getattr(import_module(module_name), func_name or "main")


def usage(group: str | None = None) -> str:
    """The commands (of one group, with `group`), each with its help."""
    head = f"usage: kvpool {group} <command> [args]" if group else "usage: kvpool <command> [args]"
    lines = [head, "", "commands:"]
    for name, (target, help_) in COMMANDS.items():
        if group is None or name.split()[0] == group:
            shown = name.removeprefix(f"{group} ") if group else name
            lines.append(f"  {shown:<14} {help_}{' (dev tooling)' if _is_dev(target) else ''}")
    return "\n".join(lines)


def _is_dev(target: str) -> bool:
    return target.split(".")[0].split(":")[0] == DEV_PACKAGE


def _missing_dev(exc: ImportError) -> bool:
    """The import failed because kvpool_dev itself is not installed (not one of its imports)."""
    return isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == DEV_PACKAGE


def _resolve(argv: list[str]) -> tuple[str, list[str]] | None:
    for words in (2, 1):
        name = " ".join(argv[:words])
        if len(argv) >= words and name in COMMANDS:
            return name, argv[words:]
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in HELP:
        print(usage())
        return 0
    found = _resolve(argv)
    if found is None and argv[0] in GROUPS:  # `kvpool bench --help`, or `kvpool bench` alone
        asked = len(argv) > 1 and argv[1] in HELP
        if len(argv) == 1 or asked:
            print(usage(argv[0]), file=sys.stdout if asked else sys.stderr)
            return 0 if asked else 2
    if found is None:
        print(f"kvpool: unknown command {' '.join(argv[:2])!r}\n\n{usage()}", file=sys.stderr)
        return 2
    name, rest = found
    target = COMMANDS[name][0]
    try:
        command = load(target)
    except ImportError as exc:
        if _is_dev(target) and _missing_dev(exc):
            print(f"`kvpool {name}` is dev tooling: {DEV_HINT}", file=sys.stderr)
            return 2
        print(f"kvpool {name}: needs a component that is not installed ({exc}); "
              f"install kvpool[test] or kvpool[operator]", file=sys.stderr)
        return 2
    stop_cleanly_on_sigterm()
    return int(command(rest) or 0)


def stop_cleanly_on_sigterm() -> None:
    """SIGTERM (a `timeout`, a CI job cancelled, `kill`) exits through the command's
    `finally` blocks like Ctrl-C does: the dev tools start vLLM servers in sessions of their
    own, which Python's default SIGTERM (exit at once) left running, holding gigabytes."""
    def _exit(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)
