"""LoRA adapters' identity in the key space: a digest of the files the engine loads.

vLLM's block hashes name an adapter by `lora_name` and `lora_path` (kv_cache_utils's
`_gen_lora_extra_hash_keys`), so a new version written over the old one's path hashes like
the old one, and a shared tier would serve the old version's KV to the new one, with a
valid MAC. The scheduler half gives every adapter request the key space prefix of its
adapter's content (keys.py `adapter_prefix`): a BLAKE3 digest of the files vLLM's loader
reads (`LoRAModel.from_local_checkpoint`, `PEFTHelper`): `adapter_config.json` and the
first of `adapter_model.safetensors`, `.bin`, `.pt` (links followed as the loader follows
them: a Hugging Face cache snapshot links its files into blobs), at most MAX_BYTES.

The digest is taken at an adapter's first request and its files' stats (size, mtime,
ctime, inode: ctime too, since `cp -p` or `rsync --inplace -t` keep the mtime) are checked
on every request; when they moved, the files are digested again. Digests run on a thread of
their own, never the engine core's (an adapter is MBs to GBs): meanwhile `digest` answers
PENDING, and the scheduler holds that request back (its lookup is "in flight") for at most
scheduler.ADAPTER_WAIT_S, after which it runs without the pool. An adapter whose content
changes while the engine runs is kept out of the pool (no lookups, no saves) until the
engine restarts: the engine may still hold the old version in its LoRA cache and compute
the old version's KV, which must not be saved under the new version's key space (a fresh
engine would load it). It says so once in the log, and in
kvpool_lora_adapters_changed_total. A fresh engine digests the new files.

An adapter whose path is not a local directory (a hub id resolved by the worker), or whose
files cannot be read or are larger than MAX_BYTES, has no digest here: its requests neither
read nor write the pool (`digest` returns None).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait as wait_futures
from typing import Final

import blake3

from .keys import adapter_prefix

log = logging.getLogger("kvpool.connector")

READ_BYTES = 8 << 20  # per read while hashing (adapters are MBs to a few hundred MB)
MAX_BYTES = 4 << 30  # a larger adapter is not digested (its requests stay out of the pool)
CONFIG = "adapter_config.json"
WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")  # vLLM's order


def _files(root: str) -> list[str]:
    """The files vLLM loads for the adapter at `root`: its config and its weights."""
    config = os.path.join(root, CONFIG)
    weights = next((p for p in (os.path.join(root, w) for w in WEIGHTS) if os.path.isfile(p)), None)
    if not os.path.isfile(config) or weights is None:
        raise FileNotFoundError(f"no {CONFIG} and {' / '.join(WEIGHTS)}")
    return [config, weights]


def _signature(root: str, files: list[str]) -> tuple:
    """What changes when a file is rewritten or replaced (cheap: stats only)."""
    sig = []
    for path in files:
        st = os.stat(path)
        sig.append((os.path.relpath(path, root), st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                    st.st_ino, st.st_dev))
    if sum(entry[1] for entry in sig) > MAX_BYTES:
        raise ValueError(f"larger than {MAX_BYTES >> 30} GiB")
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


class _Pending:
    def __repr__(self) -> str:
        return "PENDING"


PENDING: Final = _Pending()  # the adapter's files are being digested: ask again


class AdapterDigests:
    """Per adapter path, the digest of its files; a path whose files changed since is out."""

    def __init__(self, on_changed: Callable[[], None] | None = None) -> None:
        self._known: dict[str, tuple[tuple, bytes]] = {}
        self._changed: set[str] = set()  # out of the pool until the engine restarts
        self._warned: set[str] = set()
        self._running: dict[str, Future] = {}  # path -> its digest in flight
        self._on_changed = on_changed
        self._lock = threading.Lock()  # the scheduler thread and the digest thread
        self._pool: ThreadPoolExecutor | None = None  # started at the first adapter

    def digest(self, lora_request) -> bytes | None | _Pending:
        """The content digest of a request's adapter; PENDING while its files are being
        digested (off this thread); None (not a local directory, unreadable, too large, or
        changed while this engine runs): the request is then kept out of the pool. Only the
        files' stats are read here."""
        path = str(getattr(lora_request, "lora_path", "") or "")
        name = getattr(lora_request, "lora_name", "?")
        with self._lock:
            if path in self._changed:
                return None
        try:
            if not os.path.isdir(path):
                raise FileNotFoundError("not a local directory")
            files = _files(path)
            sig = _signature(path, files)
        except (OSError, ValueError) as e:
            self._warn(path, name, e)
            return None
        with self._lock:
            known = self._known.get(path)
            if known is not None and known[0] == sig:
                return known[1]
            if path in self._running:
                return PENDING
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpool-adapter-digest")
            self._running[path] = self._pool.submit(self._hash, path, name, files, sig, known)
        return PENDING

    def _hash(self, path: str, name: str, files: list[str], sig: tuple,
              known: tuple[tuple, bytes] | None) -> None:
        try:
            value = _digest(path, files)
            if _signature(path, files) != sig:  # written while being read: no identity yet
                raise OSError("changed while being hashed")
            if known is not None and known[1] != value:  # new content (stats alone: touched)
                self._changed_under_us(path, name)
            else:
                with self._lock:
                    self._known[path] = (sig, value)
        except (OSError, ValueError) as e:
            self._warn(path, name, e)
        finally:
            with self._lock:
                self._running.pop(path, None)

    def prefix(self, engine_prefix: bytes, request) -> bytes | None:
        """The key space prefix of a request's chunks: the engine's without an adapter, else
        its adapter's content's (keys.py `adapter_prefix`), not its name and path; b"" when
        the adapter has no digest here (the request stays out of the pool), None while its
        files are being digested."""
        lora = getattr(request, "lora_request", None)
        if lora is None:
            return engine_prefix
        digest = self.digest(lora)
        if digest is PENDING:
            return None
        return adapter_prefix(engine_prefix, digest) if isinstance(digest, bytes) else b""

    def wait(self, timeout: float | None = None) -> bool:
        """Whether every digest in flight finished within `timeout` (tests, shutdown)."""
        with self._lock:
            running = list(self._running.values())
        return not wait_futures(running, timeout=timeout).not_done

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _warn(self, path: str, name: str, error: Exception) -> None:
        with self._lock:
            if path in self._warned:
                return
            self._warned.add(path)
        log.warning("kvpool: LoRA adapter %r (%s): %s; its requests do not use the pool",
                    name, path, error)

    def _changed_under_us(self, path: str, name: str) -> None:
        with self._lock:
            if path in self._changed:
                return
            self._changed.add(path)
        log.warning("kvpool: LoRA adapter %r at %s changed while this engine runs: its requests "
                    "stay out of the pool until the engine restarts (the engine may still hold "
                    "the old version and compute its KV)", name, path)
        if self._on_changed is not None:
            self._on_changed()
