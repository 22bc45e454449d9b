"""How `make test` lays engine tests out over its two xdist workers (tests/conftest.py)."""

from __future__ import annotations

from types import SimpleNamespace

from tests.conftest import ENGINE_GROUP, engine_group, worker_cores


def test_each_engine_module_is_one_group():
    a = SimpleNamespace(nodeid="tests/e2e/test_native.py::test_x[fs]")
    b = SimpleNamespace(nodeid="tests/e2e/test_native.py::test_y")
    c = SimpleNamespace(nodeid="tests/e2e/test_demo.py::test_demo_quick")
    assert engine_group(a) == engine_group(b) == ENGINE_GROUP + "tests/e2e/test_native.py"
    assert engine_group(c) != engine_group(a)


def test_workers_engines_compute_on_disjoint_cores():
    assert worker_cores("gw0", 2, [0, 1]) == "0"
    assert worker_cores("gw1", 2, [0, 1]) == "1"
    assert worker_cores("gw1", 2, [0, 1, 2, 3]) == "1,3"
    assert worker_cores("gw2", 3, [4, 5]) == "4,5"  # more workers than cores: every core
    # outside xdist, with one worker or on one core: no binding (every core)
    assert worker_cores("", 1, [0, 1]) is None
    assert worker_cores("gw0", 1, [0, 1]) is None
    assert worker_cores("gw0", 2, [0]) is None


def test_tests_needing_every_core_never_run_in_an_xdist_worker():
    """A TP=2 engine (marker `alone`) beside another worker's engine starved both (Redis
    answered a PING in 11 s): under xdist they are deselected, and said so; `make test` runs
    them after the parallel phase."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup",
                           "-p", "no:cacheprovider", "tests/e2e/test_tensor_parallel.py"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 5, done.stdout[-2000:]  # nothing ran: no engine started
    assert "3 tests marked `alone` deselected" in done.stdout
