"""A real subscriber of vLLM's KV event stream (ZMQ PUB, msgpack), as an external router
would run it: multipart frames (topic, 8-byte big-endian sequence number, payload), the
payload an EventBatch `[ts, events, data_parallel_rank]` whose events are tagged maps
(`{"type": "BlockStored", ...}`) or, from older publishers, positional arrays
(`["BlockStored", field, ...]`). Both decode to plain dicts here.
"""

from __future__ import annotations

import time
from typing import Any

import msgpack

# Field order of the positional (array) form, as vLLM's structs declare them.
FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                    "kv_cache_spec_sliding_window", "locality", "ownership", "session_id"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx", "locality", "ownership"),
    "AllBlocksCleared": (),
}


def decode_event(raw: Any) -> dict[str, Any]:
    if isinstance(raw, dict):
        return dict(raw)
    kind, *values = raw
    # vLLM versions send more or fewer fields: the known ones present are named
    return {"type": kind, **dict(zip(FIELDS.get(kind, ()), values, strict=False))}


def decode_batch(payload: bytes) -> tuple[float, list[dict[str, Any]], int | None]:
    """(ts, events, dp rank) of one EventBatch."""
    ts, events, *rest = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    return ts, [decode_event(e) for e in events], (rest[0] if rest else None)


class KVEventSubscriber:
    """SUB socket on a publisher's endpoint; `poll` collects decoded events for a while."""

    def __init__(self, endpoint: str, topic: str = ""):
        import zmq

        self._zmq = zmq
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sock.connect(endpoint)
        self.seqs: list[int] = []
        self.events: list[dict[str, Any]] = []

    def poll(self, seconds: float) -> list[dict[str, Any]]:
        """Events received within `seconds` (bounded), also appended to self.events."""
        got: list[dict[str, Any]] = []
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000) + 1):
                break
            _topic, seq, payload = self.sock.recv_multipart()
            self.seqs.append(int.from_bytes(seq, "big"))
            got += decode_batch(payload)[1]
        self.events += got
        return got

    def wait_for(self, pred, timeout: float, what: str) -> list[dict[str, Any]]:
        """Poll until pred(all events so far) is truthy; bounded."""
        deadline = time.monotonic() + timeout
        while not pred(self.events):
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout}s; got "
                                     f"{[(e['type'], e.get('medium')) for e in self.events][-20:]}")
            self.poll(0.5)
        return self.events

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()
