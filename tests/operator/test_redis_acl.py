"""Managed Redis as the operator renders it, run with the real redis-server (and redis-cli).

The container's own command, args and env (Secret values filled in as the kubelet would) start a
local redis-server: its ACL file holds only password hashes, no process sees a password, the
readiness probe logs in through REDISCLI_AUTH, kvpool's real store works as the engines' ACL user
(with the tier config the operator renders) and that user is refused everything else; with
`tls.secretName` the same works over TLS only, verified with the Secret's CA.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import redis
import yaml

from kvpool_connector.store import open_store
from kvpool_dev.golden import GOLDEN_SETTINGS
from kvpool_dev.testbed.servers import free_port, wait_port
from kvpool_operator.render import render
from tests.conftest import skip_or_fail
from tests.operator.conftest import load_example

POOL_PREFIX = "kvpool:kvpool.tiered-full:"  # <key_prefix><store namespace>: of the pool under test
LAYOUT = b"redis-acl-test|bf16|L2"


@pytest.fixture(scope="module", autouse=True)
def _needs_redis_server():
    """make setup installs redis-server; without it these tests skip locally and fail in CI."""
    if shutil.which("redis-server") is None:
        skip_or_fail("redis-server missing: make setup")


def _server_version() -> tuple[int, int]:
    out = subprocess.run(["redis-server", "--version"], capture_output=True, text=True, check=True).stdout
    major, minor = re.search(r"v=(\d+)\.(\d+)", out).groups()
    return int(major), int(minor)


class Rendered:
    """The managed Redis children of examples/tiered-full.yaml and the engines' store config."""

    def __init__(self, tls: str | None = None) -> None:
        pool = load_example("tiered-full")
        if tls:
            pool["spec"]["tiers"]["redis"]["managed"]["tls"] = {"secretName": tls}
        manifests = render(pool, GOLDEN_SETTINGS, "kvpool")
        sts = next(m for m in manifests if m["kind"] == "StatefulSet" and m["metadata"]["name"] == "tiered-full-redis")
        self.container = sts["spec"]["template"]["spec"]["containers"][0]
        cm = next(m for m in manifests if m["kind"] == "ConfigMap")
        self.store = yaml.safe_load(cm["data"]["connector.yaml"])
        self.manifests = manifests

    def env(self, values: dict[str, str]) -> dict[str, str]:
        """The container's env with Secret keys resolved from `values`, as the kubelet resolves them."""
        out = {}
        for var in self.container["env"]:
            ref = var.get("valueFrom", {}).get("secretKeyRef")
            out[var["name"]] = values[ref["key"]] if ref else var["value"]
        return out


def local(parts: list[str], port: int, tls_dir: Path | None) -> list[str]:
    """The container's paths and port, moved to this machine (a free port, the test's TLS files)."""
    out = [p.replace("-p 6379", f"-p {port}") for p in parts]
    return [p.replace("/tls/", f"{tls_dir}/") for p in out] if tls_dir else out


def start(rendered: Rendered, workdir: Path, tls_dir: Path | None = None) -> dict:
    values = {"password": secrets.token_urlsafe(32), "enginePassword": secrets.token_urlsafe(32)}
    env = {**rendered.env(values), "ACL_FILE": str(workdir / "users.acl"), "PATH": os.environ["PATH"]}
    if _server_version() < (7, 2):  # CLIENT SETINFO (sent by redis-py) exists from 7.2; the image is 7.4
        env["ENGINE_ACL"] = env["ENGINE_ACL"].replace(" +client|setinfo", "")
    port = free_port()
    args = local(rendered.container["args"], port, tls_dir)
    listen = ["--tls-port", str(port)] if tls_dir else ["--port", str(port)]
    proc = subprocess.Popen(
        [*rendered.container["command"], *args, *listen, "--bind", "127.0.0.1", "--dir", str(workdir)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        wait_port(port, proc=proc)
    except Exception:
        proc.kill()
        raise AssertionError(proc.communicate(timeout=10)[0].decode()[-3000:]) from None
    return {"port": port, "values": values, "proc": proc, "rendered": rendered, "acl": Path(env["ACL_FILE"]),
            "tls_dir": tls_dir}


def stop(managed: dict) -> None:
    managed["proc"].send_signal(signal.SIGTERM)
    managed["proc"].wait(10)


@pytest.fixture(scope="module")
def managed(tmp_path_factory):
    server = start(Rendered(), tmp_path_factory.mktemp("managed-redis"))
    yield server
    stop(server)


def open_engine_store(managed: dict, monkeypatch):
    """kvpool's store with the rendered tier config, pointed at the local server."""
    rendered = managed["rendered"]
    tier = next(t for t in rendered.store["tiers"] if t["type"] == "redis")
    assert tier["username"] == "kvpool-engine" and tier["key_prefix"] == "kvpool:"
    scheme = tier["url"].split(":", 1)[0]
    tier = {**tier, "url": f"{scheme}://127.0.0.1:{managed['port']}/0"}
    if "tls_ca_file" in tier:
        tier["tls_ca_file"] = str(managed["tls_dir"] / "ca.crt")
    monkeypatch.setenv(tier["password_env"], managed["values"]["enginePassword"])
    monkeypatch.setenv(rendered.store["security"]["key_env"], secrets.token_urlsafe(32))
    return open_store({"namespace": rendered.store["namespace"], "tiers": [tier], "timeout_seconds": 5,
                       "security": rendered.store["security"]}, layout=LAYOUT)


def client(managed, user: str | None, password: str) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=managed["port"], username=user, password=password,
                       socket_timeout=5)


def test_no_password_in_the_acl_file_argv_or_environment(managed):
    values = managed["values"]
    acl = managed["acl"].read_text()
    for value in values.values():
        assert value not in acl
        assert "#" + hashlib.sha256(value.encode()).hexdigest() in acl  # only its hash
    assert oct(managed["acl"].stat().st_mode & 0o777) == "0o600"
    pid = managed["proc"].pid  # `exec`: the shell became redis-server
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode()
    environ = Path(f"/proc/{pid}/environ").read_bytes().decode()
    assert "redis-server" in cmdline
    for value in values.values():
        assert value not in cmdline and value not in environ
    blob = yaml.safe_dump(managed["rendered"].manifests)
    assert not [v for v in values.values() if v in blob]


def test_readiness_probe_logs_in_through_rediscli_auth(managed):
    probe = managed["rendered"].container["readinessProbe"]["exec"]["command"]
    command = local(probe, managed["port"], managed["tls_dir"])
    env = {**managed["rendered"].env(managed["values"]), "PATH": os.environ["PATH"]}
    assert subprocess.run(command, env=env, timeout=30).returncode == 0
    wrong = {**env, "REDISCLI_AUTH": "not-the-password"}
    assert subprocess.run(command, env=wrong, timeout=30, capture_output=True).returncode != 0


def round_trip(store) -> None:
    keys = [secrets.token_bytes(32) for _ in range(3)]
    payloads = [secrets.token_bytes(n) for n in (1, 4096, 300_000)]
    try:
        store.put_many(keys, payloads)
        assert [bytes(v) for v in store.get_many(keys)] == payloads
        assert store.contains_prefix(keys) == 3
        store.delete_many(keys[:1])
        assert store.get(keys[0]) is None and bytes(store.get(keys[1])) == payloads[1]
        stats = store.stats()["tiers"]["redis"]
        assert stats["errors"] == 0, stats
    finally:
        store.close()


def test_the_store_works_as_the_engines_user(managed, monkeypatch):
    round_trip(open_engine_store(managed, monkeypatch))
    admin = client(managed, None, managed["values"]["password"])
    names = [k.decode() for k in admin.scan_iter(count=1000)]
    assert len(names) == 2 and all(n.startswith(POOL_PREFIX) for n in names), names


def test_the_engines_user_may_do_nothing_else(managed):
    engine = client(managed, "kvpool-engine", managed["values"]["enginePassword"])
    mine = POOL_PREFIX + "probe"
    assert engine.ping()
    assert engine.set(mine, b"value", ex=30) and engine.getrange(mine, 0, 2) == b"val" and engine.exists(mine) == 1
    assert engine.unlink(mine) == 1
    refused = [
        lambda: engine.flushall(), lambda: engine.flushdb(), lambda: engine.keys("*"), lambda: engine.scan(),
        lambda: engine.config_get("*"), lambda: engine.get(mine), lambda: engine.delete(mine),
        lambda: engine.acl_list(), lambda: engine.client_list(), lambda: engine.info(),
        lambda: engine.eval("return 1", 0), lambda: engine.publish("c", "m"),
        lambda: engine.set("kvpool:ml.another-pool:x", b"v"), lambda: engine.set("other:x", b"v"),
        lambda: engine.getrange("kvpool:ml.another-pool:x", 0, 10), lambda: engine.mget([mine]),
        lambda: engine.getrange("other:x", 0, 10),
    ]
    for call in refused:
        with pytest.raises(redis.exceptions.NoPermissionError):
            call()
    with pytest.raises(redis.exceptions.AuthenticationError):
        client(managed, "kvpool-engine", "guessed").ping()
    with pytest.raises(redis.exceptions.AuthenticationError):
        client(managed, None, managed["values"]["enginePassword"]).ping()  # not the default user's password


def _certificates(directory: Path) -> Path:
    """A CA and a server certificate for 127.0.0.1 and the managed Service name, as cert-manager
    would put them into a kubernetes.io/tls Secret (tls.crt, tls.key, ca.crt)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def cert(subject, issuer, key, signer, ca: bool, san=None):
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvpool test CA")])
    ca = cert(ca_name, ca_name, ca_key, ca_key, ca=True)
    server = cert(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tiered-full-redis")]), ca_name, key, ca_key,
                  ca=False, san=[x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                 x509.DNSName("tiered-full-redis.kvpool.svc")])
    directory.mkdir()
    (directory / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (directory / "tls.crt").write_bytes(server.public_bytes(serialization.Encoding.PEM))
    (directory / "tls.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                          serialization.NoEncryption()))
    return directory


def test_managed_redis_over_tls_only(tmp_path, monkeypatch):
    rendered = Rendered(tls="redis-tls")
    managed = start(rendered, tmp_path, tls_dir=_certificates(tmp_path / "tls"))
    try:
        test_readiness_probe_logs_in_through_rediscli_auth(managed)
        round_trip(open_engine_store(managed, monkeypatch))
        with pytest.raises(redis.exceptions.ConnectionError):  # no plaintext listener at all
            client(managed, None, managed["values"]["password"]).ping()
    finally:
        stop(managed)
