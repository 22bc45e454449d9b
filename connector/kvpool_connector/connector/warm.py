"""Warm start: the I/O around the pool's hot set (store/hotset.py is the pure part).

Who does what:
- The scheduler half counts, at each admission of a request, the full chunks of its prompt
  that were reused (vLLM's prefix cache or a kvpool tier held them): only it sees the hits
  vLLM's own prefix cache serves, which on a busy engine are most hits of a hot prefix. A
  `ManifestWriter` merges those counts into the manifest in the shared tier every
  `warm_start.refresh_seconds` (and once at shutdown).
- A starting engine's worker reads the manifest and loads the top of it from the shared
  tier into its cpu tier (`Prewarmer`): a read through the store like any load (each
  object's MAC checked; a bad one is a miss), within `warm_start.max_bytes`, for at most
  `warm_start.max_seconds` inside `register_kv_caches`, which runs before vLLM's engine
  (and so its /health) is up; the rest continues on a background thread.
- The scheduler half, built after the workers registered, reads the same manifest and puts
  the keys the shared tier holds into its KeyIndex, so the first requests' hits are cpu tier
  hits loaded in the step (sync_local_loads).

The manifest holds key suffixes (keys without their key space prefix): it is stored under
rank 0's key space and every tensor-parallel rank puts its own prefix back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..store.hotset import HotSet, Manifest, decode, encode, merge

log = logging.getLogger("kvpool.connector")

MANIFEST_MARK = b"\x00hotset"
MANIFEST_LAYOUT = b"kvpool hot set manifest v1"  # its own layout: every process reads it
PREWARM_BATCH = 8  # objects per store read during pre-warm, each read with its own bound
CLOSE_WRITE_S = 5.0  # bound on the last manifest write at shutdown


def manifest_key(prefix0: bytes) -> bytes:
    """The manifest's key: rank 0's key space prefix and a marker no chunk key has."""
    return prefix0 + MANIFEST_MARK


def read_manifest(store, key: bytes) -> Manifest | None:
    """The manifest, or None (missing, or a miss: forged and corrupted objects are misses of
    the store, counted there; authentic bytes of another format are logged)."""
    data = store.get(key, layout=MANIFEST_LAYOUT, promote=False)
    if data is None:
        return None
    manifest = decode(data)
    if manifest is None:
        log.warning("kvpool: the warm start manifest is of an unknown format; ignored")
    return manifest


class ManifestWriter:
    """The scheduler half's hit counts and their periodic merge into the manifest."""

    def __init__(self, store, key: bytes, pool: str, top_k: int, refresh_seconds: float
                 ) -> None:
        self.store, self.key, self.pool, self.top_k = store, key, pool, top_k
        self.hot = HotSet(top_k)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.writes = 0
        self._thread = threading.Thread(target=self._run, args=(refresh_seconds,),
                                        name="kvpool-hotset", daemon=True)
        self._thread.start()

    def add(self, suffixes: list[bytes]) -> None:
        with self._lock:
            self.hot.add(suffixes)

    def refresh(self) -> bool:
        """Merge the hits since the last write into the stored manifest; False when there
        was nothing to write or the write failed (the hits are kept for the next one)."""
        with self._lock:
            delta = self.hot.take()
        if not delta:
            return False
        try:
            data = self.store.get(self.key, layout=MANIFEST_LAYOUT, promote=False)
            existing = decode(data)  # another format's authentic bytes: written over
            # a read that failed (a timeout, a tier down) is not an absent manifest: merging
            # into nothing would overwrite the pool's counts with this engine's alone
            ok = data is not None or not self.store.contains_many([self.key])[0]
            if ok:
                merged = merge(existing, delta, self.pool, self.top_k, time.time())
                ok = bool(self.store.put(self.key, encode(merged), layout=MANIFEST_LAYOUT))
        except Exception:  # the store never raises on backend errors; a bug must not kill us
            log.exception("kvpool: warm start manifest write failed")
            ok = False
        if not ok:
            with self._lock:
                for k, c in delta.items():
                    self.hot.add([k], c)
            return False
        self.writes += 1
        return True

    def _run(self, period: float) -> None:
        while not self._stop.wait(period):
            self.refresh()

    def close(self) -> None:
        """Stop the timer and write what was counted since the last refresh."""
        self._stop.set()
        self._thread.join(timeout=CLOSE_WRITE_S)
        self.refresh()


def prewarm_objects(max_bytes: int, cpu_bytes: int, chunk_bytes: int) -> int:
    """Chunks a warm start loads: within `max_bytes` and half the cpu tier (the rest stays
    for what the engine computes)."""
    return min(max_bytes, cpu_bytes // 2) // max(1, chunk_bytes)


def prewarm_keys(manifest: Manifest | None, prefix: bytes, max_objects: int) -> list[bytes]:
    """This rank's keys of the manifest's top `max_objects` entries."""
    if manifest is None:
        return []
    return [prefix + s for s, _ in manifest.entries[:max(0, max_objects)]]


@dataclass
class PrewarmResult:
    objects: int = 0
    nbytes: int = 0
    misses: int = 0
    seconds: float = 0.0
    done: bool = False  # every key was tried (False: the rest loads in the background)
    keys: list[bytes] = field(default_factory=list)  # the keys now in the cpu tier


class Prewarmer:
    """Reads `keys` through the store (a lower-tier hit is promoted into the cpu tier) until
    `max_bytes` are loaded: in the caller's thread for at most `max_seconds`, then the rest
    on a background thread. `on_loaded(keys, nbytes)` is called for every batch."""

    def __init__(self, store, keys: list[bytes], max_bytes: int,
                 on_loaded: Callable[[list[bytes], int], None] | None = None) -> None:
        self.store, self.keys, self.max_bytes = store, keys, max_bytes
        self.on_loaded = on_loaded
        self.result = PrewarmResult()
        self._next = 0
        self._t0 = 0.0
        self.thread: threading.Thread | None = None
        self._stop = False

    def run(self, max_seconds: float) -> PrewarmResult:
        """Load until done or `max_seconds`; then hand the rest to a background thread.
        Returns the result so far (`done` False while the background part runs)."""
        self._t0 = time.monotonic()
        self._load(self._t0 + max_seconds)
        if not self.result.done:
            self.thread = threading.Thread(target=self._load, args=(None,),
                                           name="kvpool-prewarm", daemon=True)
            self.thread.start()
        return self.result

    def stop(self) -> None:
        self._stop = True
        if self.thread is not None:
            self.thread.join(timeout=CLOSE_WRITE_S)

    def _load(self, deadline: float | None) -> None:
        r = self.result
        while self._next < len(self.keys) and r.nbytes < self.max_bytes and not self._stop:
            if deadline is not None and time.monotonic() >= deadline:
                return
            batch = self.keys[self._next:self._next + PREWARM_BATCH]
            self._next += len(batch)
            try:
                got = self.store.get_many(batch)
            except Exception:  # the store never raises on backend errors
                log.exception("kvpool: pre-warm read failed")
                got = [None] * len(batch)
            loaded = [k for k, p in zip(batch, got, strict=True) if p is not None]
            nbytes = sum(len(p) for p in got if p is not None)
            r.objects += len(loaded)
            r.nbytes += nbytes
            r.misses += len(batch) - len(loaded)
            r.keys.extend(loaded)
            r.seconds = time.monotonic() - self._t0
            if self.on_loaded is not None and loaded:
                self.on_loaded(loaded, nbytes)
        r.done = True
        r.seconds = time.monotonic() - self._t0
