"""Stale host regions of vLLM's native offloading: removed at engine start.

vLLM 0.32 keeps the native host tier in one file, `/dev/shm/vllm_offload_<engine>.mmap`, of the
whole `cpu_bytes_to_use`, and checks /dev/shm's free space before creating it. An engine killed
before its cleanup (SIGKILL, an OOM kill; vLLM issue 51317) leaves the file behind, and a
container restart keeps the pod's /dev/shm emptyDir: the next start finds the space taken and
refuses ("Insufficient space in /dev/shm for CPU KV offload shared region").

A region is stale when no process holds it open or maps it. The kernel answers that, not a
scan of /proc (which cannot see every process, nor tell files of other mount namespaces apart):
a write lease (`F_SETLEASE F_WRLCK`) is granted only while no other open file description of
the file exists, and every mapping keeps the one it was made from. So a region is removed only
under a lease: a live engine's region (mapped, or only open, as by a creator between its open
and its mmap) refuses the lease and stays. A file the lease cannot be taken on for another
reason (another user's, a file system without leases) stays too. Regions are opened without
following links, and only plain files are considered.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
from pathlib import Path

logger = logging.getLogger(__name__)

SHM = Path("/dev/shm")
REGION_GLOB = "vllm_offload_*.mmap"
F_SETLEASE = getattr(fcntl, "F_SETLEASE", 1024)  # Linux: F_LINUX_SPECIFIC_BASE + 0


def _remove_if_unheld(path: Path) -> int | None:
    """Unlink `path` if nobody else holds it: its size, or None when it stays."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None  # gone, a link, or not ours to open
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        try:
            fcntl.fcntl(fd, F_SETLEASE, fcntl.F_WRLCK)
        except OSError:
            return None  # someone holds it open or maps it (EAGAIN), or no lease here
        try:
            if os.lstat(path).st_ino != st.st_ino:
                return None  # replaced since it was opened
            os.unlink(path)
        finally:
            fcntl.fcntl(fd, F_SETLEASE, fcntl.F_UNLCK)
        return st.st_blocks * 512
    finally:
        os.close(fd)


def remove_stale_regions(shm: Path = SHM) -> list[str]:
    """Unlink the regions in `shm` no process holds; their names. Never raises: a region it
    cannot remove stays (vLLM then says whether the space suffices)."""
    removed = []
    try:
        paths = sorted(shm.glob(REGION_GLOB))
    except OSError:
        return []
    for path in paths:
        try:
            nbytes = _remove_if_unheld(path)
        except OSError as exc:
            logger.warning("kvpool: cannot remove the stale host region %s: %s", path, exc)
            continue
        if nbytes is None:
            continue
        removed.append(path.name)
        logger.warning("kvpool: removed %s (%.0f MiB), a native host region no process holds "
                       "(left by an engine killed before its cleanup)", path, nbytes / 2**20)
    return removed
