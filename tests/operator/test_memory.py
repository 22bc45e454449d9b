"""The engine's memory account (render/memory.py): what its memory request/limit and /dev/shm are
rendered from, the refusal of a limit below it, and `kvpool render --explain`."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import yaml

from kvpool_connector.config import parse_size
from kvpool_operator import models, validation
from kvpool_operator.render import InvalidPool, load_pool, render
from kvpool_operator.render.memory import account
from tests.operator.conftest import load_example

NATIVE = ["native-cpu", "native-nvme", "native-shared"]
REPO = __import__("pathlib").Path(__file__).resolve().parents[2]


def deployment(manifests: list[dict[str, Any]], component: str) -> dict[str, Any]:
    (found,) = [m for m in manifests if m["kind"] == "Deployment"
                and m["metadata"]["labels"]["app.kubernetes.io/component"] == component]
    return found["spec"]["template"]["spec"]


def shm_limit(pod_spec: dict[str, Any]) -> int:
    (dshm,) = [v for v in pod_spec["volumes"] if v["name"] == "dshm"]
    assert dshm["emptyDir"]["medium"] == "Memory"
    return parse_size(dshm["emptyDir"]["sizeLimit"])


def memory_of(pod_spec: dict[str, Any]) -> tuple[int, int]:
    resources = pod_spec["containers"][0]["resources"]
    return parse_size(resources["requests"]["memory"]), parse_size(resources["limits"]["memory"])


@pytest.mark.parametrize("name", NATIVE)
def test_native_shm_holds_vllms_host_region_and_memory_counts_it_once(name, settings):
    doc = load_example(name)
    spec = doc["spec"]
    region = spec["tiers"]["cpu"]["size"]
    pod = deployment(render(doc, settings, "kvpool"), "engine")
    # vLLM creates /dev/shm/vllm_offload_<engine>.mmap of cpu_bytes_to_use in /dev/shm
    kv = pod["containers"][0]["args"]
    assert f'"cpu_bytes_to_use":{parse_size(region)}' in kv[kv.index("--kv-transfer-config") + 1]
    assert shm_limit(pod) == parse_size(region) + parse_size("2Gi")  # the region + shmSize
    request, limit = memory_of(pod)
    queues = len({"disk", "redis", "s3"} & set(spec["tiers"])) - 1  # kvpool's secondary tier's store
    # once: the region is in /dev/shm's pages and nowhere else
    assert request == limit == parse_size(region) + parse_size("2Gi") + parse_size("8Gi") + max(queues, 0) * 2**30


def test_tiered_shm_is_shm_size_alone(settings):
    doc = load_example("tiered-emptydir")
    doc["spec"]["model"]["shmSize"] = "512Mi"
    assert shm_limit(deployment(render(doc, settings, "kvpool"), "engine")) == 512 << 20


def test_cpu_nodes_render_and_count_vllms_kv_cache_space(settings):
    doc = load_example("tiered-cpu-only")  # gpus: 0
    pod = deployment(render(doc, settings, "kvpool"), "engine")
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env[models.CPU_KV_CACHE_ENV] == "4"
    before = memory_of(pod)[0]
    doc["spec"]["model"]["cpuKvCacheGiB"] = 6
    pod = deployment(render(doc, settings, "kvpool"), "engine")
    assert {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}[models.CPU_KV_CACHE_ENV] == "6"
    assert memory_of(pod)[0] == before + 2 * 2**30
    doc["spec"]["model"]["tensorParallelSize"] = 2  # every rank's worker allocates its own
    assert memory_of(deployment(render(doc, settings, "kvpool"), "engine"))[0] == before + 8 * 2**30
    # a GPU engine's KV cache is device memory: no variable, not counted
    gpu = load_example("tiered-emptydir")
    gpu_pod = deployment(render(gpu, settings, "kvpool"), "engine")
    assert models.CPU_KV_CACHE_ENV not in {e["name"] for e in gpu_pod["containers"][0]["env"]}
    assert all("VLLM_CPU_KVCACHE_SPACE" not in item.what for item in account(load_pool(gpu, settings)).items)


def test_kv_cache_space_in_env_is_refused_naming_the_field(settings):
    doc = load_example("tiered-cpu-only")
    doc["spec"]["model"]["env"] = [{"name": models.CPU_KV_CACHE_ENV, "value": "64"}]
    with pytest.raises(InvalidPool, match="cpuKvCacheGiB"):
        load_pool(doc, settings)


@pytest.mark.parametrize(("name", "where", "limit", "ok"), [
    ("native-cpu", ("model",), "41Gi", False),   # 32 region + 2 shm + 8 overhead = 42Gi
    ("native-cpu", ("model",), "42Gi", True),
    ("native-cpu", ("model",), "45097156608", True),  # 42Gi in bytes: any quantity spelling
    ("tiered-full", ("model",), "96Gi", True),
    ("tiered-pd", ("prefill",), "40Gi", False),  # the prefill role's own limit
    ("tiered-pd", ("model",), "40Gi", False),  # both roles inherit it
])
def test_a_memory_limit_below_the_account_is_refused_naming_the_field(name, where, limit, ok, settings):
    doc = load_example(name)
    target = doc["spec"]
    for key in where:
        target = target.setdefault(key, {})
    target["resources"] = {"limits": {"memory": limit}}
    if ok:
        validation.check(doc, settings)
        return
    with pytest.raises(InvalidPool) as exc:
        validation.check(doc, settings)
    message = str(exc.value)
    assert message.startswith(f"spec.{where[0]}.resources.limits.memory: {limit} is below the "), message
    assert "\n" not in message


def test_an_unreadable_memory_limit_is_named(settings):
    doc = load_example("native-cpu")
    doc["spec"]["model"]["resources"] = {"limits": {"memory": "lots"}}
    with pytest.raises(InvalidPool, match=r"^spec\.model\.resources\.limits\.memory: 'lots' is not a Kubernetes"):
        validation.check(doc, settings)


def test_the_account_is_what_the_deployments_request(settings):
    doc = load_example("tiered-pd")
    pool = load_pool(doc, settings)
    manifests = render(doc, settings)
    for component in ("engine", "prefill"):
        assert memory_of(deployment(manifests, component)) == (account(pool).total,) * 2


def cli(*args: str, stdin: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpool_cli", *args], cwd=REPO, input=stdin,
                          capture_output=True, text=True, timeout=120)


def test_render_explain_prints_every_roles_account():
    doc = load_example("native-cpu")
    out = cli("render", "-f", "-", "--explain", stdin=yaml.safe_dump(doc))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "default/native-cpu decode engine maps 42Gi (memory request 42Gi, limit 42Gi)"
    assert any("native host region" in line and "32Gi" in line and "spec.tiers.cpu.size" in line for line in lines)
    assert lines[-1].strip() == "/dev/shm sizeLimit: 34Gi"
    assert "apiVersion" not in out.stdout  # the account instead of the manifests
    pd = cli("render", "-f", "-", "--explain", stdin=yaml.safe_dump(load_example("tiered-pd"))).stdout
    assert "tiered-pd decode engine maps" in pd and "tiered-pd prefill engine maps" in pd
    doc["spec"]["model"]["resources"] = {"limits": {"memory": "8Gi"}}
    refused = cli("render", "-f", "-", "--explain", stdin=yaml.safe_dump(doc))
    assert refused.returncode == 1 and refused.stdout == ""
    assert "spec.model.resources.limits.memory: 8Gi is below the 42Gi" in refused.stderr
    assert "Traceback" not in refused.stderr
