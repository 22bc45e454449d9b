"""The Redis tier against a real 3-master Redis Cluster on loopback (redis-server
--cluster-enabled yes, joined by redis-cli --cluster create): keys spread over the slot
owners, per-node pipelines, a live resharding (MOVED) and an ACL user limited to the tier's
commands plus the cluster client's topology reads."""

from __future__ import annotations

import secrets
import subprocess

import pytest
import redis
from pydantic import ValidationError

from kvpool_connector.config import RedisTierConfig
from kvpool_connector.store import open_store
from kvpool_dev.testbed.process import free_port
from kvpool_dev.testbed.servers import RedisCluster
from tests.conftest import SECURITY

PASSWORD_ENV = "KVPOOL_TEST_RCLUSTER_PASSWORD"
# What the tier sends (data commands and connection setup), plus what redis-py's cluster
# client reads when it connects: the slot map and the command table. (CLIENT SETINFO exists
# from Redis 7.2 on; older servers answer it with an error redis-py ignores.)
ENGINE_ACL = ["-@all", "+set", "+getrange", "+exists", "+unlink", "+auth", "+hello",
              "+client|setinfo", "+ping", "+cluster|slots", "+command"]


@pytest.fixture(scope="module")
def cluster():
    with RedisCluster(masters=3) as c:
        yield c


def _store(cluster, namespace, monkeypatch, username=None, password=None, **tier):
    monkeypatch.setenv(PASSWORD_ENV, password or cluster.password)
    t = {"type": "redis", "url": cluster.url, "cluster": True, "password_env": PASSWORD_ENV,
         "timeout_seconds": 5.0, **tier}
    if username:
        t["username"] = username
    return open_store({"namespace": namespace, "security": SECURITY, "tiers": [t]})


def _keys_per_node(cluster, namespace) -> list[int]:
    return [sum(1 for _ in r.scan_iter(match=f"*{namespace}:*", count=1000))
            for r in cluster.node_clients()]


def _data(n: int) -> tuple[list[bytes], list[bytes]]:
    keys = [secrets.token_bytes(48) for _ in range(n)]
    sizes = [1, 100, 70_000, 300_000] * (n // 4 + 1)  # both the joined and the zero-copy SET
    return keys, [secrets.token_bytes(s) for s in sizes[:n]]


def test_round_trip_spreads_keys_over_every_master(cluster, namespace, monkeypatch):
    store = _store(cluster, namespace, monkeypatch)
    keys, payloads = _data(48)
    try:
        store.put_many(keys, payloads)
        assert store.flush(30)
        per_node = _keys_per_node(cluster, namespace)
        assert sum(per_node) == 48 and all(n > 0 for n in per_node), per_node
        assert [bytes(v) for v in store.get_many(keys)] == payloads
        bufs = [bytearray(len(p)) for p in payloads]
        assert store.get_many_into(keys, bufs) == [len(p) for p in payloads]
        assert [bytes(b) for b in bufs] == payloads
        assert store.contains_prefix(keys) == 48
        store.delete_many(keys[:10])
        assert store.contains_prefix(keys) == 0 and store.contains_prefix(keys[10:]) == 38
        assert sum(_keys_per_node(cluster, namespace)) == 38
        tier = store.stats()["tiers"]["redis"]
        assert tier["errors"] == 0 and tier["drops"] == 0 and tier["timeouts"] == 0, tier
    finally:
        store.close()


def test_batches_are_grouped_per_slot_owner(cluster, namespace, monkeypatch):
    """Each master receives exactly the SETs and GETRANGEs of the keys it owns: no command
    reaches a node that answers MOVED."""
    def calls(cmd):
        out = []
        for r in cluster.node_clients():
            stats = r.info("commandstats")
            out.append(stats.get(f"cmdstat_{cmd}", {}).get("calls", 0))
        return out

    store = _store(cluster, namespace, monkeypatch, batch_bytes="1Mi")  # several batches per node
    keys, payloads = _data(40)
    def moved():
        return sum(r.info("errorstats").get("errorstat_MOVED", {}).get("count", 0)
                   for r in cluster.node_clients())

    sets0, gets0, moved0 = calls("set"), calls("getrange"), moved()
    try:
        store.put_many(keys, payloads)
        assert store.flush(30)
        assert all(v is not None for v in store.get_many(keys))
        per_node = _keys_per_node(cluster, namespace)
        assert [a - b for a, b in zip(calls("set"), sets0, strict=True)] == per_node
        assert [a - b for a, b in zip(calls("getrange"), gets0, strict=True)] == per_node
        assert moved() == moved0  # not one MOVED
    finally:
        store.close()


def _node_ids(cluster) -> list[str]:
    return [r.execute_command("CLUSTER", "MYID").decode() for r in cluster.node_clients()]


def test_a_resharding_is_followed(cluster, namespace, monkeypatch):
    """Move every slot of the first master to the second while a store holds the old slot
    map: its reads get MOVED, refresh the map and still hit; new writes land on the new
    owner."""
    store = _store(cluster, namespace, monkeypatch)
    keys, payloads = _data(24)
    try:
        store.put_many(keys, payloads)
        assert store.flush(30)
        assert _keys_per_node(cluster, namespace)[0] > 0
        src, dst, _ = _node_ids(cluster)
        subprocess.run(["redis-cli", "--cluster", "reshard", f"127.0.0.1:{cluster.ports[0]}",
                        "--cluster-from", src, "--cluster-to", dst, "--cluster-slots", "16384",
                        "--cluster-yes"], env=cluster._env(), check=True, capture_output=True,
                       timeout=300)
        cluster.wait_ok()
        assert _keys_per_node(cluster, namespace)[0] == 0  # the keys moved with their slots
        old_owner = cluster.node_clients()[0]
        moved0 = old_owner.info("errorstats").get("errorstat_MOVED", {}).get("count", 0)
        assert [bytes(v) for v in store.get_many(keys)] == payloads
        assert old_owner.info("errorstats")["errorstat_MOVED"]["count"] > moved0  # it was asked
        more, more_payloads = _data(8)
        store.put_many(more, more_payloads)
        assert store.flush(30)
        assert _keys_per_node(cluster, namespace)[0] == 0
        assert [bytes(v) for v in store.get_many(more)] == more_payloads
        tier = store.stats()["tiers"]["redis"]
        assert tier["errors"] == 0 and tier["drops"] == 0, tier
    finally:
        store.close()


def test_engine_user_needs_only_the_tier_commands(cluster, namespace, monkeypatch):
    user, password = "kvpool-engine-" + namespace, secrets.token_hex(16)
    version = tuple(int(x) for x in cluster.node_clients()[0].info()["redis_version"].split(".")[:2])
    commands = [c for c in ENGINE_ACL[1:] if c != "+client|setinfo" or version >= (7, 2)]
    for r in cluster.node_clients():  # ACLs are per node in a cluster
        r.acl_setuser(user, enabled=True, passwords=[f"+{password}"], reset_keys=True,
                      keys=[f"kvpool:{namespace}:*"], commands=commands,
                      categories=["-@all"], reset_channels=True)
    store = _store(cluster, namespace, monkeypatch, username=user, password=password)
    keys, payloads = _data(12)
    try:
        store.put_many(keys, payloads)
        assert store.flush(30)
        assert [bytes(v) for v in store.get_many(keys)] == payloads
        assert store.contains_prefix(keys) == 12
        store.delete_many(keys)
        assert store.contains_prefix(keys) == 0
        tier = store.stats()["tiers"]["redis"]
        assert tier["errors"] == 0 and tier["drops"] == 0, tier
    finally:
        store.close()
    engine = redis.Redis(host="127.0.0.1", port=cluster.ports[0], username=user, password=password)
    with pytest.raises(redis.exceptions.NoPermissionError):
        engine.execute_command("GET", f"kvpool:{namespace}:x")


def test_a_cluster_that_is_down_is_a_miss_not_a_failed_start(namespace, monkeypatch):
    monkeypatch.setenv(PASSWORD_ENV, "unused")
    store = open_store({"namespace": namespace, "security": SECURITY, "tiers": [
        {"type": "redis", "url": f"redis://127.0.0.1:{free_port()}", "cluster": True,
         "password_env": PASSWORD_ENV, "timeout_seconds": 1.0}]})
    try:
        key = secrets.token_bytes(48)
        store.put_many([key], [b"x" * 100])
        assert store.get(key) is None and store.contains_prefix([key]) == 0
        assert store.stats()["tiers"]["redis"]["errors"] >= 1
    finally:
        store.close()


@pytest.mark.parametrize("url", ["unix:///run/redis.sock", "redis://host:6379/3"])
def test_cluster_config_refuses_what_a_cluster_cannot_be(url):
    with pytest.raises(ValidationError, match="cluster"):
        RedisTierConfig(url=url, cluster=True)
    RedisTierConfig(url=url, cluster=False)
