"""The operator image, run as the chart's default install runs it (`helm template` of the chart:
uid 65532, read-only root filesystem with /tmp the only writable path, no capabilities, the
chart's args and env), against the API emulator: it reconciles a pool into the children the
checkout's render gives, answers its liveness probe and stops cleanly on SIGTERM.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvpool_dev.images import podman
from kvpool_dev.testbed.servers import free_port
from kvpool_operator import models
from kvpool_operator.render import render
from kvpool_operator.settings import Settings
from tests.images.conftest import write_kubeconfig
from tests.images.smoke import NS, smoke_pool
from tests.operator.chartkit import one, render as helm_template
from tests.operator.emulator import apiserver_with_resources, eventually, http_server, live

pytestmark = pytest.mark.timeout(300)

POOLS_URL = f"/apis/{models.GROUP}/{models.VERSION}/namespaces/{NS}/{models.PLURAL}"
KUBECONFIG = "/var/run/kvpool-smoke/kubeconfig"


async def test_operator_image_reconciles_a_pool_as_the_chart_runs_it(image, runtime, gateway, tmp_path: Path):
    ref = image("operator")
    # the chart watches only the namespaces it is given (namespaced mode, the default): the
    # smoke pool's, as a user installs it for their pools (watch.namespaces)
    deployment = one(helm_template({"watch": {"namespaces": [NS]}}), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == ref, "the chart's default image is the one built"
    assert f"--namespace={NS}" in container["args"], container["args"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    health = next(p["containerPort"] for p in container["ports"] if p["name"] == "health")
    publish = {health: free_port()}
    spec = podman.run_args(pod, "operator", ref, resolved_env={"POD_ID": "kvpool-smoke-operator"}, publish=publish)
    assert "--read-only" in spec.args and "--user=65532:65532" in spec.args

    server = apiserver_with_resources()
    async with server, http_server(server, host=gateway) as http:
        # the namespace exists, as on a cluster: kopf lists namespaces to match --namespace
        async with server.request("post", "/api/v1/namespaces",
                                  json={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}) as resp:
            assert resp.status < 300, await resp.text()
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", f"http://{gateway}:{http.port}", NS)
        ctr = podman.Container(runtime, "kvpool-smoke-operator", spec,
                               extra=[f"--volume={kubeconfig}:{KUBECONFIG}:ro", f"--env=KUBECONFIG={KUBECONFIG}"])
        await asyncio.to_thread(ctr.start)
        try:
            await asyncio.to_thread(podman.wait_http, podman.probe_url(container, "livenessProbe", publish), ctr, 120)
            pool = smoke_pool("registry.example/kvpool-vllm-cpu:test", "/models/tiny", "float32")
            async with server.request("post", POOLS_URL, json=pool) as resp:
                assert resp.status < 300, await resp.text()
            applied = await eventually(lambda: live(server, "apps/v1/deployments", NS, "smoke"), timeout=120,
                                       message="the operator applied the engine Deployment")
            # what the checkout renders for this pool with the chart's settings (its KVPOOL_* env)
            env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
            want = next(m for m in render(pool, Settings.from_env(env), NS)
                        if m["kind"] == "Deployment" and m["metadata"]["name"] == "smoke")
            assert applied["spec"]["template"]["spec"] == want["spec"]["template"]["spec"]
            await eventually(lambda: live(server, "apps/v1/deployments", NS, "smoke-router"), timeout=60,
                             message="the router Deployment")
        finally:
            code = await asyncio.to_thread(ctr.stop, 30)
            logs = await asyncio.to_thread(ctr.logs, 400)
            ctr.remove()
            print(logs[-5000:])  # shown when the test fails, a timeout above included
    assert code == 0, logs[-3000:]
    assert "Traceback" not in logs, logs[-3000:]
