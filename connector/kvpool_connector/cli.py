"""`kvpool`: the user CLI.

  kvpool demo [...]            the main job on one machine: vLLM + kvpool connector, chat workload
  kvpool bench store [...]     tier throughput against raw baselines
  kvpool bench e2e [...]       TTFT: recompute vs hits from each tier vs ExampleConnector
  kvpool bench fleet [...]     routing policies (vllm-router) in front of engines sharing Redis
  kvpool bench dtype [...]     prefill tokens/s in bfloat16 vs float32 (why engines pick a dtype)
  kvpool render -f pool.yaml   print the manifests the operator would apply for a KVCachePool
  kvpool validate FILE         check a connector config or a KVCachePool manifest
  kvpool model [--preset P]    generate the local random-weight model used by demo/bench

Each subcommand lives in its own module and is imported only when used, so the CLI starts
fast and works in images that lack the other parts (no vLLM in the operator image). The
tables below are the only place where this package names the operator's: the connector
never imports it. demo, bench and model are dev tooling, in the separate `kvpool-dev`
distribution (dev/ in a kvpool checkout, package kvpool_dev) that no image carries: without
it they exit with a one-line error.
"""

from __future__ import annotations

import sys
from importlib import import_module
from typing import Any, Callable

_COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("kvpool_dev.demo", "run vLLM with the kvpool connector on a chat workload"),
    "bench store": ("kvpool_dev.bench.store_bench", "tier throughput vs raw baselines"),
    "bench e2e": ("kvpool_dev.bench.e2e_bench", "TTFT per tier vs recompute and ExampleConnector"),
    "bench fleet": ("kvpool_dev.bench.fleet_bench", "cache-aware routing vs round robin on 2 engines"),
    "bench dtype": ("kvpool_dev.bench.dtype_bench", "prefill tokens/s in bfloat16 vs float32"),
    "render": ("kvpool_operator.cli", "render a KVCachePool's child manifests (kvpool-operator render)"),
    "validate": ("kvpool_connector.validate", "validate a connector config or a KVCachePool"),
    "model": ("kvpool_dev.testbed.localmodel", "generate the local demo/bench model"),
}

DEV_PACKAGE = "kvpool_dev"  # the commands whose module is in it are dev tooling
DEV_HINT = "pip install -e ./dev from a kvpool checkout"

# Document kinds `kvpool validate` leaves to another package: kind -> "module:function"
# taking the document and returning (what it is, error message or None).
_VALIDATORS: dict[str, str] = {
    "KVCachePool": "kvpool_operator.cli:check_pool",
}


def _load(target: str) -> Any:
    """The function a "module:function" target names ("module" alone: its main)."""
    module_name, _, func_name = target.partition(":")
    return getattr(import_module(module_name), func_name or "main")


def validator(kind: Any) -> Callable[[dict], tuple[str, str | None]] | None:
    """The checker of a document kind that another package owns; None for the others."""
    target = _VALIDATORS.get(kind) if isinstance(kind, str) else None
    return _load(target) if target is not None else None


def _usage() -> str:
    lines = ["usage: kvpool <command> [args]", "", "commands:"]
    lines += [f"  {name:<14} {help_}{' (dev tooling)' if _is_dev(target) else ''}"
              for name, (target, help_) in _COMMANDS.items()]
    return "\n".join(lines)


def _is_dev(target: str) -> bool:
    return target.split(".")[0].split(":")[0] == DEV_PACKAGE


def _missing_dev(exc: ImportError) -> bool:
    """The import failed because kvpool_dev itself is not installed (not one of its imports)."""
    return isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == DEV_PACKAGE


def _resolve(argv: list[str]) -> tuple[str, list[str]] | None:
    for words in (2, 1):
        name = " ".join(argv[:words])
        if len(argv) >= words and name in _COMMANDS:
            return name, argv[words:]
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    found = _resolve(argv)
    if found is None:
        print(f"kvpool: unknown command {' '.join(argv[:2])!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    name, rest = found
    target = _COMMANDS[name][0]
    try:
        command = _load(target)
    except ImportError as exc:
        if _is_dev(target) and _missing_dev(exc):
            print(f"`kvpool {name}` is dev tooling: {DEV_HINT}", file=sys.stderr)
            return 2
        print(f"kvpool {name}: needs a component that is not installed ({exc}); "
              f"install kvpool[test] or kvpool[operator]", file=sys.stderr)
        return 2
    if name == "render":  # one implementation: the operator's own offline renderer
        rest = ["render", *rest]
    rc = command(rest)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
