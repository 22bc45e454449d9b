"""A native engine started as its rendered pod would start it: /dev/shm is a tmpfs of the
rendered `sizeLimit` (a kubelet sizes a memory emptyDir's tmpfs to it), the engine runs with
the rendered `--kv-transfer-config` and VLLM_CPU_KVCACHE_SPACE.

vLLM 0.32's native host tier is one file in /dev/shm of the whole `cpu_bytes_to_use`, and vLLM
checks the free space before creating it. Each engine here runs in a private mount namespace
(`unshare --mount`, as root) with its own tmpfs on /dev/shm, so nothing of the machine's
/dev/shm is used or seen. Sizes come from the test's own overrides of the native-cpu example
(a 256 MiB host tier, 256 MiB shmSize), never from editing the example.

- sized as the operator renders it now (the region + shmSize), with a region a killed engine
  left in that /dev/shm beforehand (as after a container restart: the emptyDir stays), the
  engine removes the stale region, starts, and serves a prompt's second request from its host
  tier;
- sized as it was rendered before (shmSize alone), vLLM refuses to start with its
  "Insufficient space" line: the failure this render fixes.
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvpool_connector.config import parse_size
from kvpool_dev.golden import GOLDEN_SETTINGS
from kvpool_dev.testbed.engine import VllmServer
from kvpool_operator.render import render
from tests.operator.conftest import load_example

from .conftest import token_prompt, wait_until

pytestmark = [
    pytest.mark.vllm, pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                       reason="a private tmpfs on /dev/shm needs root and unshare (CI and the dev "
                              "machines run as root)"),
]

REGION = "256Mi"
SHM_SIZE = "256Mi"  # vLLM checks each of its message queues (up to 240 MiB) against the free space
STALE = "vllm_offload_killed-engine.mmap"
INSUFFICIENT = "Insufficient space in /dev/shm for CPU KV offload shared region"

# Runs inside the new mount namespace: a tmpfs of the given size on /dev/shm, optionally a
# region left by an engine killed with SIGKILL (created, every page written, no cleanup), then
# the engine.
LAUNCH = """
size="$1"; stale="$2"; stale_bytes="$3"; shift 3
mount -t tmpfs -o "size=$size,mode=1777" tmpfs /dev/shm || exit 97
if [ -n "$stale" ]; then
  "$1" -c 'import mmap, os, signal, sys
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, int(sys.argv[2]))
m = mmap.mmap(fd, int(sys.argv[2]))
m[:] = b"\\1" * len(m)
os.kill(os.getpid(), signal.SIGKILL)' "/dev/shm/$stale" "$stale_bytes"
fi
df -k /dev/shm >&2
exec "$@"
"""


class TmpfsShmServer(VllmServer):
    """A vLLM server whose /dev/shm is a private tmpfs of `shm_bytes`."""

    def __init__(self, *args: Any, shm_bytes: int, stale_bytes: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shm_bytes, self.stale_bytes = shm_bytes, stale_bytes

    def command(self) -> list[str]:
        stale = [STALE, str(self.stale_bytes)] if self.stale_bytes else ["", "0"]
        return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", LAUNCH, "sh",
                str(self.shm_bytes), *stale, *super().command()]  # the command starts with python

    def shm_files(self) -> list[str]:
        """What the engine's /dev/shm holds (its mount namespace, seen through /proc)."""
        assert self.proc is not None
        return sorted(p.name for p in Path(f"/proc/{self.proc.pid}/root/dev/shm").iterdir())


def rendered(model: Path) -> tuple[dict[str, Any], int, dict[str, str]]:
    """(the --kv-transfer-config, /dev/shm's sizeLimit in bytes, the env values) of the engine
    the operator renders for the native-cpu example with this test's sizes, on a CPU node."""
    doc = load_example("native-cpu")
    doc["spec"]["model"] |= {"name": str(model), "gpus": 0, "cpuKvCacheGiB": 1, "shmSize": SHM_SIZE,
                             "memoryOverhead": "2Gi", "extraArgs": []}
    doc["spec"]["tiers"]["cpu"]["size"] = REGION
    (deployment,) = [m for m in render(doc, GOLDEN_SETTINGS) if m["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = container["args"]
    (dshm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
    (kv_space,) = [e["value"] for e in container["env"] if e["name"] == "VLLM_CPU_KVCACHE_SPACE"]
    env = {"VLLM_CPU_KVCACHE_SPACE": kv_space}
    return (json.loads(args[args.index("--kv-transfer-config") + 1]), parse_size(dshm["emptyDir"]["sizeLimit"]),
            env)


def complete(server: VllmServer, prompt: list[int]) -> dict:
    body = json.dumps({"model": "local", "prompt": prompt, "max_tokens": 2, "temperature": 0}).encode()
    req = urllib.request.Request(server.base_url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def metric(server: VllmServer, counter: str, **labels: str) -> float:
    """A vLLM counter's value summed over the series with `labels`."""
    total = 0.0
    for line in server.metrics().splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name == counter + "_total" and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_the_rendered_shm_holds_the_region_after_a_killed_engine(tiny_model):
    kv_config, shm_bytes, env = rendered(tiny_model)
    assert shm_bytes == parse_size(REGION) + parse_size(SHM_SIZE)
    assert kv_config["kv_connector_extra_config"]["cpu_bytes_to_use"] == parse_size(REGION)
    # the killed engine's region is as large as this one's: without the sweep no space is left
    server = TmpfsShmServer(tiny_model, kv_transfer_config=kv_config, env=env, max_model_len=4096,
                            extra_args=["--no-enable-prefix-caching"],  # a second hit is the host tier's
                            shm_bytes=shm_bytes, stale_bytes=parse_size(REGION))
    with server:
        assert STALE not in server.shm_files()
        assert any(name.startswith("vllm_offload_") for name in server.shm_files())  # its own region
        prompt = token_prompt(600, seed=53)
        assert complete(server, prompt)["usage"]["prompt_tokens"] == 600
        wait_until(lambda: metric(server, "vllm:kv_offload_store_bytes") > 0, what="the prompt's chunks stored")
        usage = complete(server, prompt)["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 512  # 2 chunks of 256 tokens
        assert metric(server, "vllm:prompt_tokens_cached_by_source", source="host") == 512
    assert "removed /dev/shm/" + STALE in server.log_tail(400)


def test_shm_sized_to_shm_size_alone_is_refused_by_vllm(tiny_model):
    kv_config, _, env = rendered(tiny_model)
    server = TmpfsShmServer(tiny_model, kv_transfer_config=kv_config, env=env, max_model_len=4096,
                            shm_bytes=parse_size(SHM_SIZE))  # the render before issue 53
    with pytest.raises(RuntimeError, match="exited"):
        server.start()
    assert INSUFFICIENT in server.log_tail(400)
