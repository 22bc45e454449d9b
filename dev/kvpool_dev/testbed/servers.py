"""Real Redis (standalone or a cluster), S3-compatible and Prometheus servers on loopback,
started as child processes."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from kvpool_dev.testbed import process
from kvpool_dev.testbed.process import Service, free_port, wait_port


@dataclass
class RedisServer(Service):
    """A password-protected redis-server on a loopback port; can be stopped and restarted."""

    password: str = field(default_factory=lambda: secrets.token_hex(8))
    port: int = field(default_factory=free_port)
    maxmemory: str = "1gb"
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvpool-redis-")))
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not found: run `make setup` (installs it with apt)")
        self.proc = process.start(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--requirepass", self.password,
             "--save", "", "--appendonly", "no", "--dir", str(self.workdir),
             "--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru",
             "--proto-max-bulk-len", "512mb"])
        wait_port(self.port, proc=self.proc)
        return self

    def restart(self) -> None:
        self.stop()
        self.start()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        shutil.rmtree(self.workdir, ignore_errors=True)


def _free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (each node of a cluster needs a client and a bus port)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class RedisCluster(Service):
    """A password-protected Redis Cluster of `masters` redis-server processes on loopback,
    joined with `redis-cli --cluster create` (slots split evenly, no replicas)."""

    masters: int = 3
    password: str = field(default_factory=lambda: secrets.token_hex(8))
    maxmemory: str = "512mb"
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvpool-rcluster-")))
    ports: list[int] = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def url(self) -> str:
        """A seed node: the client discovers the others (CLUSTER SLOTS)."""
        return f"redis://127.0.0.1:{self.ports[0]}"

    def _env(self) -> dict[str, str]:
        return dict(os.environ, REDISCLI_AUTH=self.password)  # no password in any argv

    def _cli(self, *args: str, port: int | None = None, timeout: float = 60) -> str:
        cmd = ["redis-cli", "-h", "127.0.0.1", "-p", str(port or self.ports[0]), *args]
        out = subprocess.run(cmd, env=self._env(), capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:6])}... failed: {out.stdout[-500:]} {out.stderr[-500:]}")
        return out.stdout

    def start(self) -> RedisCluster:
        exe = shutil.which("redis-server")
        if exe is None or shutil.which("redis-cli") is None:
            raise RuntimeError("redis-server/redis-cli not found: run `make setup` (apt)")
        all_ports = _free_ports(2 * self.masters)
        self.ports, bus = all_ports[:self.masters], all_ports[self.masters:]
        conf = self.workdir / "password.conf"  # requirepass from a file, not an argv
        conf.write_text(f"requirepass {self.password}\nmasterauth {self.password}\n")
        conf.chmod(0o600)
        for port, bus_port in zip(self.ports, bus, strict=True):
            self.procs.append(process.start(
                [exe, str(conf), "--port", str(port), "--bind", "127.0.0.1",
                 "--cluster-enabled", "yes", "--cluster-port", str(bus_port),
                 "--cluster-config-file", str(self.workdir / f"nodes-{port}.conf"),
                 "--save", "", "--appendonly", "no", "--dir", str(self.workdir),
                 "--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru",
                 "--proto-max-bulk-len", "512mb"]))
        try:
            for port, proc in zip(self.ports, self.procs, strict=True):
                wait_port(port, proc=proc)
            self._cli("--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                      "--cluster-replicas", "0", "--cluster-yes")
            self.wait_ok()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ok(self, timeout: float = 60.0) -> None:
        """Until every node reports cluster_state:ok (slot assignment has propagated)."""
        deadline = time.monotonic() + timeout
        pending = list(self.ports)
        while pending:
            pending = [p for p in pending
                       if "cluster_state:ok" not in self._cli("cluster", "info", port=p)]
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"cluster nodes {pending} not ok after {timeout}s")
            if pending:
                time.sleep(0.1)

    def node_clients(self):
        """One plain redis-py client per master (admin user), for tests to look inside."""
        import redis

        return [redis.Redis(host="127.0.0.1", port=p, password=self.password) for p in self.ports]

    def stop(self) -> None:
        for proc in self.procs:
            process.stop(proc)
        self.procs = []

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        shutil.rmtree(self.workdir, ignore_errors=True)


@dataclass
class S3Server(Service):
    """moto's standalone S3-compatible HTTP server on loopback, with one bucket."""

    bucket: str = "kvpool-test"
    access_key: str = "kvpool-access"
    secret_key: str = field(default_factory=lambda: secrets.token_hex(16))
    region: str = "us-east-1"
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key}

    def client(self):
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3", endpoint_url=self.endpoint, region_name=self.region,
            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 2}),
        )

    def start(self, create_bucket: bool = True) -> S3Server:
        env = dict(os.environ, **self.env())
        self.proc = process.start(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            env=env)
        wait_port(self.port, proc=self.proc)
        if create_bucket:
            self.client().create_bucket(Bucket=self.bucket)
        return self


@dataclass
class PrometheusServer(Service):
    """A real Prometheus (Debian's `prometheus` package) on loopback, scraping `targets`
    every `scrape_interval` and attaching `labels` to every series, as a PodMonitor's
    podTargetLabels and Kubernetes' `namespace` label do in a cluster."""

    targets: list[str] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)
    scrape_interval: str = "1s"
    port: int = field(default_factory=free_port)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvpool-prom-")))
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def config(self) -> dict:
        return {"global": {"scrape_interval": self.scrape_interval,
                           "evaluation_interval": self.scrape_interval},
                "scrape_configs": [{"job_name": "vllm", "metrics_path": "/metrics",
                                    "static_configs": [{"targets": self.targets,
                                                        "labels": self.labels}]}]}

    def start(self) -> PrometheusServer:
        exe = shutil.which("prometheus")
        if exe is None:
            raise RuntimeError("prometheus not found: run `make setup` (installs it with apt)")
        cfg = self.workdir / "prometheus.yml"
        cfg.write_text(yaml.safe_dump(self.config()))
        self.proc = process.start(
            [exe, f"--config.file={cfg}", f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            self.workdir / "prometheus.log")
        try:
            if not process.wait_healthy(self.url + "/-/ready", self.proc, 60, "prometheus",
                                        lambda: process.log_tail(self.workdir / "prometheus.log"),
                                        poll=0.1):
                raise TimeoutError("prometheus not ready after 60s")
        except BaseException:
            self.stop()
            raise
        return self

    def _get(self, path: str, **params) -> object:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params, doseq=True)}"
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus {path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """The instant vector (or scalar) of `expr` now: `[{"metric": {...}, "value": [t, v]}]`."""
        data = self._get("/api/v1/query", query=expr)
        return data["result"] if data["resultType"] == "vector" else [{"metric": {},
                                                                       "value": data["result"]}]

    def label_values(self, label: str, match: str) -> list[str]:
        """What Grafana's `label_values(match, label)` lists."""
        return self._get(f"/api/v1/label/{label}/values", **{"match[]": match})

    def wait_for(self, expr: str, timeout: float = 60.0, poll: float = 0.25) -> list[dict]:
        """Poll `expr` until it returns series; raises after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if result:
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"no series for {expr!r} after {timeout}s")
            time.sleep(poll)

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        shutil.rmtree(self.workdir, ignore_errors=True)
