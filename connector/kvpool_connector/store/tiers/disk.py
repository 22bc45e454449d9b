"""Local-disk tier: one file per object under <path>/<namespace>/<xx>/<key hex>.kv.

- Hard capacity: an in-memory index (key -> size, LRU order) is charged before each write
  and evicts the least recently used files until the new object fits.
- Atomic: objects are written to <namespace>/.tmp/ and renamed into place, so readers (in
  this or another process) see a whole object or none; fsync as configured.
- Large I/O: a single writev of header+payload; reads go straight into the caller's buffer
  (`get_many_into`) or one buffer per object, in 512 KiB pieces hashed while cache-hot. With
  direct_io, writes use O_DIRECT through a page-aligned copy (buffered where refused).
- Restart and sharing: the index is rebuilt from a directory scan at start (names and sizes
  only, oldest mtime first) and refreshed every rescan_seconds, which re-applies the capacity
  bound; reads always try the file itself and presence checks stat what the index lacks, so
  objects other processes (the engine's workers) wrote are found at once.
- A full disk or a permission error raises here; the orchestrator counts it and drops.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
from collections import OrderedDict

from ..format import Record, Status, check_header, hasher, header_size
from .base import BufferTooSmall, Tier, log

_SUFFIX = ".kv"
_ALIGN = 4096
_PIECE = 512 * 1024  # fits in L2: hashing reads what the copy just brought in
_STALE_TMP_SECONDS = 600


class DiskTier(Tier):
    type = "disk"
    needs_blob = False

    def __init__(self, cfg, namespace, stats) -> None:
        super().__init__(cfg, namespace, stats)
        self.root = os.path.join(os.path.abspath(cfg.path), namespace)
        self.tmpdir = os.path.join(self.root, ".tmp")
        self.capacity = cfg.size
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._written: dict[bytes, int] = {}  # key -> checksum of what this process wrote
        self._used = 0
        self._direct = bool(cfg.direct_io) and hasattr(os, "O_DIRECT")
        self._stop = threading.Event()
        try:
            os.makedirs(self.tmpdir, exist_ok=True)
        except OSError as e:  # e.g. read-only volume: writes will fail and be counted
            log.warning("disk tier: cannot create %s: %s", self.tmpdir, e)
        self.rescan()
        self._rescanner = None
        if cfg.rescan_seconds > 0:
            self._rescanner = threading.Thread(target=self._rescan_loop, daemon=True,
                                               name=f"kvpool-disk-rescan-{namespace}")
            self._rescanner.start()

    # -- paths and index ------------------------------------------------------------------
    def path(self, key: bytes) -> str:
        h = key.hex()
        return os.path.join(self.root, h[:2], h + _SUFFIX)

    def _scan(self) -> list[tuple[float, bytes, int]]:
        found = []
        now = time.time()
        try:
            tops = list(os.scandir(self.root))
        except OSError:
            return found
        for top in tops:
            if not top.is_dir(follow_symlinks=False):
                continue
            if top.name == ".tmp":
                self._clean_tmp(top.path, now)
                continue
            try:
                with os.scandir(top.path) as it:
                    for ent in it:
                        name = ent.name
                        if not name.endswith(_SUFFIX):
                            continue
                        try:
                            key = bytes.fromhex(name[:-len(_SUFFIX)])
                            st = ent.stat(follow_symlinks=False)
                        except (ValueError, OSError):
                            continue
                        found.append((st.st_mtime, key, st.st_size))
            except OSError:
                continue
        found.sort()
        return found

    @staticmethod
    def _clean_tmp(path: str, now: float) -> None:
        """Temp files of writers that died long ago (live writers finish in seconds)."""
        try:
            for ent in os.scandir(path):
                try:
                    if now - ent.stat().st_mtime > _STALE_TMP_SECONDS:
                        os.unlink(ent.path)
                except OSError:
                    pass
        except OSError:
            pass

    def rescan(self) -> None:
        """Rebuild the index from the directory, keeping our recency order for known keys."""
        found = self._scan()
        with self._lock:
            old = self._index
            new: OrderedDict[bytes, int] = OrderedDict((k, size) for _, k, size in found)
            for k in old:  # our recency order wins for the keys we know
                if k in new:
                    new.move_to_end(k)
            self._index = new
            self._written = {k: c for k, c in self._written.items() if k in new}
            self._used = sum(new.values())
            victims = self._evict_locked(0)
        self._unlink_all(victims)

    def _rescan_loop(self) -> None:
        while not self._stop.wait(self.cfg.rescan_seconds):
            try:
                self.rescan()
            except Exception as e:  # never let the thread die
                log.warning("disk tier: rescan failed: %s", e)

    def _evict_locked(self, incoming: int) -> list[bytes]:
        victims = []
        while self._index and self._used + incoming > self.capacity:
            k, size = self._index.popitem(last=False)
            self._written.pop(k, None)
            self._used -= size
            victims.append(k)
        return victims

    def _unlink_all(self, keys: list[bytes]) -> None:
        for k in keys:
            try:
                os.unlink(self.path(k))
            except FileNotFoundError:
                pass
            except OSError as e:
                log.debug("disk tier: eviction of %s failed: %s", k.hex()[:16], e)
        self.stats.inc("evictions", len(keys))

    def _forget(self, key: bytes) -> None:
        with self._lock:
            self._written.pop(key, None)
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size

    def _learn(self, key: bytes, size: int) -> None:
        with self._lock:
            old = self._index.pop(key, None)
            self._used += size - (old or 0)
            self._index[key] = size

    # -- writes ---------------------------------------------------------------------------
    def put_many(self, records: list[Record]) -> None:
        for rec in records:
            self._put(rec)

    def _put(self, rec: Record) -> None:
        hdr = rec.header()
        size = len(hdr) + len(rec.payload)
        if size > self.capacity:
            self.stats.inc("rejected")
            return
        with self._lock:
            if rec.key in self._index and self._written.get(rec.key) == rec.csum:
                self._index.move_to_end(rec.key)  # the same bytes are on disk already
                return
            old = self._index.pop(rec.key, None)
            self._used -= old or 0
            victims = self._evict_locked(size)
            self._index[rec.key] = size  # charged before writing: concurrent puts stay bounded
            self._used += size
            self._written.pop(rec.key, None)
        self._unlink_all(victims)
        final = self.path(rec.key)
        tmp = os.path.join(self.tmpdir, f"{rec.key.hex()}.{os.getpid()}.{threading.get_ident()}")
        try:
            self._write_file(tmp, hdr, rec.payload, size)
            try:
                os.rename(tmp, final)
            except FileNotFoundError:
                os.makedirs(os.path.dirname(final), exist_ok=True)
                os.rename(tmp, final)
            if self.cfg.fsync == "always":
                _fsync_dir(os.path.dirname(final))
        except BaseException:
            self._forget(rec.key)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        self._written[rec.key] = rec.csum
        self.stats.inc("bytes_in", len(rec.payload))

    def _write_file(self, tmp: str, hdr: bytes, payload: memoryview, size: int) -> None:
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except FileNotFoundError:
            os.makedirs(self.tmpdir, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            if self._direct and self._write_direct(fd, hdr, payload, size):
                pass
            else:
                _writev_all(fd, [hdr, payload])
            if self.cfg.fsync != "never":
                os.fsync(fd)
        finally:
            os.close(fd)

    def _write_direct(self, fd: int, hdr: bytes, payload: memoryview, size: int) -> bool:
        """O_DIRECT write of a page-aligned copy, then trim the padding; False = unsupported."""
        import fcntl

        padded = -(-size // _ALIGN) * _ALIGN
        buf = mmap.mmap(-1, padded)
        try:
            buf[:len(hdr)] = hdr
            buf[len(hdr):size] = payload
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            try:
                fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
            except OSError:
                self._direct = False
                return False
            try:
                _writev_all(fd, [buf])
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._direct = False
                fcntl.fcntl(fd, fcntl.F_SETFL, flags)
                os.lseek(fd, 0, os.SEEK_SET)
                return False
            os.ftruncate(fd, size)
            return True
        finally:
            buf.close()

    # -- reads ----------------------------------------------------------------------------
    def _open(self, key: bytes) -> int | None:
        try:
            return os.open(self.path(key), os.O_RDONLY)
        except FileNotFoundError:
            self._forget(key)
            return None

    def get_many(self, keys: list[bytes], layout: bytes) -> list[Record | None]:
        return [self._read(key, layout, None) for key in keys]

    def get_many_into(self, keys: list[bytes], layout: bytes,
                      outs: list[memoryview]) -> list[Record | None]:
        return [self._read(key, layout, out) for key, out in zip(keys, outs)]

    def _read(self, key: bytes, layout: bytes, out: memoryview | None) -> Record | None:
        """Read and verify one object into out (or a new buffer). The payload is read in
        pieces and each piece hashed while it is still in the CPU cache."""
        fd = self._open(key)
        if fd is None:
            return None
        blob = None
        try:
            size = os.fstat(fd).st_size
            hs = header_size(key)
            hdr = os.pread(fd, hs, 0)
            st, n, csum, stored_layout = check_header(hdr, key, layout, size)
            if st is not Status.CORRUPT:
                if out is None:
                    blob = memoryview(bytearray(size))
                    blob[:hs] = hdr
                    target = blob[hs:]
                elif n <= len(out):
                    target = out[:n]
                elif st is Status.OK:
                    raise BufferTooSmall(f"output buffer of {len(out)} bytes is smaller than "
                                         f"the object ({n})")
                else:
                    target = None  # foreign and too big to check: removed all the same
                if target is not None:
                    h = hasher(key, stored_layout)
                    if _read_hashing(fd, target, hs, h) != n or h.intdigest() != csum:
                        st = Status.CORRUPT
        finally:
            os.close(fd)
        if st is not Status.OK:
            self.reject(key, st)
            return None
        self._learn(key, size)
        self.stats.inc("bytes_out", n)
        return Record(key, layout, target, csum=csum, blob=blob, _header=hdr)

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        """The index answers; a key it lacks costs one stat (another process may have written
        it since the last rescan) and ends the answer at the first miss."""
        index, out = self._index, []
        for k in keys:
            if k not in index:
                try:
                    size = os.stat(self.path(k)).st_size
                except OSError:
                    break
                self._learn(k, size)
            out.append(True)
        return out + [False] * (len(keys) - len(out))

    def delete_many(self, keys: list[bytes]) -> None:
        for k in keys:
            self._forget(k)
            try:
                os.unlink(self.path(k))
            except FileNotFoundError:
                pass

    def usage(self) -> dict:
        with self._lock:
            return {"objects": len(self._index), "used_bytes": self._used,
                    "capacity_bytes": self.capacity}

    def close(self) -> None:
        self._stop.set()


def _writev_all(fd: int, bufs: list) -> None:
    views = [memoryview(b).cast("B") for b in bufs]
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def _read_hashing(fd: int, out: memoryview, offset: int, h) -> int:
    """Fill out from offset in _PIECE reads, hashing each piece while it is cache-hot;
    returns the bytes read (short only at end of file)."""
    total = 0
    while total < len(out):
        piece = out[total:total + _PIECE]
        n = os.preadv(fd, [piece], offset + total)
        if n == 0:
            break
        h.update(piece[:n])
        total += n
    return total


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
