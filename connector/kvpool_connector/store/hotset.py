"""The pool's hot set: the most-hit chunk keys with their hit counts, and its manifest.

Warm start (connector/warm.py) keeps one manifest object per key space in the shared tier:
running engines count which chunks their requests reuse (`HotSet`), merge their counts into
the manifest every `warm_start.refresh_seconds` (`merge`), and a starting engine reads it
and loads the top of it into its cpu tier. Pure: no I/O, no clock (`merge` is given the time).

Counts fade with time, not with merges: each merge ages the stored counts by
2^(-elapsed / HALF_LIFE_S) since the manifest was last written, whichever engine writes it,
so ten engines refreshing every minute age it as much as one (an earlier 7/8 per merge
dropped a chunk hit once at the next merge of any engine). Counts are kept in 1/HIT_UNITS of
a hit, so a single hit survives sixteen half-lives.

The manifest is stored like any object (sealed with the pool key, store/format.py): a
forged or corrupted one is a miss of the store, counted as `corrupt`. `decode` also refuses
authentic bytes it cannot parse (another version) and returns None; it never raises.

Manifest v2, little endian:

    magic b"KVHS", version u8 (2), pool name length u16, pool name (utf-8),
    written at u64 (unix seconds), entry count u32, then per entry: key length u8, key,
    count u64 (in 1/HIT_UNITS of a hit)

Keys in a manifest are *key suffixes*: the connector's chunk keys without their 16-byte key
space prefix (connector/keys.py), so every tensor-parallel rank puts its own prefix back.
"""

from __future__ import annotations

import struct
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MAGIC = b"KVHS"
VERSION = 2
MAX_ENTRIES = 1 << 20          # refused beyond this (a manifest is top-K, K <= 2**20)
MAX_COUNT = (1 << 64) - 1
PRUNE_FACTOR = 4               # a HotSet holds at most this many times top_k keys
HALF_LIFE_S = 3600.0           # a count halves every hour without new hits
HIT_UNITS = 1 << 16            # a hit in the manifest's counts (a merge floors: 1/65536 lost)
_HEAD = struct.Struct("<4sBH")
_TIME = struct.Struct("<Q")
_HITS = struct.Struct("<Q")
_COUNT = struct.Struct("<I")


@dataclass(frozen=True)
class Manifest:
    pool: str
    entries: list[tuple[bytes, int]]  # (key suffix, hits in HIT_UNITS), most-hit first
    written_at: int = 0               # unix seconds of the write these counts are aged to


class HotSet:
    """Hit counts per key, bounded: past PRUNE_FACTOR * top_k keys it keeps the top
    2 * top_k (a key that is hit again comes back with its new hits). `take()` returns the
    counts since the last take (what a refresh merges into the manifest) and resets them."""

    def __init__(self, top_k: int) -> None:
        if top_k < 1:
            raise ValueError("top_k must be at least 1")
        self.top_k = top_k
        self._counts: Counter[bytes] = Counter()

    def add(self, keys: Iterable[bytes], n: int = 1) -> None:
        for k in keys:
            self._counts[k] += n
        if len(self._counts) > PRUNE_FACTOR * self.top_k:
            self._counts = Counter(dict(self._counts.most_common(2 * self.top_k)))

    def __len__(self) -> int:
        return len(self._counts)

    def take(self) -> dict[bytes, int]:
        out, self._counts = dict(self._counts), Counter()
        return out


def merge(existing: Manifest | None, delta: dict[bytes, int], pool: str, top_k: int,
          now: float) -> Manifest:
    """The manifest after adding one engine's hits since its last write (`delta`, in hits)
    at unix time `now`: the stored counts aged by the time since they were written (so
    yesterday's hot set fades out; a writer's clock behind the manifest's ages nothing),
    plus the new hits, top `top_k` kept. A manifest of another pool (a renamed namespace)
    is not merged into."""
    counts: Counter[bytes] = Counter()
    if existing is not None and existing.pool == pool:
        factor = 0.5 ** (max(0.0, now - existing.written_at) / HALF_LIFE_S)
        for k, c in existing.entries:
            aged = int(c * factor)
            if aged > 0:
                counts[k] = aged
    for k, c in delta.items():
        counts[k] += c * HIT_UNITS
    top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:top_k]
    return Manifest(pool, [(k, min(c, MAX_COUNT)) for k, c in top], int(now))


def encode(manifest: Manifest) -> bytes:
    pool = manifest.pool.encode()
    parts = [_HEAD.pack(MAGIC, VERSION, len(pool)), pool, _TIME.pack(manifest.written_at),
             _COUNT.pack(len(manifest.entries))]
    for k, c in manifest.entries:
        if not 0 < len(k) < 256:
            raise ValueError(f"hot set key of {len(k)} bytes (1..255)")
        parts += [bytes([len(k)]), k, _HITS.pack(c)]
    return b"".join(parts)


def decode(data: bytes | memoryview | None) -> Manifest | None:
    """The manifest in `data`, or None for anything else (never raises)."""
    if data is None:
        return None
    try:
        b = bytes(data)
        magic, version, pool_len = _HEAD.unpack_from(b, 0)
        if magic != MAGIC or version != VERSION:
            return None
        at = _HEAD.size
        raw_pool = b[at:at + pool_len]
        if len(raw_pool) != pool_len:
            return None
        pool = raw_pool.decode()
        at += pool_len
        (written_at,) = _TIME.unpack_from(b, at)
        at += _TIME.size
        (n,) = _COUNT.unpack_from(b, at)
        at += _COUNT.size
        if n > MAX_ENTRIES:
            return None
        entries = []
        for _ in range(n):
            klen = b[at]
            key = b[at + 1:at + 1 + klen]
            (count,) = _HITS.unpack_from(b, at + 1 + klen)
            if klen == 0 or len(key) != klen:
                return None
            entries.append((key, count))
            at += 1 + klen + _HITS.size
        if at != len(b):
            return None
        return Manifest(pool, entries, written_at)
    except (struct.error, IndexError, UnicodeDecodeError):
        return None


def suffixes(keys: Sequence[bytes], prefix_len: int) -> list[bytes]:
    """Keys without their key space prefix, for the manifest."""
    return [k[prefix_len:] for k in keys]
