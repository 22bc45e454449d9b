"""Each pool's engines run as a uid/gid of their own (issue 54 item 1): the files one pool's
connector writes on a shared node directory are unreadable to another pool's engines, run
with the securityContext the operator renders, on real files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvpool_operator.render import load_pool, render
from kvpool_operator.render.connector import store_namespace
from kvpool_operator.render.engine import engine_uid
from kvpool_operator.settings import MAX_UID, Settings, SettingsError, misspelled
from tests.conftest import skip_or_fail
from tests.operator.conftest import load_example
from tests.operator.test_render import engines

# Runs as root, imports everything, then drops to the pod's ids (uid, gid, supplementary fsGroup
# as the kubelet runs a container) before touching the node directory.
CHILD = r"""
import json, os, sys, tempfile
from tests.connector.store.helpers import build_store
args = json.loads(sys.argv[1])
# every module a store imports on first use, loaded while the checkout is still readable (a
# fresh clone under a 0700 temp directory is not, to the pods' uids)
warm = build_store("warm-up", {"type": "disk", "path": tempfile.mkdtemp(), "size": "16Mi"})
warm.put(b"w" * 32, b"x" * 64)
warm.close()
os.setgroups([args["fs_group"]])
os.setgid(args["gid"])
os.setuid(args["uid"])
out = {}
if args["action"] == "write":
    store = build_store(args["namespace"], {"type": "disk", "path": args["dir"], "size": "16Mi"})
    out["stored"] = store.put(b"k" * 32, b"secret prompt KV" * 64)
    store.close()
else:
    read, refused = [], []
    def note(err):
        refused.append(err.filename)
    for root, _dirs, files in os.walk(args["dir"], onerror=note):
        for name in files:
            try:
                with open(os.path.join(root, name), "rb") as f:
                    read.append(len(f.read()))
            except PermissionError as e:
                refused.append(e.filename)
    out = {"read": read, "refused": refused}
print(json.dumps(out))
"""


def pod_ids(name: str, namespace: str, settings: Settings) -> dict:
    pool = load_example("tiered-full")
    pool["metadata"]["name"] = name
    sc = engines(render(pool, settings, namespace))["spec"]["template"]["spec"]["securityContext"]
    return {"uid": sc["runAsUser"], "gid": sc["runAsGroup"], "fs_group": sc["fsGroup"]}


def test_pools_get_their_own_stable_uid_in_the_operator_range(settings):
    a, b = pod_ids("llama", "team-a", settings), pod_ids("llama", "team-b", settings)
    assert a["uid"] != b["uid"] and a == pod_ids("llama", "team-a", settings)  # stable: a pool keeps its files
    for ids in (a, b):
        assert ids["uid"] == ids["gid"] != ids["fs_group"] == settings.engine_fs_group
        assert settings.engine_uid_first <= ids["uid"] < settings.engine_uid_first + settings.engine_uid_count
    narrow = settings.model_copy(update={"engine_uid_first": 5000, "engine_uid_count": 1})
    assert pod_ids("llama", "team-a", narrow)["uid"] == pod_ids("x", "y", narrow)["uid"] == 5000


def test_prefill_engines_share_the_pools_uid(settings):
    manifests = render(load_example("tiered-pd"), settings, "kvpool")
    uids = {m["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
            for m in manifests if m["kind"] == "Deployment" and "engine" in m["metadata"]["labels"].get(
                "app.kubernetes.io/component", "")}
    assert len(uids) == 1, uids


def test_uid_range_settings_are_checked():
    with pytest.raises(SettingsError, match="KVPOOL_ENGINE_UID_COUNT.*above 2147483647"):
        Settings.from_env({"KVPOOL_ENGINE_UID_FIRST": "2000000000", "KVPOOL_ENGINE_UID_COUNT": "200000000"})
    last = Settings.from_env({"KVPOOL_ENGINE_UID_FIRST": str(MAX_UID), "KVPOOL_ENGINE_UID_COUNT": "1"})
    assert last.engine_uid_first == MAX_UID
    with pytest.raises(SettingsError, match="KVPOOL_ENGINE_UID_FIRST='0'"):
        Settings.from_env({"KVPOOL_ENGINE_UID_FIRST": "0"})


def test_the_removed_fixed_uid_settings_are_reported_not_silently_ignored():
    (line,) = misspelled({"KVPOOL_ENGINE_RUN_AS_USER": "1000"})
    assert line.startswith("KVPOOL_ENGINE_RUN_AS_USER is no longer an operator setting") and "UID_FIRST" in line


def run_as(ids: dict, **args) -> dict:
    payload = json.dumps(ids | args)
    repo = str(Path(__file__).parents[2])
    done = subprocess.run([sys.executable, "-c", CHILD, payload], capture_output=True, text=True, timeout=120,
                          cwd=repo, env=os.environ | {"PYTHONPATH": repo})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_another_pools_engines_cannot_read_a_pools_disk_tier_files(settings):
    if os.geteuid() != 0:
        skip_or_fail("switching to the pods' uids needs root")
    owner, other = pod_ids("llama", "team-a", settings), pod_ids("mistral", "team-b", settings)
    # A node directory prepared as docs/operator.md says (install -d -m 2770 -g <engineFsGroup>),
    # and the pool's subPath directory the kubelet creates in it as root (group and mode inherited).
    node = Path(tempfile.mkdtemp(prefix="kvpool-node-"))
    try:
        node.chmod(0o711)
        prefix = node / "nvme0"
        prefix.mkdir()
        os.chown(prefix, 0, settings.engine_fs_group)
        prefix.chmod(0o2770)
        pool = load_example("tiered-full")
        pool["metadata"]["name"] = "llama"
        sub = prefix / store_namespace(load_pool(pool, settings, "team-a"))
        sub.mkdir()
        sub.chmod(prefix.stat().st_mode & 0o7777)  # the kubelet's SafeMakeDir: fchmod to its parent's mode
        assert run_as(owner, action="write", dir=str(sub), namespace="team-a.llama") == {"stored": True}
        assert run_as(owner, action="read", dir=str(sub))["read"], "the pool reads its own files"
        # the other pool's engines, had a mount reached this directory, read nothing of it
        seen = run_as(other, action="read", dir=str(sub))
        assert seen["read"] == [] and seen["refused"], seen
    finally:
        subprocess.run(["rm", "-rf", str(node)], check=False)


def test_engine_uid_is_the_rendered_one(settings):
    pool = load_example("tiered-full")
    assert engine_uid(load_pool(pool, settings, "kvpool")) == pod_ids(
        pool["metadata"]["name"], "kvpool", settings)["uid"]
