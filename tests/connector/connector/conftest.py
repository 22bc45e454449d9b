"""The scheduler half under test: a real SchedulerSide over a cpu tier (the workers') and a
disk tier it opens itself."""

from __future__ import annotations

import functools

import pytest

from kvpool_connector.connector.config import load_connector_config
from kvpool_connector.connector.scheduler import SchedulerSide
from kvpool_connector.store import open_store
from tests.conftest import SECURITY
from tests.connector.connector.helpers import BPC, BS, PREFIX


@pytest.fixture(autouse=True)
def no_inline_wait(monkeypatch):
    """Lookup jobs are never waited for here (every SchedulerSide's jobs.wait_s is 0,
    whatever `lookup_wait_ms` says): whether a loopback Redis round trip beats a 5 ms bound
    depends on the machine's load, and a test must take one path. The tests of the wait set
    the bound on their side themselves."""
    init = SchedulerSide.__init__

    @functools.wraps(init)  # __wrapped__: the real one, for the test of the config key
    def without_wait(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.jobs.wait_s = 0.0

    monkeypatch.setattr(SchedulerSide, "__init__", without_wait)


def wait_inline(side: SchedulerSide, wait_s: float, budget_s: float) -> None:
    """Give `side` these bounds from its next step on, as `lookup_wait_ms` would."""
    side.jobs.wait_s, side.jobs.budget_s = wait_s, budget_s


@pytest.fixture
def side(tmp_path, request):
    """A SchedulerSide of pool `t` (cpu + disk tiers); `side.test_blocks[request id]` holds
    the block ids `allocate` gave the request. Tail objects are off unless parametrized
    (indirect, a dict of connector keys): these tests plan chunks; test_tails.py, tails."""
    s = scheduler_side("t", {"type": "disk", "path": str(tmp_path), "size": "64Mi"},
                       **getattr(request, "param", {"tail_objects": False}))
    yield s
    s.close()
    s.lower.close()


@pytest.fixture
def remote_side(redis_tier, namespace):
    """A SchedulerSide whose shared tier is Redis (lookups on the lookup threads)."""
    s = scheduler_side(namespace, redis_tier)
    yield s
    s.close()
    s.lower.close()


def scheduler_side(namespace: str, shared_tier: dict, **keys) -> SchedulerSide:
    """A SchedulerSide over a cpu tier (the workers') and `shared_tier`, which it opens."""
    cfg = load_connector_config({"namespace": namespace, "security": SECURITY, **keys,
                                 "tiers": [{"type": "cpu", "size": "64Mi"}, shared_tier]})
    lower = open_store(cfg.as_store_config(drop_types=("cpu",)), layout="fp")
    blocks: dict[str, list[int]] = {}
    s = SchedulerSide(cfg, PREFIX, BS, BPC, chunk_bytes=1 << 20, world_size=1, lower_store=lower,
                      block_ids=lambda rid: [blocks[rid]], is_async=True)
    s.test_blocks = blocks  # type: ignore[attr-defined]
    return s
