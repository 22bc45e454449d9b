"""Start real vLLM engines in child processes: an OpenAI-compatible server or an offline
engine driven over a pipe.

Each engine is a separate process tree, so tests and benchmarks can check what a *fresh*
engine gets from a shared cache, and a crash never takes the caller down. Engines run on
whatever platform vLLM detects (the CPU platform when there is no accelerator).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvpool_dev.testbed import process, zygote
from kvpool_dev.testbed.dtype import engine_dtype
from kvpool_dev.testbed.process import Service, free_port, wait_healthy

TOP_LOGPROBS = 5  # per generated position, for testbed.oracle
ENGINE_START_TIMEOUT = float(os.environ.get("KVPOOL_ENGINE_START_TIMEOUT", "600"))


# Set by the test suite for every test not marked `vllm` (tests/conftest.py): such a test
# must not start an engine, or `make test-fast` (-m "not vllm") would start it after all.
UNMARKED_TEST_ENV = "KVPOOL_TEST_WITHOUT_VLLM_MARK"


def refuse_unmarked_test() -> None:
    test = os.environ.get(UNMARKED_TEST_ENV)
    if test:
        raise RuntimeError(f"{test} starts a vLLM engine but is not marked "
                           "@pytest.mark.vllm (make test-fast deselects those)")


def engine_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for an engine process: bounded CPU KV space, quiet logs. (vLLM's sha256
    prefix hashes need no shared PYTHONHASHSEED to match across processes.)"""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of paged KV cache on the CPU platform
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # vLLM logs to stdout by default, which the offline worker reserves for replies: keep
    # engine tracebacks in the log file instead of losing them.
    env.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    # Every engine computes on every core this process may use. vLLM's CPU server otherwise
    # keeps one core for its API process and binds its compute threads to the rest, but any
    # KV connector (kvpool's or vLLM's ExampleConnector) ends up computing on every core all
    # the same: on 2 cores a plain server prefilled 1.5k tokens of the bench model in 6.8 s
    # with 1 thread, a connector server in 3.4 s with 2, and both in 3.4 s bound like this.
    # Without it a comparison credits kvpool with vLLM's thread count.
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, sorted(os.sched_getaffinity(0)))))
    if extra:
        env.update(extra)
    return env


def metric_total(samples: list[dict], name: str, **labels: str) -> float:
    """Sum of `name`'s values over the series whose labels include `labels` (pure; samples
    from OfflineEngine.metric_samples, counter names without `_total`)."""
    return sum(s.get("value") or 0 for s in samples if s["name"] == name
               and all(s["labels"].get(k) == v for k, v in labels.items()))


def _zygote_for(env: dict[str, str]) -> zygote.Zygote | None:
    """This process's zygote (a process that imported vLLM once, zygote.py) when the test
    suite asked for one and an engine with `env` can be forked from it; else None."""
    if not zygote.enabled():
        return None
    forks = zygote.zygote(engine_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}), ENGINE_START_TIMEOUT)
    return forks if zygote.compatible(forks.env, env) else None


def shared_zygote_env() -> dict[str, str]:
    """What a child process (a dev tool the tests run) needs in its environment to fork its
    engines from this process's zygote: {} without one."""
    if not zygote.enabled():
        return {}
    forks = zygote.zygote(engine_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}), ENGINE_START_TIMEOUT)
    return {zygote.ENV: forks.path}


NATIVE_REGION_GLOB = "vllm_offload_*.mmap"  # vLLM's native offloading host region


class ReleasesHostRegions(Service):
    """Removes the host region files (/dev/shm) of vLLM's native offloading that this
    engine's processes mapped once they are stopped: vLLM leaves them behind (2 GiB a
    server in `kvpool bench serve`). Only files this engine's own process group mapped
    just before the stop, and only those no process maps after it."""

    removed_regions: list[str] = []

    def stop(self) -> None:
        regions: set[str] = set()
        if self.proc is not None and self.proc.poll() is None:
            regions = process.mapped_shm(process.group_pids(self.proc.pid), NATIVE_REGION_GLOB)
        self.end()
        self.removed_regions = process.remove_unmapped(regions) if regions else []

    def end(self) -> None:
        """Stop the processes (SIGTERM to the group, then SIGKILL past `stop_timeout`)."""
        super().stop()


SERVER_MODULE = "vllm.entrypoints.openai.api_server"


class VllmServer(ReleasesHostRegions):
    """`python -m vllm.entrypoints.openai.api_server` on a free loopback port (forked from
    the test process's zygote under the test suite, zygote.py)."""

    stop_timeout = 30.0

    def __init__(self, model: str | Path, kv_transfer_config: dict | None = None,
                 extra_args: list[str] | None = None, env: dict[str, str] | None = None,
                 max_model_len: int = 8192, log_path: str | Path | None = None,
                 dtype: str | None = None):
        self.model = str(model)
        self.dtype = engine_dtype(dtype)
        self.port = free_port()
        self.kv_transfer_config = kv_transfer_config
        self.extra_args = list(extra_args or [])
        self.env = engine_env(env)
        self.max_model_len = max_model_len
        self.log_path = Path(log_path) if log_path else process.temp_log("vllm-server-")
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", SERVER_MODULE,
               "--model", self.model, "--served-model-name", "local",
               "--host", "127.0.0.1", "--port", str(self.port),
               "--max-model-len", str(self.max_model_len), "--seed", "0",
               "--dtype", self.dtype,
               "--enforce-eager", "--enable-prompt-tokens-details",
               # the worker inside the engine-core process: one vLLM import fewer per start
               "--distributed-executor-backend", "uni"]
        if self.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        return cmd + self.extra_args

    def start(self) -> VllmServer:
        return self.launch().wait_ready()

    def launch(self) -> VllmServer:
        """Start the process without waiting: several servers can boot at the same time."""
        refuse_unmarked_test()
        cmd = self.command()
        forks = _zygote_for(self.env) if cmd[:3] == [sys.executable, "-m", SERVER_MODULE] else None
        if forks is not None:
            self.proc = forks.run_module(SERVER_MODULE, cmd[3:], self.env,  # type: ignore[assignment]
                                         self.log_path)
            return self
        self.proc = process.start(cmd, self.log_path, new_session=True, env=self.env)
        return self

    def wait_ready(self) -> VllmServer:
        """Wait until /health answers; stops the server and raises if it never does."""
        assert self.proc is not None, "launch() first"
        try:
            if wait_healthy(self.base_url + "/health", self.proc, ENGINE_START_TIMEOUT,
                            "vLLM server", self.log_tail):
                return self
        except BaseException:
            self.stop()
            raise
        self.stop()
        raise TimeoutError(f"vLLM server not healthy after {ENGINE_START_TIMEOUT}s; log tail:\n{self.log_tail()}")

    def log_tail(self, n: int = 60) -> str:
        return process.log_tail(self.log_path, n)

    def metrics(self) -> str:
        import urllib.request

        with urllib.request.urlopen(self.base_url + "/metrics", timeout=10) as r:
            return r.read().decode()


class OfflineEngine(ReleasesHostRegions):
    """A `vllm.LLM` in a child process, driven by JSON lines over stdin/stdout.

    `generate` takes token-id prompts (exact control over lengths and prefixes) and returns,
    per prompt, the greedy output token ids and vLLM's `num_cached_tokens`.
    """

    stop_timeout = 30.0

    def __init__(self, model: str | Path, kv_transfer_config: dict | None = None,
                 env: dict[str, str] | None = None, dtype: str | None = None,
                 **llm_kwargs: Any):
        # One process: the engine core and its worker run inside the child (vLLM's "uni"
        # executor, no engine-core process). Each extra process re-imports vLLM and torch, which
        # is most of an engine's start; the connector's scheduler and worker sides still run as
        # in production, only in one address space.
        self.args = {"model": str(model), "kv_transfer_config": kv_transfer_config,
                     "llm_kwargs": {"max_model_len": 8192, "enforce_eager": True, "seed": 0,
                                    "dtype": engine_dtype(dtype),
                                    "distributed_executor_backend": "uni", **llm_kwargs}}
        self.env = engine_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})})
        self.log_path = process.temp_log("vllm-offline-")
        self.proc: subprocess.Popen | None = None

    def start(self) -> OfflineEngine:
        return self.launch().wait_ready()

    def launch(self) -> OfflineEngine:
        """Start the process without waiting: several engines can boot at the same time."""
        refuse_unmarked_test()
        forks = _zygote_for(self.env)
        if forks is not None:
            self.proc = forks.fork(self.args, self.env, self.log_path)  # type: ignore[assignment]
            return self
        self.proc = process.start(
            [sys.executable, "-m", "kvpool_dev.testbed.engine_worker", json.dumps(self.args)],
            self.log_path, new_session=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env=self.env, text=True, bufsize=1)
        return self

    def wait_ready(self) -> OfflineEngine:
        try:
            self._reply(timeout=ENGINE_START_TIMEOUT)  # {"ready": true}
        except BaseException:
            self.stop()
            raise
        return self

    def _reply(self, timeout: float) -> dict:
        import select

        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"engine did not answer in {timeout}s; log tail:\n{self.log_tail()}")
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 1.0))
            if ready:
                line = self.proc.stdout.readline()
                if not line:  # its stdout closed: it is exiting (its code, when it has one)
                    raise RuntimeError(f"engine exited ({self._exit_code()}); log tail:\n"
                                       f"{self.log_tail()}")
                if line.startswith("KVPOOL_REPLY "):
                    msg = json.loads(line[len("KVPOOL_REPLY "):])
                    if "error" in msg:
                        raise RuntimeError(f"engine error: {msg['error']}")
                    return msg
            elif self.proc.poll() is not None:
                raise RuntimeError(f"engine exited ({self.proc.returncode}); log tail:\n{self.log_tail()}")

    def _exit_code(self, timeout: float = 10.0) -> int | None:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def generate(self, prompts: list, max_tokens: int = 16, timeout: float = 900,
                 logprobs: int = TOP_LOGPROBS, prompt_logprobs: bool = False) -> list[dict]:
        """Greedy-decode prompts (token ids, or {"prompt_token_ids", "cache_salt",
        "kv_transfer_params"} dicts);
        returns, per prompt, {"token_ids", "logprobs" (top `logprobs` [token, logprob] pairs
        per position; see testbed.oracle), "num_cached_tokens", "kv_transfer_params" (what
        the connector returned: a prefill's handover), "ttft_s", "prompt_logprobs" (with
        `prompt_logprobs`: each prompt token's logprob, None for the first; else empty)}."""
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens,
                                          "logprobs": logprobs,
                                          "prompt_logprobs": prompt_logprobs}) + "\n")
        self.proc.stdin.flush()
        return self._reply(timeout)["outputs"]

    def metric_samples(self, timeout: float = 60) -> list[dict]:
        """vLLM's metrics of this engine so far (start it with `disable_log_stats=False`):
        [{"name", "labels", "value"} (counters, gauges) or {"count", "sum"} (histograms)];
        see metric_total."""
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"metrics": True}) + "\n")
        self.proc.stdin.flush()
        return self._reply(timeout)["metrics"]

    def log_tail(self, n: int = 60) -> str:
        return process.log_tail(self.log_path, n)

    def end(self) -> None:
        """A closed stdin ends the worker's loop: up to 60 s to shut vLLM down cleanly."""
        if self.proc is not None:
            try:
                if self.proc.stdin:
                    self.proc.stdin.close()
                self.proc.wait(60)
            except (subprocess.TimeoutExpired, OSError):
                pass
        super().end()
