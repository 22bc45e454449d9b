"""Local-disk tier: one file per object under <path>/<namespace>/<xx>/<name hex>.kv.

- Hard capacity: an in-memory index (name -> size, LRU order) is charged before each write
  and evicts the least recently used files until the new object fits; objects this process
  wrote with `Record.evict_first` (the connector's tails) go first. Names are sealed, so
  the mark is kept in the file's mode: an evict-first object is 0400, any other 0600 (both
  private; objects are never written in place, only replaced by a rename). The scan reads
  it from the lstat it makes anyway, so a restarted engine, or another process sharing the
  directory, still evicts tails first. The mode is trusted for eviction order only: a
  forged one moves an object up or down the eviction order, nothing else (every read
  checks the object's tag).
- Atomic: objects are written to <namespace>/.tmp/ and renamed into place, so readers (in
  this or another process) see a whole object or none; fsync as configured.
- Hostile directories: the namespace, temp and shard directories are real directories
  owned by this user with mode 0700 (checked at start, refused otherwise) and are held open;
  every file operation is relative to those descriptors and never follows a link. Objects
  are opened with O_NOFOLLOW | O_NONBLOCK and must be regular files (a symlink or FIFO
  planted at an object's path is a miss and is removed); temp files are created with
  O_EXCL | O_NOFOLLOW, mode 0600 (0400 when evict-first, set by fchmod, whatever the
  umask), under random names. The tier is `blocking`: its calls run
  with the store's deadline, so a hung mount costs a miss, never a stuck caller.
- Large I/O: a single writev of header + payload + tag; reads go in 512 KiB pieces through
  a per-thread scratch buffer, each piece authenticated while cache-hot and then copied to
  the caller's buffer, or decrypted from the scratch straight into it (never after the
  caller gave up); a failed check zeroes what was written there. With direct_io, writes use
  O_DIRECT through a page-aligned copy.
- Restart and sharing: the index is rebuilt from a directory scan at start (names and sizes
  only, oldest mtime first) and refreshed every rescan_seconds, which re-applies the capacity
  bound; reads always try the file itself and presence checks stat what the index lacks, so
  objects other processes (the engine's workers) wrote are found at once.
- A full disk or a permission error raises here; the orchestrator counts it and drops.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import secrets
import stat
import threading
import time
from collections import OrderedDict

import xxhash
from cryptography.exceptions import InvalidTag

from ..format import Header, Record, Status, check_header, header_size, uninitialized
from ..guard import current_guard
from ..sealing import TAG_SIZE, PoolKey
from .base import GCM_SLACK, PieceBuffers, Tier, log

_SUFFIX = ".kv"
_ALIGN = 4096
_PIECE = 512 * 1024  # fits in L2: the MAC reads what the copy just brought in
_STALE_TMP_SECONDS = 600
_DIR_MODE = 0o700
_FILE_MODE = 0o600
_FIRST_MODE = 0o400  # an evict-first object (a tail): the mark that survives a restart
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_O_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_O_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeDirectory(ValueError):
    """A tier directory that another user could tamper with (refused at start)."""


def _checked_dir_fd(name: str, parent_fd: int | None, what: str, create: bool = True) -> int:
    """Open a directory without following links (created 0700 first if `create`); it must
    be ours. FileNotFoundError when it does not exist and may not be created."""
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, _DIR_MODE, dir_fd=parent_fd)
    try:
        fd = os.open(name, _O_DIR, dir_fd=parent_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeDirectory(f"disk tier: {what} is not a real directory (a symlink or a "
                                  f"file is in its place)") from None
        raise
    info = os.fstat(fd)
    if info.st_uid != os.geteuid():
        os.close(fd)
        raise UnsafeDirectory(f"disk tier: {what} is owned by uid {info.st_uid}, not by this "
                              f"process (uid {os.geteuid()}); refusing to use it")
    if stat.S_IMODE(info.st_mode) != _DIR_MODE:
        try:
            os.fchmod(fd, _DIR_MODE)
        except OSError as e:  # a read-only volume: nobody can plant anything there either
            if e.errno != errno.EROFS:
                os.close(fd)
                raise
    return fd


class DiskTier(Tier):
    type = "disk"
    local = True
    hit_source = "disk"
    blocking = True
    needs_blob = False

    def __init__(self, cfg, namespace, stats, **kw) -> None:
        super().__init__(cfg, namespace, stats, **kw)
        self.base = os.path.realpath(cfg.path)  # an admin's symlinked mount point is fine
        self.root = os.path.join(self.base, namespace)
        self.capacity = cfg.size
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._first: OrderedDict[bytes, None] = OrderedDict()  # evict-first names, LRU order
        self._written: dict[bytes, int] = {}  # name -> xxh3 of the payload this process wrote
        self._used = 0
        self._direct = bool(cfg.direct_io) and hasattr(os, "O_DIRECT")
        self._stop = threading.Event()
        self._scratch = PieceBuffers(_PIECE)
        self._shards: dict[str, int] = {}
        os.makedirs(self.base, exist_ok=True)
        self._ns_fd = _checked_dir_fd(self.root, None, f"{self.root}")
        self._tmp_fd = _checked_dir_fd(".tmp", self._ns_fd, f"{self.root}/.tmp")
        for shard in self._shard_names():  # existing shards: checked now, held open
            self._shard_fd(shard)
        self.rescan()
        self._rescanner = None
        if cfg.rescan_seconds > 0:
            self._rescanner = threading.Thread(target=self._rescan_loop, daemon=True,
                                               name=f"kvpool-disk-rescan-{namespace}")
            self._rescanner.start()

    # -- paths and index ------------------------------------------------------------------
    @staticmethod
    def _file(name: bytes) -> tuple[str, str]:
        h = name.hex()
        return h[:2], h + _SUFFIX

    def path(self, name: bytes) -> str:
        """Where an object lives (for people and tests; the tier itself uses descriptors)."""
        shard, fname = self._file(name)
        return os.path.join(self.root, shard, fname)

    def _shard_names(self) -> list[str]:
        return [e for e in os.listdir(self._ns_fd)
                if len(e) == 2 and all(c in "0123456789abcdef" for c in e)]

    def _shard_fd(self, shard: str, create: bool = False) -> int | None:
        """The held-open shard directory; None when it does not exist (and not `create`)."""
        fd = self._shards.get(shard)
        if fd is None:
            with self._lock:
                fd = self._shards.get(shard)
                if fd is None:
                    try:
                        fd = _checked_dir_fd(shard, self._ns_fd, f"{self.root}/{shard}", create)
                    except FileNotFoundError:
                        return None
                    self._shards[shard] = fd
        return fd

    def _scan(self) -> list[tuple[float, bytes, int, bool]]:
        """(mtime, name, size, evict-first) of every object file, oldest first."""
        found: list[tuple[float, bytes, int, bool]] = []
        now = time.time()
        self._clean_tmp(now)
        try:
            shards = self._shard_names()
        except OSError:
            return found
        for shard in shards:
            try:
                fd = self._shard_fd(shard)
                if fd is None:
                    continue
                with os.scandir(fd) as it:
                    for ent in it:
                        name = ent.name
                        if not name.endswith(_SUFFIX):
                            continue
                        try:
                            key = bytes.fromhex(name[:-len(_SUFFIX)])
                            info = ent.stat(follow_symlinks=False)
                        except (ValueError, OSError):
                            continue
                        if stat.S_ISREG(info.st_mode):
                            found.append((info.st_mtime, key, info.st_size,
                                          _marked_first(info.st_mode)))
            except (OSError, UnsafeDirectory) as e:
                log.warning("disk tier: shard %s skipped: %s", shard, e)
        found.sort()
        return found

    def _clean_tmp(self, now: float) -> None:
        """Temp files of writers that died long ago (live writers finish in seconds)."""
        try:
            with os.scandir(self._tmp_fd) as it:
                for ent in it:
                    try:
                        if now - ent.stat(follow_symlinks=False).st_mtime > _STALE_TMP_SECONDS:
                            os.unlink(ent.name, dir_fd=self._tmp_fd)
                    except OSError:
                        pass
        except OSError:
            pass

    def rescan(self) -> None:
        """Rebuild the index from the directory, keeping our recency order for known names;
        the evict-first marks are the files' (their modes), as this process wrote them."""
        found = self._scan()
        with self._lock:
            old = self._index
            new: OrderedDict[bytes, int] = OrderedDict((k, size) for _, k, size, _ in found)
            for k in old:  # our recency order wins for the names we know
                if k in new:
                    new.move_to_end(k)
            first = OrderedDict((k, None) for _, k, _, mark in found if mark)
            for k in self._first:
                if k in first:
                    first.move_to_end(k)
            self._index = new
            self._first = first
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
        """Names to unlink so that `incoming` more bytes fit: evict-first ones, then LRU."""
        victims = []
        while self._index and self._used + incoming > self.capacity:
            k = None
            while self._first and k is None:
                k, _ = self._first.popitem(last=False)
                if k not in self._index:  # forgotten meanwhile
                    k = None
            if k is None:
                k, size = self._index.popitem(last=False)
                self._first.pop(k, None)
            else:
                size = self._index.pop(k)
            self._written.pop(k, None)
            self._used -= size
            victims.append(k)
        return victims

    def _unlink(self, name: bytes) -> None:
        shard, fname = self._file(name)
        fd = self._shard_fd(shard)
        if fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(fname, dir_fd=fd)

    def _unlink_all(self, names: list[bytes]) -> None:
        for k in names:
            try:
                self._unlink(k)
            except OSError as e:
                log.debug("disk tier: eviction of %s failed: %s", k.hex()[:16], e)
        self.stats.inc("evictions", len(names))
        self.note(False, names)

    def _forget(self, name: bytes) -> None:
        with self._lock:
            self._written.pop(name, None)
            self._first.pop(name, None)
            size = self._index.pop(name, None)
            if size is not None:
                self._used -= size

    def _learn(self, name: bytes, size: int, mode: int) -> None:
        """A file found present (read, or stat'ed for a presence check) is the most recent;
        a name the index lacked takes its evict-first mark from the file's mode."""
        with self._lock:
            old = self._index.pop(name, None)
            self._used += size - (old or 0)
            self._index[name] = size
            if old is None and _marked_first(mode):
                self._first[name] = None
            if name in self._first:
                self._first.move_to_end(name)

    def _mark_first(self, rec: Record) -> None:
        """Under the lock: note whether `rec` goes first when room is needed."""
        if rec.evict_first:
            self._first[rec.name] = None
            self._first.move_to_end(rec.name)
        else:
            self._first.pop(rec.name, None)

    # -- writes ---------------------------------------------------------------------------
    def put_many(self, records: list[Record]) -> list[bool]:
        return [self._put(rec) for rec in records]

    def _put(self, rec: Record) -> bool:
        hdr, body, tag = rec.parts()
        size = len(hdr) + len(body) + len(tag)
        if size > self.capacity:
            self.stats.inc("rejected")
            return False
        same = xxhash.xxh3_64_intdigest(rec.payload)
        with self._lock:
            if rec.name in self._index and self._written.get(rec.name) == same \
                    and (rec.name in self._first) == rec.evict_first:
                self._index.move_to_end(rec.name)  # the same bytes are on disk already
                self._mark_first(rec)
                return True
            old = self._index.pop(rec.name, None)
            self._used -= old or 0
            victims = self._evict_locked(size)
            self._index[rec.name] = size  # charged before writing: concurrent puts stay bounded
            self._mark_first(rec)
            self._used += size
            self._written.pop(rec.name, None)
        self._unlink_all(victims)
        shard, fname = self._file(rec.name)
        tmp = secrets.token_hex(16)
        try:
            shard_fd = self._shard_fd(shard, create=True)
            assert shard_fd is not None  # create=True makes it or raises
            self._write_file(tmp, [hdr, body, tag], size,
                             _FIRST_MODE if rec.evict_first else _FILE_MODE)
            os.rename(tmp, fname, src_dir_fd=self._tmp_fd, dst_dir_fd=shard_fd)
            if self.cfg.fsync == "always":
                os.fsync(shard_fd)
        except BaseException:
            self._forget(rec.name)
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self._tmp_fd)
            raise
        self._written[rec.name] = same
        self.stats.inc("bytes_in", len(body))
        self.note(True, (rec.name,))
        return True

    def _write_file(self, tmp: str, parts: list, size: int, mode: int) -> None:
        fd = os.open(tmp, _O_CREATE, _FILE_MODE, dir_fd=self._tmp_fd)
        try:
            # the evict-first mark, whatever the umask; a filesystem without modes loses
            # only the mark (the object is private by its directories either way)
            with contextlib.suppress(OSError):
                os.fchmod(fd, mode)
            if not (self._direct and self._write_direct(fd, parts, size)):
                _writev_all(fd, parts)
            if self.cfg.fsync != "never":
                os.fsync(fd)
        finally:
            os.close(fd)

    def _write_direct(self, fd: int, parts: list, size: int) -> bool:
        """O_DIRECT write of a page-aligned copy, then trim the padding; False = unsupported."""
        import fcntl

        padded = -(-size // _ALIGN) * _ALIGN
        buf = mmap.mmap(-1, padded)
        try:
            off = 0
            for p in parts:
                buf[off:off + len(p)] = p
                off += len(p)
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
    def _open(self, name: bytes) -> int | None:
        """A descriptor of the object if it is a regular file; None (and the intruder
        removed) otherwise."""
        shard, fname = self._file(name)
        shard_fd = self._shard_fd(shard)
        try:
            if shard_fd is None:
                raise FileNotFoundError(fname)
            fd = os.open(fname, _O_READ, dir_fd=shard_fd)
        except FileNotFoundError:
            self._forget(name)
            return None
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            fd = None  # a symlink where an object belongs
        if fd is not None and stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
        if fd is not None:
            os.close(fd)
        self.stats.inc("rejected")
        log.warning("disk tier: %s is not a regular file; removed", self.path(name))
        self._forget(name)
        self._unlink(name)
        return None

    def get_many(self, names: list[bytes], layout: bytes, key: PoolKey) -> list[Record | None]:
        return [self._read(name, layout, key, None) for name in names]

    def get_many_into(self, names: list[bytes], layout: bytes, key: PoolKey,
                      outs: list[memoryview]) -> list[Record | None]:
        return [self._read(name, layout, key, out) for name, out in zip(names, outs, strict=True)]

    def _read(self, name: bytes, layout: bytes, key: PoolKey,
              out: memoryview | None) -> Record | None:
        """Read and verify one object into out (or a new buffer), piece by piece."""
        fd = self._open(name)
        if fd is None:
            return None
        target = None
        try:
            info = os.fstat(fd)
            size = info.st_size
            if size > self.read_limit(name, out):
                self.stats.inc("rejected")  # never read whole what cannot be ours
                return None
            header_len = header_size(name)
            h = check_header(os.pread(fd, header_len, 0), name, layout, size)
            status: Status | None = h.status
            if status is not Status.CORRUPT:
                n = h.payload_len
                if status is Status.OK:
                    target = out[:n] if out is not None else uninitialized(n)
                tag = os.pread(fd, TAG_SIZE, header_len + n)
                # another layout's object is kept only once its tag proves a pool member
                # wrote it (checked without a byte reaching the caller); a forgery is corrupt
                authentic = self._read_verified(fd, h, key, tag, target)
                status = h.status if authentic is Status.OK else authentic
        finally:
            os.close(fd)
        if status is not Status.OK:
            if target is not None and out is not None:
                with current_guard().writing() as ok:
                    if ok:  # no unverified byte stays in the caller's buffer
                        target[:] = bytes(len(target))
            if status is not None:
                self.reject(name, status)
            return None
        assert target is not None  # set when the header was OK
        self._learn(name, size, info.st_mode)
        self.stats.inc("bytes_out", len(target))
        return Record(name, layout, target, key=key, encrypt=h.encrypted)

    def _read_verified(self, fd: int, h: Header, key: PoolKey, tag: bytes,
                       target: memoryview | None) -> Status | None:
        """Fill target with the (decrypted) payload. Pieces are read into this thread's
        scratch buffer and MAC'd there while cache-hot, then copied out, or decrypted from
        there straight into target, while the caller still waits (None: it gave up; nothing
        more was written). Until the tag checks out target is unverified: the caller zeroes
        it on any failure. Without a target the tag is only checked (nothing is written)."""
        n, off = h.payload_len, h.size
        raw, plain = self._scratch.raw, self._scratch.plain
        guard = current_guard()
        if h.encrypted:
            dec = key.decryptor(h.salt, h.raw, tag)
        else:
            dec = key.authenticator(h.salt, tag)
            dec.authenticate_additional_data(h.raw)
        done = 0
        while done < n:
            m = os.preadv(fd, [raw[:min(_PIECE, n - done)]], off + done)
            if m == 0:
                return Status.CORRUPT  # truncated under us
            if h.encrypted and target is not None and n - done >= m + GCM_SLACK:
                with guard.writing() as ok:  # decrypted straight into place: one copy less
                    if not ok:
                        return None
                    dec.update_into(raw[:m], target[done:])
                done += m
                continue
            if h.encrypted:
                dec.update_into(raw[:m], plain)
                piece = plain[:m]
            else:
                dec.authenticate_additional_data(raw[:m])
                piece = raw[:m]
            if target is None:
                done += m
                continue
            with guard.writing() as ok:
                if not ok:
                    return None
                target[done:done + m] = piece
            done += m
        try:
            dec.finalize()
        except InvalidTag:
            return Status.CORRUPT
        return Status.OK

    def contains_known(self, names: list[bytes]) -> list[bool] | None:
        """All in the index: present, answered in the caller's thread (the scheduler's
        lookups of a cached prefix skip the hop to the tier's pool)."""
        index = self._index
        return [True] * len(names) if all(k in index for k in names) else None

    def contains_many(self, names: list[bytes]) -> list[bool]:
        """The index answers; a name it lacks costs one stat (another process may have
        written it since the last rescan) and ends the answer at the first miss."""
        index, out = self._index, []
        for k in names:
            if k not in index:
                shard, fname = self._file(k)
                shard_fd = self._shard_fd(shard)
                if shard_fd is None:
                    break
                try:
                    info = os.stat(fname, dir_fd=shard_fd, follow_symlinks=False)
                except OSError:
                    break
                if not stat.S_ISREG(info.st_mode):
                    break
                self._learn(k, info.st_size, info.st_mode)
            out.append(True)
        return out + [False] * (len(names) - len(out))

    def delete_many(self, names: list[bytes]) -> None:
        for k in names:
            self._forget(k)
            self._unlink(k)
        self.note(False, names)

    def usage(self) -> dict:
        with self._lock:
            return {"objects": len(self._index), "used_bytes": self._used,
                    "capacity_bytes": self.capacity}

    def close(self) -> None:
        self._stop.set()
        if self._rescanner is not None:
            self._rescanner.join(timeout=5)
        with self._lock:
            fds = [self._ns_fd, self._tmp_fd, *self._shards.values()]
            self._shards = {}
            self._ns_fd = self._tmp_fd = -1
        for fd in fds:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)


def _marked_first(mode: int) -> bool:
    """An evict-first object's file: the owner may not write it (mode 0400)."""
    return not mode & stat.S_IWUSR


def _writev_all(fd: int, bufs: list) -> None:
    views = [memoryview(b).cast("B") for b in bufs if len(b)]
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
