"""KV audit: per-block digests of what a save copied out of the paged KV cache and of what a
load left in it, so a test (or an operator chasing a suspected corruption) can prove that a
load wrote, bit for bit, the KV that was saved.

Off unless `KVPOOL_KV_AUDIT_DIR` names a directory. Each worker process appends JSON lines
to its own file there:
    {"e": "save", "key": <hex>, "r": <rank>, "d": [<digest of block 0>, ...]}  a saved chunk
    {"e": "load", "key": <hex>, "r": <rank>, "rows": [...], "d": [...]}       a loaded chunk
`key` is the logical chunk key and `r` the worker's rank tag (keys.py: "" for tensor rank 0
of stage 0, else e.g. "tp1/pp0"): a rank's load must equal what that rank saved, not what
another rank (other heads, another stage's layers) saved under the same chunk.
A save line is written when the chunk has been copied out, before it can be served to any
load (from the save buffer or the store), so no load line ever precedes its save line.
`check_audit` (used by the tests) compares them. The cost is one hash pass over every saved
and loaded block, plus a gather after each load.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch

from .layout import KVLayout

AUDIT_ENV = "KVPOOL_KV_AUDIT_DIR"


def block_digests(layout: KVLayout, payload: torch.Tensor, n_blocks: int) -> list[str | None]:
    """Digest of each block of a chunk payload (all layers of block j, in layer order), per
    KV cache group group-major (row g * n_blocks + j: the group's layers at position j);
    None for a position a group does not store (a sliding window's, layout.keep)."""
    hashers: list = [None] * (n_blocks * len(layout.groups))
    for g in range(len(layout.groups)):
        for j in range(n_blocks - layout.kept(g, n_blocks), n_blocks):
            hashers[g * n_blocks + j] = hashlib.blake2b(digest_size=16)
    for i, (layer_kv, segment) in enumerate(layout._segments(payload, n_blocks)):
        g = layout.group_of(i)
        first = g * n_blocks + n_blocks - layout.kept(g, n_blocks)
        for j in range(segment.shape[layer_kv.block_dim]):
            block = segment.select(layer_kv.block_dim, j).contiguous().view(torch.uint8)
            hashers[first + j].update(block.cpu().numpy().tobytes())
    return [h.hexdigest() if h is not None else None for h in hashers]


def paged_digests(layout: KVLayout, rows: list[int], block_ids: list[int],
                  n_in_src: int) -> list[str]:
    """Digest of what the paged cache holds at each loaded block, as block_digests names a
    payload's rows: the layers of row's group at that block."""
    out = []
    for row, b in zip(rows, block_ids, strict=True):
        g = row // n_in_src
        h = hashlib.blake2b(digest_size=16)
        for i, layer_kv in enumerate(layout.layers):
            if layout.group_of(i) == g:
                block = layer_kv.tensor.select(layer_kv.block_dim, b).contiguous()
                h.update(block.view(torch.uint8).cpu().numpy().tobytes())
        out.append(h.hexdigest())
    return out


class KVAudit:
    """Appends save/load digests of one worker process to `<dir>/audit-<pid>.jsonl`."""

    def __init__(self, directory: str, rank: str = "") -> None:
        os.makedirs(directory, exist_ok=True)
        self.rank = rank
        self.path = os.path.join(directory, f"audit-{os.getpid()}.jsonl")
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, rank: str = "") -> KVAudit | None:
        directory = os.environ.get(AUDIT_ENV)
        return cls(directory, rank) if directory else None

    def _write(self, records: list[dict]) -> None:
        text = "".join(json.dumps(r) + "\n" for r in records)
        with self._lock, open(self.path, "a") as f:
            f.write(text)

    def saved(self, layout: KVLayout, keys: list[bytes], chunks: list[torch.Tensor],
              blocks: int | list[int]) -> None:
        """`blocks`: blocks per object, one count for all or one per object (tails)."""
        t = time.time()
        counts = blocks if isinstance(blocks, list) else [blocks] * len(keys)
        self._write([{"e": "save", "key": k.hex(), "r": self.rank, "t": t,
                      "d": block_digests(layout, c, n)}
                     for k, c, n in zip(keys, chunks, counts, strict=True)])

    def loaded(self, layout: KVLayout, key: bytes, rows: list[int], block_ids: list[int],
               n_in_src: int) -> None:
        """What the paged cache holds at a load's destination blocks, after the load."""
        self._write([{"e": "load", "key": key.hex(), "r": self.rank, "rows": list(rows),
                      "t": time.time(),
                      "d": paged_digests(layout, rows, block_ids, n_in_src)}])


def check_audit(directory: str | Path) -> tuple[int, list[str]]:
    """(blocks loaded, problems): every loaded block must equal a block saved under the same
    chunk key, rank and position (by any process writing to this directory)."""
    saves: dict[tuple[str, str, int], set[str]] = defaultdict(set)
    loads: list[dict] = []
    for path in sorted(Path(directory).glob("audit-*.jsonl")):
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            rec = json.loads(line)
            if rec["e"] == "save":
                for j, d in enumerate(rec["d"]):
                    if d is not None:  # a position its group does not store
                        saves[(rec["key"], rec.get("r", ""), j)].add(d)
            else:
                loads.append(rec)
    problems, n = [], 0
    for rec in loads:
        for row, d in zip(rec["rows"], rec["d"], strict=True):
            n += 1
            rank = rec.get("r", "")
            known = saves.get((rec["key"], rank, row))
            where = f"chunk {rec['key'][:16]} block {row}" + (f" rank {rank}" if rank else "")
            if not known:
                problems.append(f"{where}: loaded, never saved")
            elif d not in known:
                problems.append(f"{where}: loaded bytes differ from every save")
    return n, problems
