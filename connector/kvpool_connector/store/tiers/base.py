"""The interface every tier implements, and the checks they share.

Tiers are plain, synchronous and may raise on backend errors: the orchestrator
(`..tiered`) owns timeouts, health, queues and never lets an error reach the caller.
Tiers verify what they read (`verify`) and delete what fails the check.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ..format import Record, Status, parse
from ..metrics import TierStats

log = logging.getLogger("kvpool.store")


class BufferTooSmall(ValueError):
    """get_many_into: a caller's buffer cannot hold the object (a caller error: it raises)."""


class Tier:
    type: str = ""
    #: calls may block on the network: the orchestrator runs them on a pool with a deadline
    remote: bool = False
    #: put_many needs Record.blob (one contiguous header+payload buffer)
    needs_blob: bool = True

    def __init__(self, cfg: Any, namespace: str, stats: TierStats) -> None:
        self.cfg = cfg
        self.namespace = namespace
        self.stats = stats

    def put_many(self, records: list[Record]) -> None:
        raise NotImplementedError

    def get_many(self, keys: list[bytes], layout: bytes) -> list[Record | None]:
        raise NotImplementedError

    def get_many_into(self, keys: list[bytes], layout: bytes,
                      outs: list[memoryview]) -> list[Record | None]:
        """Each hit's payload copied into its output buffer; the records say what was read.
        Tiers that can read straight into the buffers override this (cpu, disk)."""
        recs = self.get_many(keys, layout)
        for rec, out in zip(recs, outs):
            if rec is not None:
                copy_into(rec, out)
        return recs

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        """Presence per key; may answer False for keys after the first missing one (callers
        only need the present prefix)."""
        raise NotImplementedError

    def delete_many(self, keys: list[bytes]) -> None:
        raise NotImplementedError

    def usage(self) -> dict:
        """objects / used_bytes / capacity_bytes where the tier knows them."""
        return {}

    def close(self) -> None:
        pass

    def verify(self, key: bytes, layout: bytes, blob) -> Record | None:
        """The record in blob if it is intact and ours; else count, delete and return None."""
        st, rec = parse(blob, key, layout)
        if st is Status.OK:
            return rec
        self.reject(key, st)
        return None

    def verify_all(self, keys: list[bytes], layout: bytes, blobs: list) -> list[Record | None]:
        """verify() for a batch of fetched blobs (None = absent); counts bytes read."""
        out = [None if b is None else self.verify(k, layout, b) for k, b in zip(keys, blobs)]
        self.stats.inc("bytes_out", sum(len(r.payload) for r in out if r is not None))
        return out

    def reject(self, key: bytes, st: Status) -> None:
        self.stats.inc(st.value)
        log.warning("%s tier: %s object %s removed", self.type, st.value, key.hex()[:16])
        try:
            self.delete_many([key])
        except Exception as e:  # the next reader will find it again and retry
            log.debug("%s tier: delete of a bad object failed: %s", self.type, e)


def copy_into(rec: Record, out: memoryview) -> int:
    n = len(rec.payload)
    if n > len(out):
        raise BufferTooSmall(f"output buffer of {len(out)} bytes is smaller than the object ({n})")
    out[:n] = rec.payload
    return n


def secret(env_name: str | None, file_name: str | None = None, field: str = "") -> str | None:
    """A secret from an environment variable or a file; a named but missing source is an error."""
    if file_name:
        try:
            with open(file_name) as f:
                return f.read().strip()
        except OSError as e:
            raise ValueError(f"{field}_file: cannot read {file_name}: {e.strerror}") from e
    if env_name:
        val = os.environ.get(env_name)
        if val is None:
            raise ValueError(f"{field}_env: environment variable {env_name} is not set")
        return val
    return None
