"""The real kopf operator (in-process `kopf.operator`) against kmock's Kubernetes emulator.

What a real cluster adds on top (see emulator.py): field ownership and removal of fields a
manager stopped applying, garbage collection of children by ownerReferences, admission/CEL.
For those the tests assert the requests the operator sends.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import datetime
import json
import logging
import re
from pathlib import Path
from typing import Any

import kmock
import kopf
import pytest
import yaml

from kvpool_operator import models
from kvpool_operator.kube import Kube
from kvpool_operator.reconcile.handlers import build_registry
from kvpool_operator.render.common import CHECKSUM_ANNOTATION, MANAGER
from kvpool_operator.settings import Settings
from tests.operator.conftest import load_example
from tests.operator.emulator import (
    APPLY,
    apiserver_with_resources,
    eventually,
    http_server,
    live,
    requests,
)

pytestmark = pytest.mark.timeout(120)

NS = "ml"
POOLS = f"{models.GROUP}/{models.VERSION}/{models.PLURAL}"
POOLS_URL = f"/apis/{models.GROUP}/{models.VERSION}/namespaces/{NS}/{models.PLURAL}"


@contextlib.asynccontextmanager
async def running_operator(server: kmock.KubernetesEmulator, settings: Settings):
    """Start kopf with our registry, wait until it is ready, stop it cleanly afterwards."""
    url = str(server.url).rstrip("/")

    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=url, insecure=True)

    kopf_settings = kopf.OperatorSettings()
    kopf_settings.scanning.disabled = True  # no CRD/namespace watching: the emulator has no CRDs
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(kopf.operator(
        registry=build_registry(settings, login=login), settings=kopf_settings,
        namespaces=[NS], standalone=True, stop_flag=stop, ready_flag=ready,
        memo=kopf.Memo(kube=Kube.for_host(url)),
    ))
    await asyncio.wait_for(ready.wait(), 20)
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)  # raises if the operator crashed


# What examples/tiered-full.yaml asks to find in its namespace: its Hugging Face token Secret
HF_TOKEN_SECRET = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf-token", "namespace": NS},
                   "data": {"token": base64.b64encode(b"hf_user-token-0123456789").decode()}}


@pytest.fixture
async def server():
    srv = apiserver_with_resources()
    srv.objects[kmock.resource("v1/secrets"), NS, "hf-token"] = copy.deepcopy(HF_TOKEN_SECRET)  # no request
    async with srv, http_server(srv):
        yield srv


class LogLines(logging.Handler):
    """Messages of the operator's per-object logger (kopf.objects), in order."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def operator_log():
    handler = LogLines()
    logger = logging.getLogger("kopf.objects")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


@pytest.fixture
def op_settings() -> Settings:
    return Settings(connector_image="kvpool-vllm:test", allowed_host_path_prefixes=("/mnt",), reconcile_interval=300)


def pool_obj(server) -> dict[str, Any] | None:
    return live(server, POOLS, NS, "tiered-full")


def conditions(server) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in (pool_obj(server) or {}).get("status", {}).get("conditions", [])}


def child(server, resource: str, name: str) -> dict[str, Any] | None:
    return live(server, resource, NS, name)


def secret_data(secret: dict[str, Any]) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}


def checksum(server) -> str:
    dep = child(server, "apps/v1/deployments", "tiered-full")
    return dep["spec"]["template"]["metadata"]["annotations"][CHECKSUM_ANNOTATION]


def write_kubeconfig(server, tmp_path) -> Path:
    """A kubeconfig for the emulator (namespace ml), as kubectl and the operator's client read it."""
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emu",
        "clusters": [{"name": "emu", "cluster": {"server": str(server.url).rstrip("/")}}],
        "users": [{"name": "emu", "user": {"token": "t"}}],
        "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "emu", "namespace": NS}}],
    }))
    return path


async def send(server, method: str, url: str, body: dict[str, Any]) -> None:
    # Connection: close: an idle keep-alive connection's server task, started after the
    # operator, would hold kopf's shutdown for its 5 s wait on tasks it did not stop
    headers = {"Connection": "close"}
    if method == "patch":
        headers["Content-Type"] = "application/merge-patch+json"
    async with server.request(method, url, json=body, headers=headers) as resp:
        assert resp.status < 300, await resp.text()


def event_reasons(server, with_type: bool = False) -> list[Any]:
    events = [o.raw for (res, _, _), o in server.objects.items() if res.plural == "events" and not o.deleted]
    return [(e.get("type"), e.get("reason")) if with_type else e.get("reason") for e in events]


def child_writes(server) -> list[kmock.Request]:
    """PATCH/POST/DELETE requests to anything but pools and events."""
    return [
        r for r in requests(server)
        if r.method in ("PATCH", "POST", "DELETE") and r.resource is not None
        and r.resource.plural not in (models.PLURAL, "events")
    ]


ALL_CHILDREN = [
    ("v1/secrets", "tiered-full-kvpool-keys"), ("v1/secrets", "tiered-full-redis"), ("v1/secrets", "tiered-full-minio"),
    ("v1/configmaps", "tiered-full-kvpool"), ("apps/v1/statefulsets", "tiered-full-redis"),
    ("v1/services", "tiered-full-redis"), ("apps/v1/statefulsets", "tiered-full-minio"),
    ("v1/services", "tiered-full-minio"), ("networking.k8s.io/v1/networkpolicies", "tiered-full-backends"),
    ("apps/v1/deployments", "tiered-full"), ("v1/services", "tiered-full"),
    ("policy/v1/poddisruptionbudgets", "tiered-full"),
]


ROUTER_CHILDREN = [
    ("v1/serviceaccounts", "tiered-full-router"),
    ("rbac.authorization.k8s.io/v1/rolebindings", "tiered-full-router-discovery"),
    ("apps/v1/deployments", "tiered-full-router"), ("v1/services", "tiered-full-router"),
]
INFERENCE_POOLS = "inference.networking.k8s.io/v1/inferencepools"
HPAS = "autoscaling/v2/horizontalpodautoscalers"
SCALED_OBJECTS = "keda.sh/v1alpha1/scaledobjects"


async def set_status(server, resource: str, name: str, replicas: int, ready: int) -> None:
    """What the Deployment/StatefulSet controllers would write (absent from the emulator)."""
    async with server.request(
        "patch", f"/apis/apps/v1/namespaces/{NS}/{resource}/{name}/status",
        json={"status": {"observedGeneration": 1, "replicas": replicas, "readyReplicas": ready,
                         "updatedReplicas": replicas}},
        headers={"Content-Type": "application/merge-patch+json"},
    ) as resp:
        assert resp.status < 300


async def owned_children(server, children: list[tuple[str, str]], component: str) -> None:
    """Each child appears, owned by the pool and labelled with its component."""
    uid = await eventually(lambda: pool_obj(server)["metadata"].get("uid"))
    for resource, name in children:
        obj = await eventually(
            lambda resource=resource, name=name: child(server, resource, name), message=f"{resource} {name}"
        )
        assert obj["metadata"]["ownerReferences"][0]["uid"] == uid
        assert obj["metadata"]["labels"]["app.kubernetes.io/component"] == component


async def test_router_children_status_endpoints_and_pruning(server, op_settings):
    """spec.router: its five children are applied (owned, server-side), status.endpoints.openai
    names the router, the pool is Ready only when the router is, and removing spec.router prunes
    them and points clients back at the engines' Service."""
    pool = load_example("tiered-full")
    pool["spec"]["router"] = {"policy": "cache_aware", "replicas": 2, "cacheThreshold": 0.5}
    async with running_operator(server, op_settings):
        await send(server, "post", POOLS_URL, pool)
        await owned_children(server, ROUTER_CHILDREN, "router")
        status = await eventually(lambda: pool_obj(server)["status"].get("observedGeneration") == 1
                                  and pool_obj(server)["status"], message="reconciled")
        assert status["endpoints"]["openai"] == f"http://tiered-full-router.{NS}.svc:8000"
        assert status["endpoints"]["engines"] == f"http://tiered-full.{NS}.svc:8000"
        router = child(server, "apps/v1/deployments", "tiered-full-router")
        assert router["spec"]["replicas"] == 2
        args = router["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--policy") + 1] == "cache_aware" and args[args.index("--cache-threshold") + 1] == "0.5"
        assert "--enable-scale-out" in child(server, "apps/v1/deployments", "tiered-full")[
            "spec"]["template"]["spec"]["containers"][0]["args"]
        binding = child(server, "rbac.authorization.k8s.io/v1/rolebindings", "tiered-full-router-discovery")
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                      "name": op_settings.router_discovery_role}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "tiered-full-router", "namespace": NS}]
        assert child(server, "v1/services", "tiered-full")["spec"]["type"] == "ClusterIP"

        # engines and backends ready, the router not yet: clients cannot get in, the pool is not Ready
        for resource, name, replicas in (
            ("statefulsets", "tiered-full-redis", 1),
            ("statefulsets", "tiered-full-minio", 1),
            ("deployments", "tiered-full", 2),
        ):
            await set_status(server, resource, name, replicas, replicas)
        await set_status(server, "deployments", "tiered-full-router", 2, 0)
        await eventually(lambda: "router 0/2 ready" in conditions(server)["Progressing"]["message"],
                         message="waiting for the router")
        assert pool_obj(server)["status"]["phase"] == "Progressing"
        await set_status(server, "deployments", "tiered-full-router", 2, 2)
        await eventually(lambda: pool_obj(server)["status"]["phase"] == "Ready", message="Ready")
        assert conditions(server)["Ready"]["message"] == "2/2 engines ready, router 2/2 ready"

        # no router: its children are pruned, clients go to the engines' Service again
        await send(server, "patch", f"{POOLS_URL}/tiered-full", {"spec": {"router": None}})
        for resource, name in ROUTER_CHILDREN:
            await eventually(
                lambda resource=resource, name=name: child(server, resource, name) is None,
                message=f"prune {resource} {name}",
            )
        await eventually(lambda: pool_obj(server)["status"]["endpoints"]["openai"] == f"http://tiered-full.{NS}.svc:8000",
                         message="endpoints back at the engines")
        await eventually(lambda: "--enable-scale-out" not in child(server, "apps/v1/deployments", "tiered-full")[
            "spec"]["template"]["spec"]["containers"][0]["args"], message="engines without scale-out")
        assert child(server, "apps/v1/deployments", "tiered-full") is not None
        deletes = sorted((r.resource.plural, r.name) for r in child_writes(server) if r.method == "DELETE")
        assert deletes == sorted((resource.rsplit("/", 1)[1], name) for resource, name in ROUTER_CHILDREN)


PREFILL_CHILDREN = [
    ("apps/v1/deployments", "tiered-full-prefill"), ("v1/services", "tiered-full-prefill"),
    ("policy/v1/poddisruptionbudgets", "tiered-full-prefill"),
]


def pod_labels(server, name: str) -> dict[str, str]:
    return child(server, "apps/v1/deployments", name)["spec"]["template"]["metadata"]["labels"]


def router_args(server) -> list[str]:
    router = child(server, "apps/v1/deployments", "tiered-full-router")
    return router["spec"]["template"]["spec"]["containers"][0]["args"]


async def test_prefill_role_children_router_status_refusal_and_pruning(server, op_settings):
    """spec.prefill: the prefill Deployment, Service and PDB are applied (owned), both roles' pods
    carry their role label, the router runs in P/D mode discovering each role by it, status has
    each role's replicas, ready replicas and endpoint and is Ready only when the prefill engines
    are; a spec without a shared tier is refused naming spec.prefill with every child kept; removing
    spec.prefill prunes the role and takes the router and the engines back."""
    pool = load_example("tiered-full")
    pool["spec"]["router"] = {"policy": "round_robin"}
    pool["spec"]["prefill"] = {"replicas": 2, "extraArgs": ["--max-num-batched-tokens", "16384"]}
    async with running_operator(server, op_settings):
        await send(server, "post", POOLS_URL, pool)
        await owned_children(server, PREFILL_CHILDREN, "prefill")
        await eventually(lambda: pool_obj(server)["status"].get("observedGeneration") == 1, message="reconciled")
        prefill = child(server, "apps/v1/deployments", "tiered-full-prefill")
        assert prefill["spec"]["replicas"] == 2
        prefill_args = prefill["spec"]["template"]["spec"]["containers"][0]["args"]
        assert prefill_args[-2:] == ["--max-num-batched-tokens", "16384"]
        assert pod_labels(server, "tiered-full-prefill")["llm-d.ai/role"] == "prefill"
        assert pod_labels(server, "tiered-full")["llm-d.ai/role"] == "decode"
        args = router_args(server)
        assert "--vllm-pd-disaggregation" in args and "--selector" not in args
        assert args[args.index("--prefill-selector") + 3] == "llm-d.ai/role=prefill"
        assert args[args.index("--decode-selector") + 3] == "llm-d.ai/role=decode"

        # everything ready but one prefill engine: not Ready, and status says which role waits
        for resource, name, replicas in (("statefulsets", "tiered-full-redis", 1),
                                         ("statefulsets", "tiered-full-minio", 1),
                                         ("deployments", "tiered-full", 2), ("deployments", "tiered-full-router", 1)):
            await set_status(server, resource, name, replicas, replicas)
        await set_status(server, "deployments", "tiered-full-prefill", 2, 1)
        await eventually(lambda: "prefill 1/2 ready" in conditions(server)["Progressing"]["message"],
                         message="waiting for the prefill engines")
        await eventually(lambda: (pool_obj(server)["status"].get("roles") or {}).get("prefill", {}).get(
            "readyReplicas") == 1, message="roles in status")
        assert pool_obj(server)["status"]["phase"] == "Progressing"
        await set_status(server, "deployments", "tiered-full-prefill", 2, 2)
        await eventually(lambda: pool_obj(server)["status"]["phase"] == "Ready", message="Ready")
        status = pool_obj(server)["status"]
        assert conditions(server)["Ready"]["message"] == "2/2 engines ready, prefill 2/2 ready, router 1/1 ready"
        assert status["roles"] == {
            "prefill": {"desiredReplicas": 2, "replicas": 2, "readyReplicas": 2,
                        "endpoint": f"http://tiered-full-prefill.{NS}.svc:8000"},
            "decode": {"desiredReplicas": 2, "replicas": 2, "readyReplicas": 2,
                       "endpoint": f"http://tiered-full.{NS}.svc:8000"}}

        # no tier both roles reach: refused naming spec.prefill, nothing deleted
        await send(server, "patch", f"{POOLS_URL}/tiered-full",
                   {"spec": {"tiers": {"redis": None, "s3": None, "disk": None}}})
        cond = await eventually(lambda: conditions(server).get("ConfigValid", {}).get("status") == "False"
                                and conditions(server)["ConfigValid"], message="refused")
        assert cond["message"].startswith("spec.prefill: needs a tier both roles reach"), cond["message"]
        assert all(child(server, resource, name) for resource, name in PREFILL_CHILDREN)
        assert not [r for r in child_writes(server) if r.method == "DELETE"]
        assert pool_obj(server)["status"]["roles"]["prefill"]["readyReplicas"] == 2  # as the children are

        # back to a shared tier and without spec.prefill: the role is pruned, the rest goes back
        await send(server, "patch", f"{POOLS_URL}/tiered-full", {"spec": {
            "tiers": {"redis": load_example("tiered-full")["spec"]["tiers"]["redis"]}, "prefill": None}})
        for resource, name in PREFILL_CHILDREN:
            await eventually(lambda resource=resource, name=name: child(server, resource, name) is None,
                             message=f"prune {resource} {name}")
        await eventually(lambda: "--selector" in router_args(server), message="router out of P/D mode")
        await eventually(lambda: "roles" not in pool_obj(server)["status"], message="roles dropped from status")
        assert conditions(server)["ConfigValid"]["status"] == "True", conditions(server)["ConfigValid"]
        # The engines' pods keep llm-d.ai/role: decode here: the live template holds all that is
        # rendered, so the operator applies nothing (a real API server would also drop the label
        # only on an apply); the label goes at the engines' next template change.


def applies(server, resource: str, name: str) -> list[dict[str, Any]]:
    """The bodies of the operator's server-side applies to one child, in order (not the test's own)."""
    return [r.data for r in child_writes(server) if r.method == "PATCH" and r.resource.plural == resource
            and r.name == name and r.headers.get("Content-Type", "").startswith(APPLY)
            and not r.headers.get("User-Agent", "").startswith("kmock/")]


async def test_autoscaling_leaves_the_engines_replicas_to_the_autoscaler(server, op_settings):
    """spec.autoscaling: an HPA targets the engine Deployment, whose applies never carry replicas,
    so what the autoscaler writes (here with its own field manager) survives the operator's next
    reconcile; status shows the autoscaler's desired count against the ready one; without
    autoscaling the operator owns replicas again and prunes the HPA. (The emulator keeps fields a
    manager stops applying, where a real API server removes the ones only that manager owned:
    the test asserts the applied bodies, which decide that, and the stored object.)"""
    pool = load_example("tiered-full")
    pool["spec"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 6, "triggers": {"waitingRequests": 3}}
    deployment = f"/apis/apps/v1/namespaces/{NS}/deployments/tiered-full"
    async with running_operator(server, op_settings):
        await send(server, "post", POOLS_URL, pool)
        hpa = await eventually(lambda: child(server, HPAS, "tiered-full"), message="HPA")
        assert hpa["spec"]["scaleTargetRef"]["name"] == "tiered-full" and hpa["spec"]["maxReplicas"] == 6
        dep = await eventually(lambda: child(server, "apps/v1/deployments", "tiered-full"), message="Deployment")
        assert "replicas" not in dep["spec"]
        await eventually(lambda: pool_obj(server)["status"].get("observedGeneration") == 1, message="reconciled")

        # the autoscaler scales the Deployment out, under its own field manager
        async with server.request("patch", f"{deployment}?fieldManager=horizontal-pod-autoscaler&force=true",
                                  json={"apiVersion": "apps/v1", "kind": "Deployment",
                                        "metadata": {"name": "tiered-full", "namespace": NS},
                                        "spec": {"replicas": 5}},
                                  headers={"Content-Type": APPLY, "Connection": "close"}) as resp:
            assert resp.status < 300
        await set_status(server, "deployments", "tiered-full", 5, 3)
        status = await eventually(lambda: pool_obj(server)["status"].get("desiredReplicas") == 5
                                  and pool_obj(server)["status"], message="desired from the autoscaler")
        assert status["readyReplicas"] == 3 and "3/5 engines ready" in conditions(server)["Progressing"]["message"]

        # a spec change makes the operator apply the Deployment again: replicas stay the autoscaler's
        before = len(applies(server, "deployments", "tiered-full"))
        await send(server, "patch", f"{POOLS_URL}/tiered-full",
                   {"spec": {"replicas": 2, "model": {"env": [{"name": "SCALE_TEST", "value": "1"}]}}})
        await eventually(lambda: len(applies(server, "deployments", "tiered-full")) > before, message="re-applied")
        bodies = applies(server, "deployments", "tiered-full")
        assert bodies and all("replicas" not in body["spec"] for body in bodies)
        assert child(server, "apps/v1/deployments", "tiered-full")["spec"]["replicas"] == 5
        await eventually(lambda: pool_obj(server)["status"].get("observedGeneration") == 2, message="reconciled")
        assert pool_obj(server)["status"]["desiredReplicas"] == 5  # spec.replicas 2 is ignored meanwhile

        # autoscaling off: the operator owns replicas again, the HPA is pruned
        await send(server, "patch", f"{POOLS_URL}/tiered-full", {"spec": {"autoscaling": None}})
        await eventually(lambda: child(server, HPAS, "tiered-full") is None, message="HPA pruned")
        await eventually(lambda: child(server, "apps/v1/deployments", "tiered-full")["spec"]["replicas"] == 2,
                         message="replicas applied")
        await eventually(lambda: pool_obj(server)["status"].get("desiredReplicas") == 2, message="desired 2")

        # on again, with replicas owned by the operator alone (managedFields as a real API server
        # keeps them; the emulator keeps none): the count is handed over before an apply drops it
        owned = [{"manager": MANAGER, "operation": "Apply", "apiVersion": "apps/v1", "fieldsType": "FieldsV1",
                  "fieldsV1": {"f:spec": {"f:replicas": {}}}}]
        await send(server, "patch", deployment, {"metadata": {"managedFields": owned}})
        before = len(child_writes(server))
        await send(server, "patch", f"{POOLS_URL}/tiered-full", {"spec": {"autoscaling": {
            "maxReplicas": 6, "triggers": {"waitingRequests": 3}}}})
        await eventually(lambda: child(server, HPAS, "tiered-full"), message="HPA again")
        writes = [r for r in child_writes(server)[before:] if r.resource.plural == "deployments"]
        handover = [i for i, r in enumerate(writes) if "fieldManager=kvpool-operator-handover" in str(r.url)]
        dropped = [i for i, r in enumerate(writes) if "fieldManager=kvpool-operator&" in str(r.url) + "&"
                   and "replicas" not in r.data["spec"]]
        assert handover and writes[handover[0]].data["spec"] == {"replicas": 2}
        assert not dropped or handover[0] < dropped[0]
        assert child(server, "apps/v1/deployments", "tiered-full")["spec"]["replicas"] == 2


async def test_each_pd_role_has_its_own_autoscaler_and_desired_count(server, op_settings):
    """spec.prefill.autoscaling: an HPA of its own targets the prefill Deployment, which is applied
    without replicas; what that autoscaler writes survives the operator's next apply and is the
    prefill role's desired count in status (Ready waits for it), beside the decode role's own."""
    pool = load_example("tiered-full")
    pool["spec"]["router"] = {"policy": "round_robin"}
    pool["spec"]["prefill"] = {"autoscaling": {"maxReplicas": 4, "triggers": {"promptTokensComputed": 4000}}}
    async with running_operator(server, op_settings):
        await send(server, "post", POOLS_URL, pool)
        hpa = await eventually(lambda: child(server, HPAS, "tiered-full-prefill"), message="prefill HPA")
        assert hpa["spec"]["scaleTargetRef"]["name"] == "tiered-full-prefill" and hpa["spec"]["maxReplicas"] == 4
        assert child(server, HPAS, "tiered-full") is None  # the decode engines keep spec.replicas
        dep = await eventually(lambda: child(server, "apps/v1/deployments", "tiered-full-prefill"),
                               message="prefill Deployment")
        assert "replicas" not in dep["spec"]
        await eventually(lambda: pool_obj(server)["status"].get("observedGeneration") == 1, message="reconciled")

        async with server.request(
                "patch", f"/apis/apps/v1/namespaces/{NS}/deployments/tiered-full-prefill"
                         "?fieldManager=horizontal-pod-autoscaler&force=true",
                json={"apiVersion": "apps/v1", "kind": "Deployment",
                      "metadata": {"name": "tiered-full-prefill", "namespace": NS}, "spec": {"replicas": 3}},
                headers={"Content-Type": APPLY, "Connection": "close"}) as resp:
            assert resp.status < 300
        for name, replicas, ready in (("tiered-full", 2, 2), ("tiered-full-prefill", 3, 1),
                                      ("tiered-full-router", 1, 1)):
            await set_status(server, "deployments", name, replicas, ready)
        # the desired count (the Deployment's spec) and the ready one (its status, set above) reach
        # the pool's status in separate reconciles: wait for both
        roles = await eventually(
            lambda: (pool_obj(server)["status"].get("roles") or {}).get("prefill", {}).get("desiredReplicas") == 3
            and pool_obj(server)["status"]["roles"]["prefill"].get("readyReplicas") == 1
            and pool_obj(server)["status"]["roles"], message="prefill desired from its autoscaler, 1 ready")
        assert roles["decode"]["desiredReplicas"] == 2
        assert "prefill 1/3 ready" in conditions(server)["Progressing"]["message"]

        before = len(applies(server, "deployments", "tiered-full-prefill"))
        await send(server, "patch", f"{POOLS_URL}/tiered-full",
                   {"spec": {"prefill": {"extraArgs": ["--max-num-batched-tokens", "8192"]}}})
        await eventually(lambda: len(applies(server, "deployments", "tiered-full-prefill")) > before,
                         message="prefill re-applied")
        assert all("replicas" not in body["spec"] for body in applies(server, "deployments", "tiered-full-prefill"))
        assert child(server, "apps/v1/deployments", "tiered-full-prefill")["spec"]["replicas"] == 3


async def test_scale_to_zero_without_keda_is_refused_naming_the_field(server, op_settings):
    pool = load_example("tiered-full")
    pool["spec"]["autoscaling"] = {"minReplicas": 0, "maxReplicas": 2, "triggers": {"kvCacheUsage": 0.7}}
    async with running_operator(server, op_settings):
        await send(server, "post", POOLS_URL, pool)
        cond = await eventually(lambda: conditions(server).get("ConfigValid", {}).get("status") == "False"
                                and conditions(server)["ConfigValid"], message="refused")
        assert cond["message"].startswith("spec.autoscaling.minReplicas: 0 needs KEDA")
        assert child(server, "apps/v1/deployments", "tiered-full") is None


def gateway_pool() -> dict[str, Any]:
    pool = load_example("tiered-full")
    pool["spec"]["inferencePool"] = {"enabled": True, "endpointPickerRef": {"name": "epp", "port": {"number": 9002}}}
    return pool


async def test_inference_pool_refused_without_the_operator_setting(server):
    """Off (the default): a pool asking for an InferencePool is refused naming the field, and the
    operator never touches inferencepools (it holds no RBAC for them)."""
    settings = Settings(connector_image="kvpool-vllm:test", allowed_host_path_prefixes=("/mnt",))
    async with running_operator(server, settings):
        await send(server, "post", POOLS_URL, gateway_pool())
        cond = await eventually(lambda: conditions(server).get("ConfigValid", {}).get("status") == "False"
                                and conditions(server)["ConfigValid"], message="refused")
        assert cond["message"].startswith("spec.inferencePool.enabled: refused by this operator")
        assert child(server, "apps/v1/deployments", "tiered-full") is None
    assert not [r for r in requests(server) if r.resource is not None and r.resource.plural == "inferencepools"]


async def test_inference_pool_applied_and_pruned_with_the_operator_setting(server):
    settings = Settings(connector_image="kvpool-vllm:test", allowed_host_path_prefixes=("/mnt",), inference_pools=True)
    async with running_operator(server, settings):
        await send(server, "post", POOLS_URL, gateway_pool())
        ip = await eventually(lambda: child(server, INFERENCE_POOLS, "tiered-full"), message="InferencePool")
        assert ip["spec"]["selector"]["matchLabels"] == {
            "app.kubernetes.io/instance": "tiered-full", "app.kubernetes.io/component": "engine",
            "kvpool.dev/pool": "tiered-full"}
        await send(server, "patch", f"{POOLS_URL}/tiered-full", {"spec": {"inferencePool": {"enabled": False}}})
        await eventually(lambda: child(server, INFERENCE_POOLS, "tiered-full") is None, message="pruned")


async def test_lifecycle_create_update_prune_invalid_delete(server, op_settings):
    async with running_operator(server, op_settings):
        # --- create: every child exists, owned by the pool, applied server-side
        await send(server, "post", POOLS_URL, load_example("tiered-full"))
        # The first reconcile pass ends by writing status with observedGeneration (a child event may
        # refresh conditions earlier, never observedGeneration): wait for it, do not read it once.
        status = await eventually(lambda: pool_obj(server)["status"].get("observedGeneration") == 1
                                  and pool_obj(server)["status"], message="first reconcile's status")
        assert conditions(server)["ConfigValid"]["status"] == "True"
        uid = pool_obj(server)["metadata"]["uid"]
        for resource, name in ALL_CHILDREN:
            obj = await eventually(
                lambda resource=resource, name=name: child(server, resource, name), message=f"{resource} {name}"
            )
            refs = obj["metadata"]["ownerReferences"]
            assert refs == [{"apiVersion": models.API_VERSION, "kind": models.KIND, "name": "tiered-full",
                             "uid": uid, "controller": True, "blockOwnerDeletion": True}]
            assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == MANAGER
        applies = [r for r in child_writes(server) if r.method == "PATCH"]
        assert applies and all(
            r.headers["Content-Type"] == APPLY and r.params == {"fieldManager": MANAGER, "force": "true"}
            for r in applies
        )  # a real API server records kvpool-operator as owner of exactly these fields
        secret = child(server, "v1/secrets", "tiered-full-redis")
        assert len(secret_data(secret)["password"]) >= 32  # generated at creation
        keys = secret_data(child(server, "v1/secrets", "tiered-full-kvpool-keys"))
        assert len(keys["poolKey"]) >= 32 and 0 <= int(keys["hashSeed"]) < 2**32
        # only fields of the status schema (a real API server would prune anything else)
        assert set(status) <= {f.alias for f in models.KVCachePoolStatus.model_fields.values()}
        models.KVCachePoolStatus.model_validate(status)
        assert status["phase"] == "Pending"  # no kubelet here: no engine pod ever becomes ready
        assert status["endpoints"]["openai"] == f"http://tiered-full.{NS}.svc:8000"
        assert set(conditions(server)) >= {"Ready", "Progressing", "Degraded", "ConfigValid", "BackendsReady"}
        assert conditions(server)["Ready"]["status"] == "False"
        await eventually(lambda: "Applied" in event_reasons(server), message="Applied events")

        # --- update tiers.cpu.size: the Deployment's config checksum changes (pods would roll)
        before = checksum(server)
        await send(server, "patch", f"{POOLS_URL}/tiered-full", {"spec": {"tiers": {"cpu": {"size": "32Gi"}}}})
        await eventually(lambda: checksum(server) != before, message="checksum changes")
        cm = child(server, "v1/configmaps", "tiered-full-kvpool")
        assert f"size: {32 << 30}" in cm["data"]["connector.yaml"]
        await eventually(lambda: pool_obj(server)["status"]["observedGeneration"] == 2)
        assert child_writes(server)[-1].data["metadata"]["name"] in ("tiered-full", "tiered-full-kvpool")

        # --- remove tiers.redis: the Redis children are pruned, the rest stays
        await send(server, "patch", f"{POOLS_URL}/tiered-full", {"spec": {"tiers": {"redis": None}}})
        for resource in ("apps/v1/statefulsets", "v1/services", "v1/secrets"):
            await eventually(
                lambda resource=resource: child(server, resource, "tiered-full-redis") is None,
                message=f"prune {resource}",
            )
        assert child(server, "apps/v1/statefulsets", "tiered-full-minio") is not None
        assert "redis" not in child(server, "v1/configmaps", "tiered-full-kvpool")["data"]["connector.yaml"]
        deletes = [r for r in child_writes(server) if r.method == "DELETE"]
        assert sorted(r.name for r in deletes) == ["tiered-full-redis"] * 3

        # --- invalid update: ConfigValid=False with the field named, nothing deleted or rewritten
        writes_before = len(child_writes(server))
        await send(server, "patch", f"{POOLS_URL}/tiered-full",
                   {"spec": {"tiers": {"disk": {"volume": {"emptyDir": {}}}}}})
        cond = await eventually(lambda: conditions(server)["ConfigValid"]["status"] == "False"
                                and conditions(server)["ConfigValid"])
        assert cond["reason"] == "InvalidSpec"
        assert "spec.tiers.disk.volume" in cond["message"] and "exactly one of" in cond["message"]
        await eventually(lambda: pool_obj(server)["status"]["phase"] == "Invalid"
                         and conditions(server)["Stalled"]["status"] == "True", message="Invalid, Stalled")
        # The pass that found the spec invalid is over once its status and Event are out (it applies
        # children before either): no write it could still make is pending.
        await eventually(lambda: ("Warning", "InvalidSpec") in event_reasons(server, with_type=True))
        assert len(child_writes(server)) == writes_before
        assert child(server, "apps/v1/deployments", "tiered-full") is not None

        # --- fix it again: valid and converged
        await send(server, "patch", f"{POOLS_URL}/tiered-full",
                   {"spec": {"tiers": {"disk": {"volume": {"emptyDir": None}}}}})
        await eventually(lambda: conditions(server)["ConfigValid"]["status"] == "True")

        # --- delete: kopf's finalizer is released, the pool disappears, no handler error
        async with server.request("delete", f"{POOLS_URL}/tiered-full") as resp:
            assert resp.status < 300
        await eventually(lambda: pool_obj(server) is None, message="pool deleted")
        # Kubernetes' garbage collector (absent here) deletes the children via their ownerReferences.
        assert child(server, "apps/v1/deployments", "tiered-full")["metadata"]["ownerReferences"][0]["uid"] == uid


@pytest.mark.parametrize("field,spec", [
    ("spec.tiers.cpu.size", {"tiers": {"cpu": {"size": "1.5"}}}),
    ("spec.model.shmSize", {"model": {"shmSize": "0.3Ki"}}),
    ("spec.tiers.disk.size", {"tiers": {"disk": {"size": "1.0000001k"}}}),
    ("spec.model.resources.limits.memory", {"model": {"resources": {"limits": {"memory": "8Gi"}}}}),
], ids=["1.5", "0.3Ki", "1.0000001k", "limit-below-the-memory-account"])
async def test_a_size_of_a_fraction_of_a_byte_is_reported_and_nothing_is_deleted(server, op_settings, field, spec):
    """A size that is no whole number of bytes (stored before the CRD refused it, or applied
    around it), or a memory limit below what the engine maps (which CEL cannot read: resources
    is free-form), gets ConfigValid=False naming the field, and no child is deleted or rewritten."""
    async with running_operator(server, op_settings):
        await send(server, "post", POOLS_URL, load_example("tiered-full"))
        await eventually(lambda: pool_obj(server)["status"].get("observedGeneration") == 1, message="reconciled")
        writes_before = len(child_writes(server))
        await send(server, "patch", f"{POOLS_URL}/tiered-full", {"spec": spec})
        cond = await eventually(lambda: pool_obj(server)["status"].get("observedGeneration") == 2
                                and conditions(server)["ConfigValid"], message="the bad size's pass")
        assert cond["status"] == "False" and cond["reason"] == "InvalidSpec"
        assert cond["message"].startswith(f"{field}: "), cond["message"]
        await eventually(lambda: ("Warning", "InvalidSpec") in event_reasons(server, with_type=True))
        assert len(child_writes(server)) == writes_before
        for resource, name in ALL_CHILDREN:
            assert child(server, resource, name) is not None, (resource, name)


async def test_restart_converges_without_rewriting_unchanged_children(server, op_settings, operator_log):
    async with running_operator(server, op_settings):
        await send(server, "post", POOLS_URL, load_example("tiered-full"))
        for resource, name in ALL_CHILDREN:
            await eventually(
                lambda resource=resource, name=name: child(server, resource, name), message=f"{resource} {name}"
            )
        await eventually(lambda: pool_obj(server)["status"].get("observedGeneration") == 1, message="reconciled")
    secret_before = copy.deepcopy(child(server, "v1/secrets", "tiered-full-minio"))
    writes = len(child_writes(server))
    versions = {key: len(server.objects[key].history) for key in server.objects
                if key[0].plural not in (models.PLURAL, "events")}

    mark = len(operator_log.lines)
    async with running_operator(server, op_settings):  # the resume handler runs for the existing pool
        # the handler logs its summary after its last write: then nothing of that pass is pending
        summary = await eventually(
            lambda: [line for line in operator_log.lines[mark:] if line.startswith("reconciled:")],
            message="resume pass finished",
        )
        assert len(summary) == 1 and summary[0].startswith("reconciled: 0 applied, 0 pruned,"), summary
    assert len(child_writes(server)) == writes, [f"{r.method} {r.url}" for r in child_writes(server)[writes:]]
    assert {key: len(server.objects[key].history) for key in versions} == versions
    assert child(server, "v1/secrets", "tiered-full-minio") == secret_before  # credentials never rotate


async def test_drift_is_corrected_by_the_timer(server):
    settings = Settings(
        connector_image="kvpool-vllm:test", allowed_host_path_prefixes=("/mnt",), reconcile_interval=0.5
    )
    async with running_operator(server, settings):
        await send(server, "post", POOLS_URL, load_example("tiered-full"))
        dep = await eventually(lambda: child(server, "apps/v1/deployments", "tiered-full"))
        assert dep["spec"]["replicas"] == 2
        # someone edits the Deployment by hand
        async with server.request("patch", f"/apis/apps/v1/namespaces/{NS}/deployments/tiered-full",
                                  json={"spec": {"replicas": 7}},
                                  headers={"Content-Type": "application/merge-patch+json"}) as resp:
            assert resp.status < 300
        await eventually(lambda: child(server, "apps/v1/deployments", "tiered-full")["spec"]["replicas"] == 2,
                         message="drift corrected")


async def test_missing_secret_is_reported_then_picked_up(server):
    settings = Settings(connector_image="kvpool-vllm:test", allowed_host_path_prefixes=("/mnt",), retry_delay=0.5)
    async with running_operator(server, settings):
        await send(server, "post", POOLS_URL, {**load_example("tiered-external"), "metadata": {"name": "tiered-full"}})
        cond = await eventually(lambda: conditions(server).get("ConfigValid", {}).get("status") == "False"
                                and conditions(server)["ConfigValid"])
        assert "spec.tiers.redis.external.passwordSecretRef: Secret 'redis' not found" in cond["message"]
        assert "Secret 's3-creds' not found" in cond["message"]
        assert child(server, "apps/v1/deployments", "tiered-full") is None  # nothing started half-configured
        # the user creates the Secrets; the operator notices on its retry, without a spec change
        await send(server, "post", f"/api/v1/namespaces/{NS}/secrets",
                   {"metadata": {"name": "redis"}, "data": {"password": "cHc="}})
        await send(server, "post", f"/api/v1/namespaces/{NS}/secrets",
                   {"metadata": {"name": "s3-creds"}, "data": {"accessKey": "YQ==", "secretKey": "Yg=="}})
        await eventually(lambda: conditions(server)["ConfigValid"]["status"] == "True", message="recovered")
        await eventually(lambda: child(server, "apps/v1/deployments", "tiered-full"), message="engines applied")
        # it works, but its Redis is plain redis://: a Warning condition and Event say so
        secure = conditions(server)["BackendsSecure"]
        assert secure["status"] == "False" and "redis:// sends the cache" in secure["message"]
        await eventually(lambda: ("Warning", "InsecureBackend") in event_reasons(server, with_type=True))


async def test_plaintext_backends_and_an_open_load_balancer_are_warned_about(server, op_settings, caplog):
    """tiered-full's managed Redis and MinIO run without TLS: BackendsSecure=False names both and a
    Warning Event says so; its API on a LoadBalancer without an API key: a warning in the log."""
    pool = load_example("tiered-full")
    pool["spec"]["service"] = {"type": "LoadBalancer"}
    async with running_operator(server, op_settings):
        await send(server, "post", POOLS_URL, pool)
        secure = await eventually(lambda: conditions(server).get("BackendsSecure"), message="BackendsSecure")
        assert secure["status"] == "False" and secure["reason"] == "InsecureBackend"
        assert "spec.tiers.redis.managed: no tls" in secure["message"]
        assert "spec.tiers.s3.managed: no tls" in secure["message"]
        await eventually(lambda: ("Warning", "InsecureBackend") in event_reasons(server, with_type=True))
        await eventually(lambda: [r for r in caplog.records if r.levelname == "WARNING" and
                                  "spec.service.type: LoadBalancer without apiKeySecretRef" in r.getMessage()],
                         message="the open load balancer logged")


async def test_engine_readiness_reaches_pool_status(server, op_settings):
    """Deployment status written by the (absent) controller flows into the pool's status."""
    async with running_operator(server, op_settings):
        await send(server, "post", POOLS_URL, load_example("tiered-full"))
        await eventually(lambda: child(server, "apps/v1/deployments", "tiered-full"))
        await eventually(lambda: conditions(server).get("Ready"))
        for resource, name, replicas in (("statefulsets", "tiered-full-redis", 1),
                                         ("statefulsets", "tiered-full-minio", 1),
                                         ("deployments", "tiered-full", 2)):
            async with server.request(
                "patch", f"/apis/apps/v1/namespaces/{NS}/{resource}/{name}/status",
                json={"status": {"observedGeneration": 1, "replicas": replicas, "readyReplicas": replicas,
                                 "updatedReplicas": replicas}},
                headers={"Content-Type": "application/merge-patch+json"},
            ) as resp:
                assert resp.status < 300
        await eventually(lambda: pool_obj(server)["status"].get("phase") == "Ready", message="Ready")
        assert conditions(server)["Ready"]["status"] == "True"
        assert conditions(server)["BackendsReady"]["status"] == "True"
        assert pool_obj(server)["status"]["readyReplicas"] == 2


async def test_cli_run_subprocess_with_kubeconfig_and_liveness(server, tmp_path):
    """`kvpool-operator run` as deployed: kubeconfig login, liveness endpoint, clean SIGTERM."""
    import os
    import signal
    import socket
    import sys

    import aiohttp

    kubeconfig = write_kubeconfig(server, tmp_path)
    await send(server, "post", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                      "metadata": {"name": NS}})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "KVPOOL_CONNECTOR_IMAGE": "kvpool-vllm:cli",
           "KVPOOL_ALLOWED_HOST_PATH_PREFIXES": "/mnt"}
    proc = await asyncio.create_subprocess_exec(
        # the chart's default, namespaced mode: kopf lists and watches namespaces to match
        # --namespace (the emulator serves /api/v1/namespaces; the namespace exists, as on a cluster)
        sys.executable, "-m", "kvpool_operator.cli", "run", f"--namespace={NS}",
        "--liveness", f"http://127.0.0.1:{port}/healthz", env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    try:
        async def alive() -> bool:
            try:
                async with aiohttp.ClientSession() as session, \
                        session.get(f"http://127.0.0.1:{port}/healthz") as resp:
                    return resp.status == 200
            except aiohttp.ClientError:
                return False

        deadline = asyncio.get_running_loop().time() + 60
        while not await alive():
            assert proc.returncode is None, (await proc.stdout.read()).decode()[-3000:]
            assert asyncio.get_running_loop().time() < deadline, "liveness endpoint never came up"
            await asyncio.sleep(0.3)
        await send(server, "post", POOLS_URL, load_example("tiered-full"))
        dep = await eventually(lambda: child(server, "apps/v1/deployments", "tiered-full"), timeout=60)
        assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == "kvpool-vllm:cli"
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        output = (await asyncio.wait_for(proc.stdout.read(), 60)).decode()
        await asyncio.wait_for(proc.wait(), 60)
        print(output[-5000:])  # shown by pytest when the test fails
    assert proc.returncode == 0, output[-3000:]
    assert "Traceback" not in output, output[-3000:]


async def test_api_error_on_one_child_is_reported_and_retried(server):
    """A rejected apply (here 422, e.g. an immutable StatefulSet field) degrades the pool with an
    Event naming the child; the other children are still applied; kopf retries with backoff."""
    failures = iter([kmock.KubernetesError(status=422, reason="Invalid",
                                           message="spec: Forbidden: updates to statefulset spec are forbidden")] * 2)
    server["patch", kmock.resource("apps/v1/statefulsets"), kmock.name("tiered-full-minio")] << (
        lambda: next(failures))  # StopIteration afterwards: the emulator answers normally
    settings = Settings(connector_image="kvpool-vllm:test", allowed_host_path_prefixes=("/mnt",), retry_delay=0.5)
    async with running_operator(server, settings):
        await send(server, "post", POOLS_URL, load_example("tiered-full"))
        await eventually(lambda: ("Warning", "ApplyFailed") in event_reasons(server, with_type=True))
        assert child(server, "apps/v1/deployments", "tiered-full") is not None  # the rest went on
        # kopf writes the status patch after the handler returned, so after the Event: poll for it
        await eventually(lambda: [r for r in requests(server) if r.resource is not None
                                  and r.resource.plural == models.PLURAL and r.method == "PATCH"
                                  and "ApplyFailed" in json.dumps(r.data)],
                         message="the pool's status reports ApplyFailed")
        # kopf retries the handler; the next pass succeeds and clears Degraded. (kmock stores even a
        # rejected write, so here the retry finds the StatefulSet in place; a real API server would
        # have stored nothing and the retry re-applies it.)
        await eventually(lambda: conditions(server)["Degraded"]["status"] == "False"
                         and conditions(server)["ConfigValid"]["status"] == "True", message="recovered")
        passes = [r for r in requests(server) if r.method == "GET" and r.resource is not None
                  and r.resource.plural == "statefulsets" and r.name is None]
        assert len(passes) >= 2  # at least the failed pass and its retry listed the children


def verbs_used(reqs: list[kmock.Request]) -> set[tuple[str, str, str]]:
    """(apiGroup, resource[/subresource], verb) the way the API server authorizes each request.

    A server-side apply also needs `create` (the API server checks it when the object is absent).
    """
    by_action = {kmock.action.LIST: "list", kmock.action.WATCH: "watch", kmock.action.FETCH: "get",
                 kmock.action.CREATE: "create", kmock.action.DELETE: "delete"}
    out = set()
    for r in reqs:
        if r.resource is None or r.resource.plural is None:  # discovery: open to every client
            continue
        resource = r.resource.plural + (f"/{r.subresource}" if r.subresource else "")
        if r.method == "PUT":
            verbs = {"update"}
        elif r.method == "PATCH":
            verbs = {"patch", "create"} if r.headers.get("Content-Type", "").startswith(APPLY) else {"patch"}
        else:
            verbs = {by_action[r.action]}
        out |= {(r.resource.group, resource, verb) for verb in verbs}
    return out


# Granted but not exercised here, and why (everything else granted must show up in the requests).
NOT_EXERCISED = {
    # kopf's framework: the test runs kopf standalone with cluster scanning off.
    ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
    ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
    ("", "namespaces", "list"), ("", "namespaces", "watch"),
    *{("kopf.dev", plural, verb) for plural in ("clusterkopfpeerings", "kopfpeerings")
      for verb in ("list", "watch", "patch")},
    # Pruning works on every child kind; a pool always renders its ConfigMap, so it goes only when
    # an operator upgrade renames a child.
    ("", "configmaps", "delete"),
    # Not a request: the API server checks it when the operator creates the router's RoleBinding to
    # the discovery ClusterRole (whose pods list/watch the operator does not hold itself).
    ("rbac.authorization.k8s.io", "clusterroles", "bind"),
}


@pytest.mark.parametrize("inference_pools", [False, True], ids=["default", "opt-in"])
async def test_the_operator_uses_exactly_the_verbs_rbac_grants(server, inference_pools):
    """With the default settings and with the opt-ins inferencePools and keda (then with their extra
    rules): a pool with a router, an autoscaler (an HPA, or with keda a ScaledObject) and (opted in)
    an InferencePool is created, shrunk and deleted."""
    from kvpool_operator.rbac import rules_for

    op_settings = Settings(connector_image="kvpool-vllm:test", allowed_host_path_prefixes=("/mnt",),
                           reconcile_interval=300, inference_pools=inference_pools, keda=inference_pools)
    granted = {(g, r, v) for rule in rules_for(op_settings) for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}
    pool = load_example("tiered-full")
    pool["spec"]["router"] = {"policy": "consistent_hash"}
    pool["spec"]["autoscaling"] = {"maxReplicas": 4, "triggers": {"waitingRequests": 3}}
    scaler = (SCALED_OBJECTS if inference_pools else HPAS, "tiered-full")
    children = ALL_CHILDREN + ROUTER_CHILDREN + [scaler]
    if inference_pools:
        pool["spec"]["inferencePool"] = {
            "enabled": True,
            "endpointPickerRef": {"name": "epp", "port": {"number": 9002}},
        }
        children = children + [(INFERENCE_POOLS, "tiered-full")]
    # a labelled Secret without an ownerReference (restored from a backup): adopted by a patch
    await send(server, "post", f"/api/v1/namespaces/{NS}/secrets", {
        "metadata": {"name": "tiered-full-redis", "labels": {"app.kubernetes.io/managed-by": MANAGER,
                                                             "kvpool.dev/pool": "tiered-full"}},
        "data": {"password": "c2VjcmV0LXNlY3JldC1zZWNyZXQtc2VjcmV0LXNlY3JldA=="}})
    # what an older operator generated for MinIO: root credentials only
    old_minio = {"accessKey": "kvpool-0123456789ab", "secretKey": "old-root-secret-old-root-secret-0123"}
    await send(server, "post", f"/api/v1/namespaces/{NS}/secrets", {
        "metadata": {"name": "tiered-full-minio", "labels": {"app.kubernetes.io/managed-by": MANAGER,
                                                             "kvpool.dev/pool": "tiered-full"}},
        "stringData": old_minio})
    async with running_operator(server, op_settings):
        await send(server, "post", POOLS_URL, pool)
        for resource, name in children:
            await eventually(
                lambda resource=resource, name=name: child(server, resource, name), message=f"{resource} {name}"
            )
        await eventually(lambda: pool_obj(server)["status"].get("observedGeneration") == 1, message="reconciled")
        minio = secret_data(child(server, "v1/secrets", "tiered-full-minio"))
        assert {k: minio[k] for k in old_minio} == old_minio  # completed, never rewritten
        assert minio["engineAccessKey"].startswith("kvpool-") and len(minio["engineSecretKey"]) >= 32
        # fewer children: the PDB, the NetworkPolicy, everything of Redis, the router (its Deployment
        # among them) and the InferencePool are pruned
        await send(server, "patch", f"{POOLS_URL}/tiered-full", {"spec": {
            "replicas": 1, "networkPolicy": {"enabled": False}, "tiers": {"redis": None}, "router": None,
            "inferencePool": None, "autoscaling": None}})
        pruned = [("policy/v1/poddisruptionbudgets", "tiered-full"), ("v1/secrets", "tiered-full-redis"),
                  ("networking.k8s.io/v1/networkpolicies", "tiered-full-backends"), *ROUTER_CHILDREN, scaler]
        for resource, name in pruned + ([(INFERENCE_POOLS, "tiered-full")] if inference_pools else []):
            await eventually(
                lambda resource=resource, name=name: child(server, resource, name) is None, message=f"prune {resource}"
            )
        async with server.request("delete", f"{POOLS_URL}/tiered-full") as resp:
            assert resp.status < 300
        await eventually(lambda: pool_obj(server) is None, message="pool deleted")
    test_client = "kmock/"  # the test's own requests (creating, editing, deleting the pool)
    used = verbs_used([r for r in requests(server) if not r.headers.get("User-Agent", "").startswith(test_client)])
    assert used <= granted, f"used but not granted: {sorted(used - granted)}"
    # with keda the pool's autoscaler is a ScaledObject: HPAs are only listed (to prune one left from before)
    not_exercised = NOT_EXERCISED | ({("autoscaling", "horizontalpodautoscalers", verb)
                                      for verb in ("get", "create", "patch", "delete")} if inference_pools else set())
    assert granted - used == not_exercised, f"granted but never used: {sorted(granted - used - not_exercised)}"


REPO = Path(__file__).resolve().parents[2]
WRITES = ("POST", "PATCH", "PUT", "DELETE")


def doc_bash_blocks(heading: str) -> list[str]:
    """The ```bash blocks of one section of docs/operator.md (what users copy and run)."""
    text = (REPO / "docs" / "operator.md").read_text()
    section = text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", section, re.S)


def request_log(server) -> str:
    """The emulator's requests, one per line: what a failing kubectl step saw."""
    return "\n".join(f"{r.method} {r.url} {r.headers.get('User-Agent', '')[:24]}" for r in requests(server)[-80:])


async def bash(script: str, kubeconfig: Path, tmp_path: Path, server=None, **env: str) -> str:
    """Run a documented snippet with the real kubectl (./bin) against the emulator."""
    proc = await asyncio.create_subprocess_exec(
        "bash", "-euo", "pipefail", "-c", script,
        env={"PATH": f"{REPO / 'bin'}:/usr/bin:/bin", "KUBECONFIG": str(kubeconfig), "HOME": str(tmp_path), **env},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out = (await asyncio.wait_for(proc.communicate(), 60))[0].decode()
    assert proc.returncode == 0, out + ("\n--- requests:\n" + request_log(server) if server else "")
    return out


def writes_to(server, resource: str, name: str, by_operator: bool = True) -> list[kmock.Request]:
    """Write requests to one object (a POST names it in its body), by the operator or anyone."""
    out = []
    for r in requests(server):
        if r.method not in WRITES or r.resource is None or r.resource.plural != resource:
            continue
        target = r.name or ((r.data or {}).get("metadata") or {}).get("name")
        agent = r.headers.get("User-Agent", "")
        if target == name and (not by_operator or agent.startswith(("OpenAPI-Generator", "kopf"))):
            out.append(r)
    return out


async def test_pool_key_rotation_as_documented(server, tmp_path, operator_log):
    """The rotation steps of docs/operator.md, run with kubectl: the operator keeps what they set.
    Routine: the previous key is kept for reads, then dropped; compromise: a new key and hash seed,
    no previous key at all."""
    settings = Settings(
        connector_image="kvpool-vllm:test", allowed_host_path_prefixes=("/mnt",), reconcile_interval=0.5
    )
    kubeconfig = write_kubeconfig(server, tmp_path)
    rotate, drop, compromise = doc_bash_blocks("## Pool keys and their rotation")
    async with running_operator(server, settings):
        await send(server, "post", POOLS_URL, load_example("tiered-full"))
        keys = await eventually(lambda: child(server, "v1/secrets", "tiered-full-kvpool-keys"), message="keys")
        old = secret_data(keys)["poolKey"]
        await eventually(lambda: child(server, "apps/v1/deployments", "tiered-full"), message="engines")
        await eventually(lambda: pool_obj(server)["status"].get("observedGeneration") == 1, message="reconciled")

        before = requests(server)[-1].id
        await bash(rotate, kubeconfig, tmp_path, server)
        rotated = secret_data(child(server, "v1/secrets", "tiered-full-kvpool-keys"))
        assert rotated["previousPoolKey"] == old and rotated["poolKey"] != old and len(rotated["poolKey"]) >= 32
        assert rotated["hashSeed"] == secret_data(keys)["hashSeed"]
        restart = "kubectl.kubernetes.io/restartedAt"
        template = child(server, "apps/v1/deployments", "tiered-full")["spec"]["template"]
        assert restart in template["metadata"]["annotations"]

        # drift passes come and go; none of them touches the rotated Secret or undoes the restart
        mark = len(operator_log.lines)
        await eventually(lambda: sum(line.startswith("reconciled:") for line in operator_log.lines[mark:]) >= 2,
                         message="two drift passes")
        assert secret_data(child(server, "v1/secrets", "tiered-full-kvpool-keys")) == rotated
        operator_writes = writes_to(server, "secrets", "tiered-full-kvpool-keys")
        assert {r.method for r in operator_writes} == {"POST"}  # create-only (a concurrent pass may try too)
        assert [r for r in operator_writes if r.id > before] == []  # nothing since the rotation began
        template = child(server, "apps/v1/deployments", "tiered-full")["spec"]["template"]
        assert restart in template["metadata"]["annotations"]
        env = {e["name"]: e for e in template["spec"]["containers"][0]["env"]}
        assert env["KVPOOL_POOL_KEY_PREVIOUS"]["valueFrom"]["secretKeyRef"] == {
            "name": "tiered-full-kvpool-keys", "key": "previousPoolKey", "optional": True}

        # kubectl refuses a second `rollout restart` within the second of the first one
        # (restartedAt has whole seconds); people run these steps minutes apart
        restarted_at = template["metadata"]["annotations"][restart]
        await eventually(lambda: datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S")
                         > restarted_at[:19], message="the restart's second is over")
        await bash(
            drop, kubeconfig, tmp_path, server, POOL="tiered-full", NAMESPACE=NS, SECRET="tiered-full-kvpool-keys"
        )
        done = secret_data(child(server, "v1/secrets", "tiered-full-kvpool-keys"))
        assert done == {"poolKey": rotated["poolKey"], "hashSeed": rotated["hashSeed"]}

        # a leaked key: both values replaced, nothing of the old ones kept for reads
        restarted_at = child(server, "apps/v1/deployments", "tiered-full")["spec"]["template"]["metadata"][
            "annotations"][restart]
        await eventually(lambda: datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S")
                         > restarted_at[:19], message="the restart's second is over")
        await bash(compromise, kubeconfig, tmp_path, server)
        fresh = secret_data(child(server, "v1/secrets", "tiered-full-kvpool-keys"))
        assert set(fresh) == {"poolKey", "hashSeed"}  # no previousPoolKey
        assert fresh["poolKey"] not in (old, done["poolKey"]) and len(fresh["poolKey"]) >= 32
        assert fresh["hashSeed"].isdigit() and 0 <= int(fresh["hashSeed"]) <= 4294967295
        assert fresh["hashSeed"] != done["hashSeed"]  # 1 in 2**32 to fail by chance
        template = child(server, "apps/v1/deployments", "tiered-full")["spec"]["template"]
        assert template["metadata"]["annotations"][restart] > restarted_at
        await eventually(lambda: conditions(server)["ConfigValid"]["status"] == "True", message="the new keys pass")


async def test_a_users_keys_secret_is_checked_and_used(server):
    settings = Settings(connector_image="kvpool-vllm:test", allowed_host_path_prefixes=("/mnt",), retry_delay=0.5)
    pool = load_example("tiered-full")
    pool["spec"]["security"] = {"keysSecretRef": {"name": "team-keys"}}
    short = "too-short-a-key"
    async with running_operator(server, settings):
        await send(server, "post", f"/api/v1/namespaces/{NS}/secrets",
                   {"metadata": {"name": "team-keys"}, "stringData": {"poolKey": short, "hashSeed": "-1"}})
        await send(server, "post", POOLS_URL, pool)
        cond = await eventually(lambda: conditions(server).get("ConfigValid", {}).get("status") == "False"
                                and conditions(server)["ConfigValid"], message="invalid keys")
        assert "spec.security.keysSecretRef: Secret 'team-keys' key 'poolKey' must hold at least 32" in cond["message"]
        assert "key 'hashSeed' must be a decimal integer in [0, 4294967295]" in cond["message"]
        assert short not in json.dumps(pool_obj(server)) and short not in json.dumps(event_reasons(server))
        assert child(server, "apps/v1/deployments", "tiered-full") is None
        await send(server, "patch", f"/api/v1/namespaces/{NS}/secrets/team-keys",
                   {"stringData": {"poolKey": "k" * 40, "hashSeed": "4294967295"}})
        dep = await eventually(lambda: child(server, "apps/v1/deployments", "tiered-full"), message="engines")
        env = {e["name"]: e for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["PYTHONHASHSEED"]["valueFrom"]["secretKeyRef"] == {"name": "team-keys", "key": "hashSeed"}
        assert env["KVPOOL_POOL_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "team-keys", "key": "poolKey"}
        assert child(server, "v1/secrets", "tiered-full-kvpool-keys") is None  # nothing generated
        assert writes_to(server, "secrets", "team-keys") == []  # the user's Secret is only read


async def test_someone_elses_secret_under_a_generated_name_is_never_overwritten(server):
    settings = Settings(connector_image="kvpool-vllm:test", allowed_host_path_prefixes=("/mnt",), retry_delay=0.5)
    theirs = {"metadata": {"name": "tiered-full-kvpool-keys", "labels": {"team": "a"}},
              "data": {"note": "bm90IGEga2V5"}}
    async with running_operator(server, settings):
        await send(server, "post", f"/api/v1/namespaces/{NS}/secrets", theirs)
        await send(server, "post", POOLS_URL, load_example("tiered-full"))
        cond = await eventually(lambda: conditions(server).get("ConfigValid", {}).get("status") == "False"
                                and conditions(server)["ConfigValid"], message="conflict")
        assert "Secret 'tiered-full-kvpool-keys' exists but is not labelled" in cond["message"]
        assert child(server, "apps/v1/deployments", "tiered-full") is None  # nothing half-applied
        assert child(server, "v1/secrets", "tiered-full-kvpool-keys")["data"] == theirs["data"]
        assert writes_to(server, "secrets", "tiered-full-kvpool-keys") == []
        # its owner removes it: the operator creates its own on the next retry
        async with server.request("delete", f"/api/v1/namespaces/{NS}/secrets/tiered-full-kvpool-keys") as resp:
            assert resp.status < 300
        await eventually(lambda: "poolKey" in (child(server, "v1/secrets", "tiered-full-kvpool-keys") or {}).get(
            "data", {}), message="generated keys")
        await eventually(lambda: conditions(server)["ConfigValid"]["status"] == "True", message="valid")


async def test_someone_elses_object_at_a_childs_name_is_never_taken_over(server):
    """A ConfigMap of someone else's where the pool's belongs: no server-side apply goes over it
    (force would take its fields, labels and owner); status and a Warning Event name it, nothing is
    applied; once its owner removes it, the operator creates the pool's children."""
    theirs = {"metadata": {"name": "tiered-full-kvpool", "labels": {"app": "theirs"}}, "data": {"keep": "me"}}
    await send(server, "post", f"/api/v1/namespaces/{NS}/configmaps", theirs)
    settings = Settings(connector_image="kvpool-vllm:test", allowed_host_path_prefixes=("/mnt",), retry_delay=0.5)
    async with running_operator(server, settings):
        await send(server, "post", POOLS_URL, load_example("tiered-full"))
        cond = await eventually(lambda: conditions(server)["ConfigValid"]["status"] == "False"
                                and conditions(server)["ConfigValid"], message="the conflict is reported")
        assert cond["message"].startswith("ConfigMap/tiered-full-kvpool exists and is not this pool's"), cond
        await eventually(lambda: ("Warning", "InvalidSpec") in event_reasons(server, with_type=True))
        assert [r for r in child_writes(server) if not r.headers.get("User-Agent", "").startswith("kmock/")] == []
        configmap = child(server, "v1/configmaps", "tiered-full-kvpool")
        assert configmap["data"] == {"keep": "me"} and configmap["metadata"]["labels"] == {"app": "theirs"}
        assert not configmap["metadata"].get("ownerReferences")
        assert child(server, "apps/v1/deployments", "tiered-full") is None

        async with server.request("delete", f"/api/v1/namespaces/{NS}/configmaps/tiered-full-kvpool") as resp:
            assert resp.status < 300
        uid = pool_obj(server)["metadata"]["uid"]
        ours = await eventually(lambda: (child(server, "v1/configmaps", "tiered-full-kvpool") or {}).get(
            "metadata", {}).get("ownerReferences"), message="created once theirs is gone")
        assert ours[0]["uid"] == uid
        await eventually(lambda: conditions(server)["ConfigValid"]["status"] == "True", message="valid again")


async def test_no_secret_value_leaves_its_secret(server, caplog):
    """Generated and user-provided credentials appear in no other object (children, the pool and
    its status, Events) and in no operator log line, even at debug level."""
    caplog.set_level(logging.DEBUG)
    settings = Settings(connector_image="kvpool-vllm:test", allowed_host_path_prefixes=("/mnt",), retry_delay=0.5)
    user = {"redis": {"password": "user-redis-password-0123456789"},
            "s3-creds": {"accessKey": "AKIAUSERACCESSKEY", "secretKey": "user-s3-secret-key-0123456789"}}
    async with running_operator(server, settings):
        for name, values in user.items():
            await send(
                server, "post", f"/api/v1/namespaces/{NS}/secrets", {"metadata": {"name": name}, "stringData": values}
            )
        await send(server, "post", POOLS_URL, load_example("tiered-full"))
        await send(server, "post", POOLS_URL, load_example("tiered-external"))
        for name in ("tiered-full", "tiered-external"):
            await eventually(
                lambda name=name: (live(server, POOLS, NS, name) or {}).get("status", {}).get("observedGeneration"),
                message=f"{name} reconciled",
            )
    values = [v for (res, _, _), obj in server.objects.items() if res.plural == "secrets" and not obj.deleted
              for v in secret_data(obj.raw).values()]
    # the user's (tiered-full's Hugging Face token among them), both pools' keys, Redis, MinIO credentials
    assert len(values) == 1 + 3 + 2 * 2 + 2 + 4
    values = [v for v in values if len(v) >= 8]  # a short hash seed would match some digits by chance
    others = json.dumps([obj.raw for (res, _, _), obj in server.objects.items() if res.plural != "secrets"])
    logs = "\n".join(record.getMessage() for record in caplog.records)
    assert [v for v in values if v in others] == []
    assert [v for v in values if v in logs] == []


async def test_host_path_refused_by_default_names_the_field(server):
    """The operator's default settings allow no hostPath: the pool is invalid, nothing is created."""
    async with running_operator(server, Settings(connector_image="kvpool-vllm:test")):
        await send(server, "post", POOLS_URL, load_example("tiered-full"))
        cond = await eventually(lambda: conditions(server).get("ConfigValid", {}).get("status") == "False"
                                and conditions(server)["ConfigValid"], message="refused")
        assert cond["message"].startswith("spec.tiers.disk.volume.hostPath: refused by this operator")
        await eventually(lambda: ("Warning", "InvalidSpec") in event_reasons(server, with_type=True))
        assert child_writes(server) == []


async def test_taking_over_the_generated_keys_keeps_them(server, op_settings):
    """keysSecretRef naming the generated Secret: it stays (in use), nothing is regenerated."""
    async with running_operator(server, op_settings):
        await send(server, "post", POOLS_URL, load_example("tiered-full"))
        keys = await eventually(lambda: child(server, "v1/secrets", "tiered-full-kvpool-keys"), message="keys")
        await eventually(lambda: pool_obj(server)["status"].get("observedGeneration") == 1, message="reconciled")
        await send(server, "patch", f"{POOLS_URL}/tiered-full",
                   {"spec": {"security": {"keysSecretRef": {"name": "tiered-full-kvpool-keys"}}}})
        await eventually(lambda: pool_obj(server)["status"].get("observedGeneration") == 2, message="reconciled")
        assert conditions(server)["ConfigValid"]["status"] == "True"
        assert child(server, "v1/secrets", "tiered-full-kvpool-keys")["data"] == keys["data"]
        assert {r.method for r in writes_to(server, "secrets", "tiered-full-kvpool-keys")} == {"POST"}


async def test_a_size_no_node_holds_is_a_warning_and_the_pool_is_still_applied(server, op_settings):
    """SizesFit=False and one ExceedsNodeMemory Warning Event naming the field; children applied."""
    pool = load_example("tiered-cpu-only")
    pool["spec"]["tiers"]["cpu"]["size"] = "64Ti"  # a CPU pool (gpus: 0): beyond any node's 32Ti
    name = pool["metadata"]["name"]
    async with running_operator(server, op_settings):
        await send(server, "post", POOLS_URL, pool)
        sizes = await eventually(lambda: {c["type"]: c for c in (live(server, POOLS, NS, name) or {}).get(
            "status", {}).get("conditions", [])}.get("SizesFit"), message="SizesFit")
        assert sizes["status"] == "False" and sizes["reason"] == "ExceedsNodeMemory"
        assert sizes["message"].startswith(f"spec.tiers.cpu.size: Deployment/{name} requests 64.0Ti")
        await eventually(lambda: ("Warning", "ExceedsNodeMemory") in event_reasons(server, with_type=True))
        assert await eventually(lambda: child(server, "apps/v1/deployments", name), message="engines applied")
