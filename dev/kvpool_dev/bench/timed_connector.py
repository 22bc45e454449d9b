"""A connector wrapper that times the scheduler-side calls (for `kvpool bench e2e`).

`--kv-transfer-config '{"kv_connector": "TimedKVPoolConnector",
"kv_connector_module_path": "kvpool_dev.bench.timed_connector", ...}'` runs the real
connector and adds up the time the scheduler spends inside it. vLLM calls
`build_connector_meta` exactly once per scheduler step, so its call count is the step count.
The totals go, as JSON, to the file named by `KVPOOL_BENCH_TIMING_FILE` after every step, so
the benchmark reads them between requests without any channel into the engine process.
The connector's own config stays untouched (it rejects unknown keys).
"""

from __future__ import annotations

import functools
import json
import os
import time
from typing import Any

TIMING_ENV = "KVPOOL_BENCH_TIMING_FILE"
SCHEDULER_METHODS = ("get_num_new_matched_tokens", "update_state_after_alloc",
                     "build_connector_meta", "request_finished", "update_connector_output")


class Timings:
    """Cumulative seconds and calls per scheduler-side method, plus steps."""

    def __init__(self) -> None:
        self.seconds = {m: 0.0 for m in SCHEDULER_METHODS}
        self.calls = {m: 0 for m in SCHEDULER_METHODS}

    def as_dict(self) -> dict[str, Any]:
        return {"seconds": dict(self.seconds), "calls": dict(self.calls),
                "steps": self.calls["build_connector_meta"],
                "total_seconds": sum(self.seconds.values())}

    def dump(self) -> None:
        path = os.environ.get(TIMING_ENV)
        if not path:
            return
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.as_dict(), f)
        os.replace(tmp, path)


def _timed_method(fn, name: str):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(self, *args, **kwargs)
        finally:
            timings: Timings = self._kvpool_timings
            timings.seconds[name] += time.perf_counter() - t0
            timings.calls[name] += 1
            if name == "build_connector_meta":
                timings.dump()  # outside the timed region
    return wrapper


def timed(base: type) -> type:
    """A subclass of connector class `base` whose scheduler-side methods are timed."""
    ns: dict[str, Any] = {name: _timed_method(getattr(base, name), name)
                          for name in SCHEDULER_METHODS}
    ns["_kvpool_timings"] = Timings()
    ns["__module__"] = __name__
    return type(f"Timed{base.__name__}", (base,), ns)


def __getattr__(name: str) -> type:
    """Built on first use, so importing this module never needs the wrapped connector."""
    if name == "TimedKVPoolConnector":
        from kvpool_connector.vllm import KVPoolConnector as base
    elif name == "TimedOffloadingConnector":  # vLLM's native offloading
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
            OffloadingConnector as base,
        )
    elif name == "TimedExampleConnector":
        from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
            ExampleConnector as base,
        )
    else:
        raise AttributeError(name)
    cls = timed(base)
    globals()[name] = cls
    return cls


def read_timings(path: str | os.PathLike) -> dict[str, Any] | None:
    """The last totals an engine wrote, or None before its first step."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
