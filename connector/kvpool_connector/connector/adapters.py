"""LoRA adapters' identity in the key space: a digest of the files the engine loads.

vLLM's block hashes name an adapter by `lora_name` and `lora_path` (kv_cache_utils's
`_gen_lora_extra_hash_keys`), so a new version written over the old one's path hashes like
the old one, and a shared tier would serve the old version's KV to the new one, with a
valid MAC. The scheduler half gives every adapter request the key space prefix of its
adapter's content (keys.py `adapter_prefix`): a BLAKE3 digest of every regular file under
the adapter's directory (names and bytes, links followed as vLLM's loader follows them: a
Hugging Face cache snapshot links its files into blobs). The digest is computed once per
path and computed again when a file's size, mtime or inode changes (checked on every
request: a stat per file), so a fresh engine serving a rewritten adapter misses.

What this cannot tell apart: an engine that loaded version 1 and keeps it in its adapter
cache while version 2 is written over its path. vLLM itself then serves version 1 under
the adapter's name (and its own prefix cache its KV); kvpool keys what the engine computes
from then on by version 2's files. Deploy a new version under a new path or name, or
restart the engines, as vLLM's own caches require.

An adapter whose path is not a local directory (a hub id resolved by the worker) has no
digest here: its requests neither read nor write the pool (`adapter_digest` returns None).
"""

from __future__ import annotations

import logging
import os
import threading

import blake3

log = logging.getLogger("kvpool.connector")

READ_BYTES = 8 << 20  # per read while hashing (adapters are MBs to a few hundred MB)
MAX_FILES = 4096  # a directory with more files is not an adapter kvpool digests


def _files(root: str) -> list[str]:
    """The regular files under `root` (links followed), sorted by relative path."""
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames.sort()
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            if os.path.isfile(path):
                out.append(path)
                if len(out) > MAX_FILES:
                    raise ValueError(f"more than {MAX_FILES} files")
    return out


def _signature(root: str, files: list[str]) -> tuple:
    """What changes when any file is rewritten, replaced or added (cheap: stats only)."""
    sig = []
    for path in files:
        st = os.stat(path)
        sig.append((os.path.relpath(path, root), st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(sig)


def _digest(root: str, files: list[str]) -> bytes:
    h = blake3.blake3()
    for path in files:
        rel = os.path.relpath(path, root).encode()
        h.update(len(rel).to_bytes(4, "big") + rel)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            h.update(size.to_bytes(8, "big"))
            while chunk := f.read(READ_BYTES):
                h.update(chunk)
    return h.digest()


class AdapterDigests:
    """Per adapter path, the digest of its files, recomputed when their stats change."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[tuple, bytes]] = {}
        self._warned: set[str] = set()
        self._lock = threading.Lock()  # the scheduler thread and the lookup threads

    def digest(self, lora_request) -> bytes | None:
        """The content digest of a request's adapter, or None (not a local directory,
        unreadable): the request is then kept out of the pool."""
        path = str(getattr(lora_request, "lora_path", "") or "")
        try:
            if not os.path.isdir(path):
                raise FileNotFoundError("not a local directory")
            files = _files(path)
            sig = _signature(path, files)
            with self._lock:
                known = self._known.get(path)
            if known is not None and known[0] == sig:
                return known[1]
            value = _digest(path, files)
            if _signature(path, files) != sig:  # written while being read: no identity yet
                raise OSError("changed while being hashed")
        except (OSError, ValueError) as e:
            if path not in self._warned:
                self._warned.add(path)
                log.warning("kvpool: LoRA adapter %r (%s): %s; its requests do not use the "
                            "pool", getattr(lora_request, "lora_name", "?"), path, e)
            return None
        with self._lock:
            self._known[path] = (sig, value)
        if known is not None:
            log.info("kvpool: LoRA adapter %r at %s changed: a new key space for it",
                     getattr(lora_request, "lora_name", "?"), path)
        return value
