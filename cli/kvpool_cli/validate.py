"""`kvpool validate FILE...`: check configs before they reach an engine or a cluster.

A YAML/JSON document with `kind: KVCachePool` is checked by the operator's package (its
models are the source of the CRD; CHECKERS names the checker, imported only when such a
document is met); anything else is read as a KVPoolConnector config (the
`kv_connector_extra_config` keys, or a whole `--kv-transfer-config` object). Errors name
the field; the exit code is 1 when any document is invalid, 2 when a file cannot be read.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import yaml

from kvpool_cli.main import load
from kvpool_connector.config import read_documents

# Document kinds another package checks: kind -> "module:function" taking the document and
# returning (what it is, error message or None), imported only when such a document is met (the
# engine image has the operator's code but not its dependencies).
CHECKERS: dict[str, str] = {
    "KVCachePool": "kvpool_operator.cli:check_pool",
}


def check_document(doc: dict[str, Any]) -> tuple[str, str | None]:
    """Return (what it is, error message or None). Pure: no I/O beyond a config_file."""
    kind = doc.get("kind")
    if isinstance(kind, str) and kind in CHECKERS:
        return load(CHECKERS[kind])(doc)

    from kvpool_connector.connector.config import ConnectorConfigError, load_connector_config

    extra = doc.get("kv_connector_extra_config", doc) if "kv_connector" in doc else doc
    try:
        cfg = load_connector_config(extra)
    except ConnectorConfigError as exc:
        return "connector config", str(exc)
    tiers = ", ".join(t.type for t in cfg.tiers) or "no tiers"
    return f"connector config ({tiers})", None


def _documents(path: str) -> list[Any]:
    return read_documents(path, sys.stdin.read() if path == "-" else None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvpool validate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", help="YAML or JSON files ('-' for stdin)")
    args = ap.parse_args(argv)
    bad = 0
    for path in args.files:
        try:
            docs = _documents(path)
        except (OSError, yaml.YAMLError, json.JSONDecodeError) as exc:
            print(f"{path}: cannot read: {exc}", file=sys.stderr)
            return 2
        for doc in docs:
            if not isinstance(doc, dict):
                print(f"{path}: not a mapping: {type(doc).__name__}")
                bad += 1
                continue
            what, error = check_document(doc)
            if error:
                bad += 1
                print(f"{path}: {what}: INVALID: {error}")
            else:
                print(f"{path}: {what}: ok")
    return 1 if bad else 0
