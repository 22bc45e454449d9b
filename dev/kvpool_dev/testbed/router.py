"""The vLLM project's router (`vllm-router`, a Rust binary shipped in the PyPI wheel) in
front of real engines, on loopback: the process the operator's router Deployment runs.

Its cache_aware policy matches token prefixes: it asks an engine to render and tokenize
each chat (`/v1/chat/completions/render`), which vLLM serves only with `--enable-scale-out`;
without it every request is a `missing_tokens` decision and the policy balances by load
alone (vllm_router_prefix_routing_decisions_total shows which)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

from kvpool_dev.testbed import process
from kvpool_dev.testbed.process import Service, free_port, wait_healthy

POLICIES = ("cache_aware", "consistent_hash", "power_of_two", "round_robin", "random")


def router_binary() -> str:
    """The console script next to this interpreter (the venv), else on PATH."""
    here = Path(sys.executable).parent / "vllm-router"
    found = str(here) if here.exists() else shutil.which("vllm-router")
    if not found:
        raise RuntimeError("vllm-router not found: install kvpool[test] (`make setup`)")
    return found


def router_args(worker_urls: list[str], policy: str, port: int, prometheus_port: int,
                host: str = "127.0.0.1") -> list[str]:
    """Command-line flags of a router over static workers (pure)."""
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r}: choose from {', '.join(POLICIES)}")
    return ["--host", host, "--port", str(port), "--worker-urls", *worker_urls,
            "--policy", policy, "--prometheus-host", host,
            "--prometheus-port", str(prometheus_port), "--log-level", "warning",
            "--worker-startup-check-interval", "1"]


class VllmRouter(Service):
    """`vllm-router --worker-urls ... --policy P` as a child process; metrics on its own port."""

    def __init__(self, worker_urls: list[str], policy: str = "cache_aware",
                 extra_args: list[str] | None = None, log_path: str | Path | None = None):
        self.worker_urls = list(worker_urls)
        self.policy = policy
        self.port, self.prometheus_port = free_port(), free_port()
        self.extra_args = list(extra_args or [])
        self.log_path = Path(log_path) if log_path else process.temp_log("vllm-router-")
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [router_binary(), *router_args(self.worker_urls, self.policy, self.port,
                                              self.prometheus_port), *self.extra_args]

    def start(self, timeout: float = 120.0) -> VllmRouter:
        self.proc = process.start(self.command(), self.log_path)
        try:
            if wait_healthy(self.base_url + "/health", self.proc, timeout, "vllm-router",
                            lambda: process.log_tail(self.log_path), poll=0.2):
                return self
        except BaseException:
            self.stop()
            raise
        self.stop()
        raise TimeoutError(f"vllm-router not healthy after {timeout}s")

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.prometheus_port}/metrics",
                                    timeout=10) as r:
            return r.read().decode()
