"""What the scheduler side keeps per live request, and the index of chunks the workers hold.

`RequestRecord` is one request's state across the scheduler's hooks (lookup, admission, save
plans, handovers, tails), kept apart from the hooks themselves (scheduler.py) so that the
state's shape (per-group block ids for hybrid models next) changes in one place;
`KeyIndex` is the bounded set of chunks the workers copied into their own first tier, what
a lookup answers inline.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from .handover import Handover, HandoverObjects
from .metadata import LoadJob


@dataclass
class RequestRecord:
    """What the scheduler side keeps about one live request."""

    request: Any
    # the key space prefix of its chunks: the engine's, or its LoRA adapter's (keys.py);
    # b"": none (an adapter kvpool cannot identify): it neither reads nor writes the pool
    prefix: bytes = b""
    # its adapter's files were being digested when it arrived (adapters.py): held back until
    # the digest is known (prefix set), for at most scheduler.ADAPTER_WAIT_S from this time
    adapter_wait_since: float | None = None
    hit_chunks: int = 0             # leading chunks the store had at lookup
    lookup: tuple[int, int, float] | None = None  # (n block hashes, hit chunks, time)
    next_save: int = 0              # first chunk not yet planned for saving
    pending_copies: int = 0         # save jobs whose block copy is not confirmed
    load: LoadJob | None = None
    hit_local_index: int = 0        # of hit_chunks, how many came from the KeyIndex
    # a remote lookup in flight: (n block hashes, local hits, Future of a RemoteAnswer)
    pending: tuple[int, int, Future] | None = None
    remote_tail: RemoteAnswer | None = None  # the last remote lookup's, for TailPlans.lookup
    local_tokens: int = 0           # tokens vLLM's prefix cache held at the latest lookup
    admitted_cached: int = 0        # local + external tokens at the latest admission
    tail_blocks: int = 0            # blocks of the tail object found after hit_chunks
    tail_key: bytes | None = None
    tail_local: bool = False        # the tail was found in the KeyIndex
    part_tokens: int = 0            # tokens of the partial-block object after the tail
    part_key: bytes | None = None
    part_local: bool = False        # the partial-block object was found in the KeyIndex
    load_async: bool = True         # the last match's load: between steps, or in the step
    prompt_tail_done: bool = False  # the tail at prefill end was planned (or not needed)
    # prefill/decode (handover.py). Prefill: saves are written through to the shared tiers
    handover_out: bool = False
    durable_pending: int = 0        # durable save jobs (x world size) not yet reported
    durable_failed: set[bytes] | None = None  # their keys not written through
    durable_bytes: int = 0          # written through so far (handover_max_bytes caps it)
    durable_capped: bool = False    # past a cap: the rest is saved behind, not handed over
    # decode: the handover it was given; "wait" until its objects are visible, then "ready"
    # (loaded as a hit) or "off" (timed out, malformed, not this prompt: an ordinary lookup)
    handover_in: Handover | None = None
    handover_state: str = "off"
    handover_keys: HandoverObjects | None = None
    handover_deadline: float = 0.0
    handover_check: Future | None = None
    handover_checked_at: float = 0.0

    def all_local(self) -> bool:
        """Whether the match (chunks and tail) came from the KeyIndex: chunks the workers
        hold in their own memory, copied in a memcpy each (if one was evicted meanwhile, its
        blocks are load errors and vLLM recomputes them, as with any broken promise)."""
        return (self.hit_local_index >= self.hit_chunks
                and (self.tail_key is None or self.tail_local)
                and (self.part_key is None or self.part_local))


@dataclass
class RemoteAnswer:
    """What a remote lookup found: `more` leading chunks after the local ones, then (when
    tails were asked for) the longest tail present right after chunk `tail_at`."""

    more: int
    tail_at: int = -1
    tail_key: bytes | None = None
    part_at: int = -1               # the full blocks the partial-block candidates followed
    part_key: bytes | None = None


class KeyIndex:
    """Bounded LRU set of keys the workers stored in their local first tier (cpu or disk)."""

    def __init__(self, capacity: int):
        self.capacity = max(1, capacity)
        self._d: OrderedDict[bytes, None] = OrderedDict()

    def add(self, key: bytes) -> None:
        self._d[key] = None
        self._d.move_to_end(key)
        while len(self._d) > self.capacity:
            self._d.popitem(last=False)

    def discard(self, key: bytes) -> None:
        self._d.pop(key, None)

    def __contains__(self, key: bytes) -> bool:
        return key in self._d

    def prefix_len(self, keys: list[bytes]) -> int:
        n = 0
        for k in keys:
            if k not in self._d:
                break
            n += 1
        return n
