"""The real vllm-router (0.1.17, the test extra's pin and the Dockerfile's) run with the args the
operator renders, against kmock's Kubernetes emulator and a stub engine on loopback.

What this pins: the rendered flags are accepted; service discovery with the rendered selector and
namespace finds the pool's ready engine pods and nothing else; the router sends the API only the
requests the ClusterRole its rendered RoleBinding names allows (list and watch of pods, in the pool's
namespace: a RoleBinding grants nothing elsewhere); its readiness
follows its engines; it forwards the client's Authorization header to the engines, on cache_aware's
render call too, so no key is ever given to the router. Only addresses are changed for loopback:
--host, --port, --prometheus-host/-port, and --service-discovery-port (the stub's port; 8000 is
what the engines listen on in a cluster).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import pytest
import yaml
from aiohttp import web

from kvpool_dev.golden import GOLDEN_SETTINGS
from kvpool_operator.rbac import ROUTER_DISCOVERY_RULES
from kvpool_operator.render import render
from kvpool_operator.render.router import ROUTER_METRICS_PORT, ROUTER_PORT
from tests.operator.conftest import load_example
from tests.operator.emulator import apiserver_with_resources, requests

pytestmark = pytest.mark.timeout(120)

NS = "ml"
API_KEY = "client-api-key-0123456789"  # what a client sends; the router must only pass it on


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def router_binary() -> str:
    exe = Path(sys.executable).parent / "vllm-router"
    assert exe.exists(), "vllm-router missing: it is in the test extra (make setup)"
    return str(exe)


def replaced(args: list[str], values: dict[str, str]) -> list[str]:
    out = list(args)
    for flag, value in values.items():
        out[out.index(flag) + 1] = value
    return out


class StubEngine:
    """/health, /v1/models, cache_aware's /v1/chat/completions/render and the completion itself;
    records every request's path and Authorization header."""

    def __init__(self, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.seen: list[tuple[str, str | None]] = []
        self.bodies: list[tuple[str, Any]] = []  # (path, JSON body) of every POST
        self.host = host
        self.port = port or free_port()
        self._runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.Response:
        self.seen.append((request.path, request.headers.get("Authorization")))
        if request.method == "POST":
            self.bodies.append((request.path, await request.json()))
        if request.path == "/health":
            return web.Response(text="ok")
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})
        if request.path.endswith("/render"):
            return web.json_response({"prompt_token_ids": list(range(1, 33)), "token_ids": list(range(1, 33))})
        return web.json_response({"id": "c", "object": "chat.completion", "model": "m", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 32, "completion_tokens": 1, "total_tokens": 33},
            **self.kv_transfer_params(self.bodies[-1][1] if request.method == "POST" else {})})

    def kv_transfer_params(self, body: Any) -> dict[str, Any]:
        """What the engine answers in kv_transfer_params: nothing (a plain engine)."""
        return {}

    async def __aenter__(self) -> StubEngine:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self._runner is not None
        await self._runner.cleanup()


def pod(name: str, labels: dict[str, str], ip: str, ready: bool) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
            "spec": {"containers": [{"name": "vllm", "image": "x"}]},
            "status": {"podIP": ip, "phase": "Running",
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


async def get_json(url: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.get(url, timeout=aiohttp.ClientTimeout(total=3)) as resp:
        text = await resp.text()
        try:
            return resp.status, json.loads(text)
        except ValueError:
            return resp.status, text


def write_kubeconfig(tmp_path: Path, srv: Any) -> Path:
    """The router's kubeconfig: the emulator, a token, the pool's namespace."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emu",
        "clusters": [{"name": "emu", "cluster": {"server": str(srv.url).rstrip("/")}}],
        "users": [{"name": "emu", "user": {"token": "router-sa-token"}}],
        "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "emu", "namespace": NS}}]}))
    return kubeconfig


async def create_pods(srv: Any, bodies: list[dict[str, Any]]) -> None:
    for body in bodies:
        async with srv.request("post", f"/api/v1/namespaces/{NS}/pods", json=body) as resp:
            assert resp.status < 300


def assert_only_granted_calls(router_calls: list[Any], rules: list[dict[str, Any]]) -> None:
    """The router's API requests are exactly what its ClusterRole grants, in the pool's namespace."""
    by_action = {kmock.action.LIST: "list", kmock.action.WATCH: "watch", kmock.action.FETCH: "get"}
    used = {(r.resource.group, r.resource.plural, by_action.get(r.action, r.method)) for r in router_calls}
    granted = {(g, res, v) for rule in rules for g in rule["apiGroups"] for res in rule["resources"]
               for v in rule["verbs"]}
    assert used == granted == {("", "pods", "list"), ("", "pods", "watch")}
    assert {r.namespace for r in router_calls} == {NS}


@contextlib.asynccontextmanager
async def running(args: list[str], kubeconfig: Path, log: Path):
    proc = await asyncio.create_subprocess_exec(
        router_binary(), *args, stdout=log.open("wb"), stderr=asyncio.subprocess.STDOUT,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "KUBECONFIG": str(kubeconfig), "HOME": str(log.parent)})
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 20)


async def test_rendered_router_discovers_the_pools_engines_and_forwards_the_clients_key(tmp_path):
    manifests = render(load_example("tiered-router"), GOLDEN_SETTINGS, NS)
    by = {(m["kind"], m["metadata"]["name"]): m for m in manifests}
    deployment = by[("Deployment", "tiered-router-router")]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["vllm-router"] and "env" not in container  # no key, no env at all
    binding = by[("RoleBinding", "tiered-router-router-discovery")]
    assert binding["roleRef"]["name"] == GOLDEN_SETTINGS.router_discovery_role  # the chart ships it with these rules
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "tiered-router-router", "namespace": NS}]
    role = {"rules": ROUTER_DISCOVERY_RULES}
    engine_labels = by[("Deployment", "tiered-router")]["spec"]["template"]["metadata"]["labels"]
    other_labels = {**engine_labels, "app.kubernetes.io/instance": "other", "kvpool.dev/pool": "other"}

    srv = apiserver_with_resources()
    srv.resources["v1/pods"] = kmock.ResourceInfo(
        kind="Pod", namespaced=True, verbs={"get", "list", "watch", "create", "patch", "update", "delete"})
    async with srv, kmock.Server(srv), StubEngine() as engine:
        kubeconfig = write_kubeconfig(tmp_path, srv)
        await create_pods(srv, [pod("tiered-router-a", engine_labels, "127.0.0.1", ready=True),
                                pod("tiered-router-b", engine_labels, "127.0.0.3", ready=False),  # not ready: unused
                                pod("other-a", other_labels, "127.0.0.2", ready=True)])  # another pool's engine
        port, metrics_port = free_port(), free_port()
        args = replaced(container["args"], {
            "--host": "127.0.0.1", "--port": str(port), "--prometheus-host": "127.0.0.1",
            "--prometheus-port": str(metrics_port), "--service-discovery-port": str(engine.port)})
        assert args[args.index("--service-discovery-namespace") + 1] == NS
        assert container["args"][container["args"].index("--port") + 1] == str(ROUTER_PORT)
        assert container["args"][container["args"].index("--prometheus-port") + 1] == str(ROUTER_METRICS_PORT)
        base = f"http://127.0.0.1:{port}"
        log = tmp_path / "router.log"
        async with running(args, kubeconfig, log) as proc:
            async def ready():
                assert proc.returncode is None, log.read_text()[-3000:]
                try:
                    status, body = await get_json(f"{base}/readiness")
                except aiohttp.ClientError:
                    return None
                return body if status == 200 else None

            deadline = asyncio.get_running_loop().time() + 60
            while (body := await ready()) is None:
                assert asyncio.get_running_loop().time() < deadline, log.read_text()[-3000:]
                await asyncio.sleep(0.2)
            # only the pool's ready engine: not the unready one, not the other pool's
            assert body == {"status": "ready", "healthy_workers": 1, "total_workers": 1}, body
            assert (await get_json(f"{base}/liveness"))[0] == 200

            async with aiohttp.ClientSession() as session, \
                    session.post(f"{base}/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                                 json={"model": "m", "messages": [{"role": "user", "content": "hello"}]}) as resp:
                assert resp.status == 200, await resp.text()
            calls = [(path, auth) for path, auth in engine.seen if path != "/health"]
            assert ("/v1/chat/completions/render", f"Bearer {API_KEY}") in calls  # cache_aware tokenizes first
            assert ("/v1/chat/completions", f"Bearer {API_KEY}") in calls

            status, metrics = await get_json(f"http://127.0.0.1:{metrics_port}/metrics")
            assert status == 200 and "vllm_router_active_workers" in metrics

            # the router's own API requests (it found the pod, so they were made): what its Role
            # must allow, and nothing more
            router_calls = [r for r in requests(srv) if not r.headers.get("User-Agent", "").startswith("kmock/")]
    assert_only_granted_calls(router_calls, role["rules"])


HANDOVER = {"kvpool": {"handover": "opaque-to-the-router"}}


class PrefillStub(StubEngine):
    """A prefill engine: answers a request asking for a remote decode with a handover."""

    def kv_transfer_params(self, body: Any) -> dict[str, Any]:
        asked = (body or {}).get("kv_transfer_params") or {}
        return {"kv_transfer_params": HANDOVER} if asked.get("do_remote_decode") else {}


async def test_rendered_pd_router_discovers_each_role_by_label_and_passes_the_handover(tmp_path):
    """spec.prefill: the router runs in vLLM P/D mode, finds prefill and decode pods by their role
    label, sends each request to a prefill engine first (one token, do_remote_decode) and then to a
    decode engine with the prefill's kv_transfer_params as they were."""
    manifests = render(load_example("tiered-pd"), GOLDEN_SETTINGS, NS)
    by = {(m["kind"], m["metadata"]["name"]): m for m in manifests}
    container = by[("Deployment", "tiered-pd-router")]["spec"]["template"]["spec"]["containers"][0]
    prefill_labels = by[("Deployment", "tiered-pd-prefill")]["spec"]["template"]["metadata"]["labels"]
    decode_labels = by[("Deployment", "tiered-pd")]["spec"]["template"]["metadata"]["labels"]
    assert prefill_labels["llm-d.ai/role"] == "prefill" and decode_labels["llm-d.ai/role"] == "decode"
    other_prefill = {**prefill_labels, "app.kubernetes.io/instance": "other", "kvpool.dev/pool": "other"}

    srv = apiserver_with_resources()
    srv.resources["v1/pods"] = kmock.ResourceInfo(
        kind="Pod", namespaced=True, verbs={"get", "list", "watch", "create", "patch", "update", "delete"})
    port = free_port()  # one port, two loopback addresses: the router reaches every pod on one port
    async with srv, kmock.Server(srv), PrefillStub("127.0.0.1", port) as prefill, \
            StubEngine("127.0.0.2", port) as decode, PrefillStub("127.0.0.3", port) as stranger:
        kubeconfig = write_kubeconfig(tmp_path, srv)
        await create_pods(srv, [pod("tiered-pd-prefill-a", prefill_labels, "127.0.0.1", ready=True),
                                pod("tiered-pd-a", decode_labels, "127.0.0.2", ready=True),
                                pod("other-prefill-a", other_prefill, "127.0.0.3", ready=True)])  # another pool's
        router_port, metrics_port = free_port(), free_port()
        args = replaced(container["args"], {
            "--host": "127.0.0.1", "--port": str(router_port), "--prometheus-host": "127.0.0.1",
            "--prometheus-port": str(metrics_port), "--service-discovery-port": str(port)})
        base = f"http://127.0.0.1:{router_port}"
        log = tmp_path / "router.log"
        async with running(args, kubeconfig, log) as proc:
            deadline = asyncio.get_running_loop().time() + 60
            while True:
                assert proc.returncode is None, log.read_text()[-3000:]
                assert asyncio.get_running_loop().time() < deadline, log.read_text()[-3000:]
                with contextlib.suppress(aiohttp.ClientError):
                    status, body = await get_json(f"{base}/readiness")
                    if status == 200:
                        break
                await asyncio.sleep(0.2)
            async with aiohttp.ClientSession() as session, \
                    session.post(f"{base}/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                                 json={"model": "m", "max_tokens": 20,
                                       "messages": [{"role": "user", "content": "hello"}]}) as resp:
                assert resp.status == 200, await resp.text() + log.read_text()[-3000:]
            prefill_calls = [b for path, b in prefill.bodies if path == "/v1/chat/completions"]
            decode_calls = [b for path, b in decode.bodies if path == "/v1/chat/completions"]
            router_calls = [r for r in requests(srv) if not r.headers.get("User-Agent", "").startswith("kmock/")]
    assert_only_granted_calls(router_calls, ROUTER_DISCOVERY_RULES)  # P/D discovery needs no more RBAC
    assert len(prefill_calls) == 1 and len(decode_calls) == 1, (prefill.bodies, decode.bodies)
    assert prefill_calls[0]["kv_transfer_params"]["do_remote_decode"] is True
    assert prefill_calls[0]["max_tokens"] == 1
    assert decode_calls[0]["kv_transfer_params"] == HANDOVER  # passed on as the prefill engine wrote it
    assert decode_calls[0]["max_tokens"] == 20
    assert not stranger.bodies  # another pool's prefill pod is never used
