"""`kvpool-operator`: run the operator, render a pool offline, regenerate the CRD and golden files.

  kvpool-operator run [--namespace NS ...] [--all-namespaces] [--liveness URL] [--peering NAME]
  kvpool-operator render -f pool.yaml [--namespace NS] [--explain]
  kvpool-operator crd --write crds/
  kvpool-operator golden --write tests/operator/golden/ [--examples examples/]

`render` exits 0 when every document renders (warnings on stderr), 1 when one is invalid (its
error, naming the field, on stderr; nothing on stdout), 2 when it cannot run (usage, a path it
cannot read, bad KVPOOL_* settings). `render --explain` prints, instead of the manifests, what each
engine role's memory request and /dev/shm size are made of (render/memory.py). `golden` is dev
tooling: it runs the `kvpool-dev` distribution's generator (dev/ in a kvpool checkout, package
kvpool_dev), imported by name only when the command runs; no image has it.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import sys
from pathlib import Path
from typing import Any

from kvpool_connector.config import MalformedFile, UsageError, load_documents
from kvpool_operator import crd, validation, yamlio
from kvpool_operator.render import InvalidPool, memory
from kvpool_operator.settings import Settings, misspelled


def peering_priority(explicit: int | None, hostname: str | None = None) -> int:
    """kopf pauses a replica only for a peer of *higher* priority, so equal priorities make
    every replica active. Default to a stable number derived from the pod's hostname: one
    replica is active, the others stand by, and the choice survives restarts."""
    if explicit is not None:
        return explicit
    import socket
    import zlib

    return 1 + zlib.crc32((hostname or socket.gethostname()).encode()) % 1_000_000


def _run(args: argparse.Namespace) -> int:
    import kopf

    from kvpool_operator.reconcile.handlers import build_registry

    try:
        settings = Settings.from_env()
    except UsageError as exc:  # the pod's env (chart values) is wrong: one line in its log, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return validation.EXIT_USAGE
    for warning in misspelled():
        print(f"warning: {warning}", file=sys.stderr)
    namespaces = list(args.namespace or settings.namespaces)
    clusterwide = args.all_namespaces or not namespaces
    log_format = {"plain": kopf.LogFormat.PLAIN, "json": kopf.LogFormat.JSON, "full": kopf.LogFormat.FULL}
    kopf.configure(verbose=args.verbose, log_format=log_format[settings.log_format])
    asyncio.run(
        kopf.operator(
            registry=build_registry(settings),
            clusterwide=clusterwide,
            namespaces=[] if clusterwide else namespaces,
            liveness_endpoint=args.liveness,
            standalone=args.peering is None,
            peering_name=args.peering,
            priority=peering_priority(args.priority),
        )
    )
    return 0


def render_documents(path: str, docs: list, namespace: str | None,
                     settings: Settings, explain: bool = False) -> tuple[str, list[str]]:
    """All children of every KVCachePool in a file's documents, as one multi-document YAML
    stream (with `explain`: each pool's memory account instead), and the warnings; InvalidPool
    names the document and the field. Every document goes through validation.check_document,
    the reconciler's path."""
    out, warnings, accounts = [], [], []
    for index, doc in enumerate(docs):
        where = path if len(docs) == 1 else f"{path} (document {index + 1})"
        try:
            checked = validation.check_document(doc, settings, namespace)
        except InvalidPool as exc:
            raise InvalidPool(f"{where}: {validation.describe(doc)}: {exc}") from None
        out.extend(checked.manifests)
        accounts.append(memory.explain(checked.pool))
        warnings += [f"{where}: {validation.describe(doc)}: {w}" for w in checked.warnings]
    return ("\n".join(accounts) if explain else yamlio.dump_all(out)), warnings


def render_file(path: str, namespace: str | None, settings: Settings) -> str:
    """All children of every KVCachePool in a YAML file (`-`: stdin), as one YAML stream."""
    docs = load_documents(path, sys.stdin.read() if path == "-" else None)
    return render_documents(path, docs, namespace, settings)[0]


def check_pool(doc: dict) -> tuple[str, str | None, list[str]]:
    """`kvpool validate` on a KVCachePool document: (what it is, error or None, warnings), by the
    operator's own path with its settings from the environment (SettingsError: exit 2)."""
    settings = Settings.from_env()
    try:
        checked = validation.check_document(doc, settings)
    except InvalidPool as exc:
        return validation.describe(doc), str(exc), misspelled()
    return validation.describe(doc), None, [*misspelled(), *checked.warnings]


def pool_spec(doc: dict) -> tuple[str, Any]:
    """`kvpool plan -f`: a KVCachePool document's name and spec (models.KVCachePoolSpec), by
    the operator's own path with its settings from the environment; a refused pool raises
    InvalidPool, bad settings SettingsError (each a ValueError of one line)."""
    checked = validation.check_document(doc, Settings.from_env())
    return checked.pool.name, checked.pool.spec


def _render(args: argparse.Namespace) -> int:
    """Nothing on stdout unless every document renders: a pipe into kubectl never applies half."""
    try:
        settings = Settings.from_env()
        docs = load_documents(args.filename, sys.stdin.read() if args.filename == "-" else None)
        text, warnings = render_documents(args.filename, docs, args.namespace, settings, args.explain)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return validation.EXIT_USAGE
    except (MalformedFile, InvalidPool) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return validation.EXIT_INVALID
    for warning in [*misspelled(), *warnings]:
        print(f"warning: {warning}", file=sys.stderr)
    sys.stdout.write(text)
    return validation.EXIT_OK


def _crd(args: argparse.Namespace) -> int:
    if args.write:
        print(crd.write(Path(args.write)))
    else:
        sys.stdout.write(crd.crd_yaml())
    return 0


# Subcommands implemented by the dev distribution: name -> "module:function" (imported on use)
DEV_COMMANDS = {"golden": "kvpool_dev.golden:write_golden"}
DEV_HINT = "pip install -e ./dev from a kvpool checkout"


def _dev(name: str) -> Any | None:
    """The dev distribution's function behind `kvpool-operator <name>`; None (and a one-line
    error) when kvpool_dev is not installed."""
    module_name, _, func = DEV_COMMANDS[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != module_name.split(".")[0]:
            raise
        print(f"`kvpool-operator {name}` is dev tooling: {DEV_HINT}", file=sys.stderr)
        return None
    return getattr(module, func)


def _golden(args: argparse.Namespace) -> int:
    write_golden = _dev("golden")
    if write_golden is None:
        return 2
    for path in write_golden(Path(args.write), Path(args.examples) if args.examples else None):
        print(path)
    return 0


def render_main(argv: list[str] | None = None) -> int:
    """`kvpool render ...` (the umbrella CLI): this CLI's render, its help naming `kvpool render`."""
    return main(["render", *(sys.argv[1:] if argv is None else argv)], prog="kvpool")


def main(argv: list[str] | None = None, prog: str = "kvpool-operator") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="cmd", required=True)

    run_cmd = commands.add_parser("run", help="run the operator (kopf)")
    run_cmd.add_argument("--namespace", "-n", action="append", help="watch this namespace (repeatable; globs ok)")
    run_cmd.add_argument("--all-namespaces", "-A", action="store_true", help="watch all namespaces")
    run_cmd.add_argument("--liveness", help="liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    run_cmd.add_argument("--peering", help="kopf peering name: replicas coordinate so only one is active")
    run_cmd.add_argument("--priority", type=int, default=None,
                         help="peering priority (default: derived from the hostname, distinct per pod)")
    run_cmd.add_argument("--verbose", action="store_true")
    run_cmd.set_defaults(fn=_run)

    render_cmd = commands.add_parser("render", help="print a pool's child manifests (offline)")
    render_cmd.add_argument("-f", "--filename", required=True, help="KVCachePool YAML ('-' for stdin)")
    render_cmd.add_argument("--namespace", "-n", help="namespace of the children (default: the pool's or 'default')")
    render_cmd.add_argument("--explain", action="store_true",
                            help="print what each engine's memory request and /dev/shm are made of, not the manifests")
    render_cmd.set_defaults(fn=_render)

    crd_cmd = commands.add_parser("crd", help="print or write the CRD generated from the models")
    crd_cmd.add_argument("--write", metavar="DIR", help="write <DIR>/kvpool.dev_kvcachepools.yaml")
    crd_cmd.set_defaults(fn=_crd)

    golden_cmd = commands.add_parser("golden",
                                     help="regenerate golden renders of examples/*.yaml (dev tooling: kvpool_dev)")
    golden_cmd.add_argument("--write", metavar="DIR", required=True)
    golden_cmd.add_argument("--examples", metavar="DIR",
                            help="KVCachePool examples to render (default: the checkout's examples/)")
    golden_cmd.set_defaults(fn=_golden)

    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
