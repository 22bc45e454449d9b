"""`kvpool validate FILE...`: check configs before they reach an engine or a cluster.

A document with `kind: KVCachePool` is checked by the operator's own path (models, the
operator's policy from the KVPOOL_* settings in the environment, every renderer: what
`kvpool render` and the reconciler run); a `--kv-transfer-config` object with vLLM's
OffloadingConnector is checked as native mode (its kvpool secondary tier); anything else is read
as a KVPoolConnector config (the `kv_connector_extra_config` keys, or a whole
`--kv-transfer-config` object). Errors are one line each and name the field.

Exit codes: 0 every document is valid (warnings do not fail), 1 some document is invalid (a
syntax error, an empty file, a wrong kind, a bad field), 2 the command cannot run as asked (bad
arguments, a path that cannot be read, bad KVPOOL_* settings).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path
from typing import Any

from kvpool_cli.main import load
from kvpool_connector.config import MalformedFile, UsageError, load_documents

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2

# Document kinds another package checks: kind -> "module:function" taking the document and
# returning (what it is, error message or None, warnings), imported only when such a document is
# met (the engine image has the operator's code but not its dependencies).
CHECKERS: dict[str, str] = {
    "KVCachePool": "kvpool_operator.cli:check_pool",
}

Verdict = tuple[str, "str | None", list[str]]

# Shared tiers need the pool key (the connector refuses to start without it: store/sealing.py).
SHARED_TIERS = ("disk", "redis", "s3")
NO_KEY = ("security.key_env or security.key_file: shared tiers (disk, redis, s3) need a pool key (a secret "
          "of at least 32 characters every engine of the pool holds); the engine would refuse to start")

# vLLM's own keys of a secondary tier entry; the rest are the kvpool tier's (its connector config).
VLLM_TIER_KEYS = ("type", "module_path", "locality", "enable_kv_events", "backpressure",
                  "n_read_threads", "n_write_threads")
KVPOOL_TIER_TYPES = ("kvpool", "KVPoolTier")


def _connector(extra: dict[str, Any], what: str = "connector config") -> Verdict:
    from kvpool_connector.connector.config import ConnectorConfigError, load_connector_config

    try:
        cfg = load_connector_config(extra)
    except ConnectorConfigError as exc:
        return what, str(exc), []
    tiers = [t.type for t in cfg.tiers]
    if any(t in SHARED_TIERS for t in tiers) and not cfg.security.has_key:
        return what, NO_KEY, []
    return f"{what} ({', '.join(tiers)})", None, []


def _native(doc: dict[str, Any]) -> Verdict:
    """vLLM's OffloadingConnector with kvpool's secondary tier (README, "Native mode"). A tier's
    config_file that is not on this machine is read on the engine: said, not failed."""
    what = "native offloading config"
    extra = doc.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        return what, "kv_connector_extra_config: must be a mapping", []
    size = extra.get("cpu_bytes_to_use")
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size <= 0):
        return what, f"kv_connector_extra_config.cpu_bytes_to_use: must be a positive integer, got {size!r}", []
    tiers = extra.get("secondary_tiers") or []
    if not isinstance(tiers, list):
        return what, "kv_connector_extra_config.secondary_tiers: must be a list", []
    notes, kinds = [], []
    for i, tier in enumerate(tiers):
        field = f"kv_connector_extra_config.secondary_tiers.{i}"
        if not isinstance(tier, dict) or tier.get("type") not in KVPOOL_TIER_TYPES:
            kinds.append(str(tier.get("type") if isinstance(tier, dict) else tier))
            continue  # vLLM's own tiers (fs, ...): vLLM checks them
        options = {k: v for k, v in tier.items() if k not in VLLM_TIER_KEYS}
        config_file = options.get("config_file")
        if config_file and not Path(str(config_file)).is_file():
            notes.append(f"{field}.config_file: {config_file} is not on this machine (the engine reads it): "
                         "validate that file itself")
            kinds.append("kvpool")
            continue
        tier_what, error, _ = _connector(options)
        if error:
            return what, f"{field}: {error}", []
        if "(cpu" in tier_what or ", cpu" in tier_what:
            return what, f"{field}: a cpu tier is not allowed here (vLLM's primary tier is host memory)", []
        kinds.append(f"kvpool {tier_what.removeprefix('connector config ')}")
    return f"{what} (secondary tiers: {', '.join(kinds) or 'none'})", None, notes


def check_document(doc: dict[str, Any]) -> Verdict:
    """Return (what it is, error message or None, warnings). Pure: no I/O beyond a config_file."""
    kind = doc.get("kind")
    if isinstance(kind, str) and kind in CHECKERS:
        return load(CHECKERS[kind])(doc)
    if kind is not None or "apiVersion" in doc:  # a Kubernetes object, but none kvpool knows
        close = difflib.get_close_matches(str(kind), list(CHECKERS), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else f"kvpool validates {', '.join(CHECKERS)}"
        return f"kind {kind}", f"kind: {kind!r} is not a kind kvpool validates; {hint}", []
    if doc.get("kv_connector") == "OffloadingConnector":
        return _native(doc)
    if "kv_connector" in doc:
        extra = doc.get("kv_connector_extra_config", {})
        if not isinstance(extra, dict):
            return "connector config", "kv_connector_extra_config: must be a mapping", []
        return _connector(extra)
    return _connector(doc)


def _report(path: str, docs: list[Any]) -> int:
    """Print one line per document (and per warning); the number of invalid documents."""
    bad = 0
    for index, doc in enumerate(docs):
        where = path if len(docs) == 1 else f"{path} (document {index + 1})"
        if not isinstance(doc, dict):
            print(f"{where}: INVALID: expected a mapping (a KVCachePool or a connector config), "
                  f"got a {type(doc).__name__}")
            bad += 1
            continue
        what, error, warnings = check_document(doc)
        if error:
            bad += 1
            print(f"{where}: {what}: INVALID: {error}")
        else:
            print(f"{where}: {what}: ok")
        for warning in warnings:
            print(f"{where}: {what}: warning: {warning}", file=sys.stderr)
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvpool validate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", help="YAML or JSON files ('-' for stdin)")
    args = ap.parse_args(argv)
    bad = 0
    try:
        for path in args.files:
            try:
                docs = load_documents(path, sys.stdin.read() if path == "-" else None)
            except MalformedFile as exc:
                print(exc)
                bad += 1
                continue
            bad += _report(path, docs)
    except UsageError as exc:  # an unreadable path, bad KVPOOL_* settings
        print(f"kvpool validate: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_INVALID if bad else EXIT_OK
