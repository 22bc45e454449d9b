"""The test suite's offline engines are forked from a zygote that imported vLLM once
(testbed/zygote.py): such an engine computes exactly what a freshly started process does,
runs in its own session with its own log, and ends, fails and is stopped like a Popen child."""

from __future__ import annotations

import os
import time

import pytest

from kvpool_dev.testbed import zygote
from kvpool_dev.testbed.engine import OfflineEngine

BASE = {"PATH": "/usr/bin", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_LOGGING_LEVEL": "WARNING"}


@pytest.mark.parametrize(("change", "forks"), [
    ({}, True),
    ({"KVPOOL_KV_AUDIT_DIR": "/tmp/a", "KVPOOL_TEST_REDIS_PASSWORD": "x"}, True),
    ({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}, True),  # read lazily
    ({"PYTEST_CURRENT_TEST": "t"}, True),
    ({"VLLM_LOGGING_LEVEL": "DEBUG"}, False),  # vLLM's logging is configured at import
    ({"OMP_NUM_THREADS": "1"}, False),
    ({"LD_PRELOAD": "libtcmalloc.so"}, False),
    ({"PYTHONHASHSEED": "0"}, False),
])
def test_only_an_environment_read_at_runtime_may_differ_from_the_zygotes(change, forks):
    assert zygote.compatible(BASE, {**BASE, **change}) is forks


def test_a_variable_read_at_import_that_is_unset_differs_too():
    assert not zygote.compatible(BASE, {k: v for k, v in BASE.items() if k != "VLLM_LOGGING_LEVEL"})
    assert zygote.compatible(BASE, {k: v for k, v in BASE.items() if k != "VLLM_CPU_KVCACHE_SPACE"})


@pytest.mark.vllm
def test_a_forked_engine_computes_what_a_fresh_process_does(tiny_model, monkeypatch):
    prompts = [[7 + i % 50 for i in range(300)], [3 + i % 11 for i in range(40)]]
    monkeypatch.setenv(zygote.ENV, "0")
    with OfflineEngine(tiny_model) as fresh:
        assert not isinstance(fresh.proc, zygote.ForkedProcess)
        want = fresh.generate(prompts, max_tokens=8)
    monkeypatch.setenv(zygote.ENV, "1")
    with OfflineEngine(tiny_model) as forked:
        proc = forked.proc
        assert isinstance(proc, zygote.ForkedProcess)
        assert os.getpgid(proc.pid) == os.getsid(proc.pid) == proc.pid  # its own session
        got = forked.generate(prompts, max_tokens=8)
    assert proc.returncode == 0  # a closed stdin ended it cleanly
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in want]
    assert [o["logprobs"] for o in got] == [o["logprobs"] for o in want]


@pytest.mark.vllm
def test_a_forked_engine_that_fails_exits_with_its_error_in_its_log(tmp_path, monkeypatch):
    monkeypatch.setenv(zygote.ENV, "1")
    engine = OfflineEngine(tmp_path / "no-such-model")
    with pytest.raises(RuntimeError, match=r"engine exited \(1\)") as err:  # the zygote's reap
        engine.start()
    assert engine.proc is None  # stopped
    assert "no-such-model" in str(err.value)  # the log tail names what failed


@pytest.mark.vllm
def test_a_forked_api_server_serves_and_ends_with_its_whole_group(tiny_model, monkeypatch):
    """`python -m vllm.entrypoints.openai.api_server`, run in a child of the zygote."""
    import json
    import urllib.request

    from kvpool_dev.testbed import process
    from kvpool_dev.testbed.engine import VllmServer

    monkeypatch.setenv(zygote.ENV, "1")
    server = VllmServer(tiny_model, max_model_len=2048, env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    with server:
        assert isinstance(server.proc, zygote.ForkedProcess)
        group = server.proc.pid
        body = json.dumps({"model": "local", "prompt": [5, 6, 7], "max_tokens": 3,
                           "temperature": 0, "ignore_eos": True}).encode()
        req = urllib.request.Request(server.base_url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 3
        assert process.group_pids(group)  # its own process group
    # stopped whole: the group's other processes (the engine core) got the signal too
    deadline = time.monotonic() + 30
    while process.group_pids(group) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert process.group_pids(group) == []
