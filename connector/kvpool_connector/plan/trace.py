"""Request traces `kvpool plan` replays: one parser per published format, each line a JSON
object with the prompt's length and the hashes of its token blocks.

- **mooncake** (kvcache-ai/Mooncake, FAST25-release/traces): `timestamp` (ms),
  `input_length`, `output_length`, `hash_ids`: remapped hashes of 512-token prefix blocks.
- **bailian** (alibaba-edu/qwen-bailian-usagetraces-anon): the same fields with `timestamp`
  in seconds, 16-token blocks, and `chat_id`, `parent_chat_id`, `turn`, `type`.

Either way, equal hash ids at the same position of two prompts with equal ids before it are
the same tokens: the planner keys a block by the chain of ids up to it (as vLLM and kvpool
key a block by its whole prefix), which holds whether a format hashes prefixes (Mooncake) or
each block alone (Bailian). Bad input is a `TraceError` naming the line and field.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

FORMATS = {"mooncake": 512, "bailian": 16}   # format -> tokens per hash block
MAX_REQUESTS = 5_000_000   # a replay holds every request's hash ids in memory


class TraceError(ValueError):
    """A trace the planner cannot read; the message names the line and the field."""


@dataclass(frozen=True, slots=True)
class Request:
    t: float                   # arrival, seconds from the trace's start
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]  # one per block of `block_tokens` (a partial last one or not)
    session: int | None = None  # the conversation (Bailian: the root chat_id), for sticky routing


@dataclass(frozen=True)
class Trace:
    format: str
    block_tokens: int
    requests: list[Request]

    @property
    def duration_s(self) -> float:
        return (self.requests[-1].t - self.requests[0].t) if self.requests else 0.0


def detect(first: dict) -> str:
    """The format of a trace from its first record (pure)."""
    return "bailian" if "chat_id" in first else "mooncake"


def _int(rec: dict, field: str, where: str, minimum: int = 0) -> int:
    v = rec.get(field)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise TraceError(f"{where}: field {field!r} must be an integer >= {minimum}, not {v!r}")
    return v


def parse_record(rec: object, fmt: str, block_tokens: int, where: str,
                 roots: dict[int, int] | None = None) -> Request:
    """One JSON record -> Request (pure but for `roots`: a Bailian chat's root chat, filled
    as chats arrive, so a turn joins the conversation its parent began)."""
    if not isinstance(rec, dict):
        raise TraceError(f"{where}: a request must be a JSON object, not {type(rec).__name__}")
    ts = rec.get("timestamp")
    if isinstance(ts, bool) or not isinstance(ts, int | float) or ts < 0:
        raise TraceError(f"{where}: field 'timestamp' must be a number >= 0, not {ts!r}")
    n_in = _int(rec, "input_length", where, 1)
    n_out = _int(rec, "output_length", where, 0)
    ids = rec.get("hash_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                            for i in ids):
        raise TraceError(f"{where}: field 'hash_ids' must be a list of integers")
    need = -(-n_in // block_tokens)  # a partial last block hashed (Mooncake) or not
    if len(ids) not in (need, n_in // block_tokens):
        raise TraceError(f"{where}: field 'hash_ids' has {len(ids)} blocks; input_length "
                         f"{n_in} in {block_tokens}-token blocks needs {need}")
    session = None
    if fmt == "bailian":
        chat = _int(rec, "chat_id", where)
        parent = rec.get("parent_chat_id", -1)
        session = (roots or {}).get(parent, chat) if isinstance(parent, int) else chat
        if roots is not None:
            roots[chat] = session
    return Request(ts / 1000.0 if fmt == "mooncake" else float(ts), n_in, n_out, tuple(ids),
                   session)


def parse_lines(lines: Iterable[str], fmt: str | None = None, block_tokens: int | None = None,
                source: str = "trace", max_requests: int = MAX_REQUESTS) -> Trace:
    """JSON lines -> Trace, requests in arrival order (stable for equal timestamps). `fmt`
    None detects it from the first record; `block_tokens` None takes the format's."""
    if fmt is not None and fmt not in FORMATS:
        raise TraceError(f"--format {fmt!r}: not one of {', '.join(FORMATS)}")
    requests: list[Request] = []
    roots: dict[int, int] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{source} line {n}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
        if fmt is None:
            fmt = detect(rec) if isinstance(rec, dict) else "mooncake"
        if block_tokens is None:
            block_tokens = FORMATS[fmt]
        if len(requests) >= max_requests:
            raise TraceError(f"{where}: more than {max_requests} requests; replay a slice "
                             "(head -n) or raise --max-requests")
        requests.append(parse_record(rec, fmt, block_tokens, where, roots))
    if not requests:
        raise TraceError(f"{source}: no requests")
    requests.sort(key=lambda r: r.t)
    assert fmt is not None and block_tokens is not None
    return Trace(fmt, block_tokens, requests)


def read_trace(path: str | Path, fmt: str | None = None, block_tokens: int | None = None,
               max_requests: int = MAX_REQUESTS) -> Trace:
    p = Path(path)
    try:
        with open(p, encoding="utf-8") as f:
            return parse_lines(_lines(f), fmt, block_tokens, p.name, max_requests)
    except OSError as e:
        raise TraceError(f"{path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not UTF-8 text (a JSON-lines trace?)") from None


def _lines(f) -> Iterator[str]:
    yield from f
