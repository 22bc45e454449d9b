"""`TieredStore.put_many_through` (a prefill's handover, connector/handover.py): the shared
tiers hold the objects when the call returns, not some time later; the answer says which
did, and a dead tier is a False within the store's bound, never an exception."""

from __future__ import annotations

import functools
import os

from tests.connector.store.helpers import build_store

build = functools.partial(build_store, layout=b"L", timeout=0.5, backoff_initial_seconds=0.1,
                          backoff_max_seconds=0.5)


def _data(n=3):
    return [os.urandom(32) for _ in range(n)], [os.urandom(200_000) for _ in range(n)]


def test_shared_tiers_hold_the_objects_when_the_call_returns(cpu_tier, disk_tier, redis_tier,
                                                             namespace):
    stack = build(namespace, cpu_tier, disk_tier, redis_tier)
    redis_only = build(namespace, redis_tier)
    disk_only = build(namespace, disk_tier)
    keys, vals = _data()
    try:
        assert stack.put_many_through(keys, vals) == ([True] * 3, [True] * 3)
        # no flush: nothing of these writes is left in a queue
        assert redis_only.get_many(keys) == vals
        assert disk_only.get_many(keys) == vals
    finally:
        for s in (stack, redis_only, disk_only):
            s.close()


def test_without_a_shared_tier_nothing_is_durable(cpu_tier, namespace):
    store = build(namespace, cpu_tier)
    keys, vals = _data(2)
    assert store.put_many_through(keys, vals) == ([True, True], [False, False])
    assert store.put_many_through([], []) == ([], [])
    store.close()


def test_a_dead_shared_tier_answers_false_and_the_first_tier_still_takes_them(
        cpu_tier, redis_tier, redis_server, namespace):
    stack = build(namespace, cpu_tier, redis_tier)
    keys, vals = _data(2)
    try:
        redis_server.stop()
        for _ in range(3):  # failing, then backing off: False each time
            assert stack.put_many_through(keys, vals) == ([True, True], [False, False])
        assert [bytes(v) for v in stack.get_many(keys)] == vals
    finally:
        redis_server.start()
        stack.close()


def test_presence_of_keys_with_gaps_in_one_question_per_tier(cpu_tier, redis_tier, namespace):
    stack = build(namespace, cpu_tier, redis_tier)
    redis_only = build(namespace, redis_tier)
    keys, vals = _data(4)
    try:
        stack.put_many([keys[1]], [vals[1]])  # in the cpu tier only
        redis_only.put_many([keys[3]], [vals[3]])  # in Redis only
        assert stack.contains_many(keys) == [False, True, False, True]
        assert stack.contains_prefix(keys) == 0 and stack.contains_prefix(keys[1:]) == 1
        assert stack.contains_many([]) == []
    finally:
        stack.close()
        redis_only.close()
