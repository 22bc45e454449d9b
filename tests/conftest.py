"""Shared test bed: real Redis, a real S3-compatible server, generated models, helm/kubectl.

Everything is session-scoped (engines and servers are expensive on 2 cores) and bound to
loopback on free ports.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

from kvpool_dev.testbed import dtype as engine_dtype, zygote
from kvpool_dev.testbed.engine import UNMARKED_TEST_ENV
from kvpool_dev.testbed.localmodel import ensure_model
from kvpool_dev.testbed.servers import RedisServer, S3Server

REPO = Path(__file__).resolve().parents[1]
POOL_KEY_ENV = "KVPOOL_TEST_POOL_KEY"
SECURITY = {"key_env": POOL_KEY_ENV}  # the `security` block of every test store with shared tiers


def pytest_configure(config) -> None:
    """The engines' dtype, chosen once for the session and inherited by every engine and
    dev-tool process the tests start (bf16 only where the CPU has it natively)."""
    global ENGINE_DTYPE
    ENGINE_DTYPE = engine_dtype.choose()
    os.environ.setdefault(engine_dtype.ENV, ENGINE_DTYPE.dtype)
    # offline engines fork from a process that imported vLLM once (testbed/zygote.py): an
    # engine start took 1.5 s instead of 9.5 s; dev tools the tests start inherit it
    os.environ.setdefault(zygote.ENV, "1")
    bind = worker_cores(os.environ.get("PYTEST_XDIST_WORKER", ""),
                        int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")),
                        sorted(os.sched_getaffinity(0)))
    if bind:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", bind)


def worker_cores(worker: str, workers: int, cpus: list[int]) -> str | None:
    """The cores an xdist worker's engines compute on (`VLLM_CPU_OMP_THREADS_BIND`): a share
    of the CPUs each, so two engines in two workers never bind OpenMP threads to the same
    core. Bound to both cores of a 2-core machine, two engines at once each wait at every
    parallel region's barrier for a thread the other engine's thread displaced: the
    decode-heavy modules ran 2x slower than alone. None outside xdist (every core)."""
    if not worker.startswith("gw") or workers < 2 or len(cpus) < 2:
        return None
    share = cpus[int(worker[2:]) % workers::workers] or cpus
    return ",".join(map(str, share))


ENGINE_DTYPE: engine_dtype.DtypeChoice | None = None


ENGINE_GROUP = "engines-"  # xdist group prefix of a module whose tests start vLLM engines


def engine_group(item) -> str:
    """One xdist group per engine module: its tests share module-scoped engines and state
    (hit counters), so they run in one worker, in order; two modules may run at once."""
    return ENGINE_GROUP + item.nodeid.split("::", 1)[0]


def _loadgroup(config) -> bool:
    """True in an xdist worker of a `--dist loadgroup` run (where collection happens)."""
    return bool(config.getoption("loadgroup", default=False))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    """With pytest-xdist (`make test` runs two workers), every engine module is one xdist
    group, and under `--dist loadgroup` the engine modules are queued first: they are the
    long units (30-110 s each), so each worker starts on one and the short tests (operator,
    store, chart) fill in around them at the end. With one group for every engine test, one
    worker ran ~13 min of engines while the other finished the rest in ~5 and then idled.
    Tests marked `alone` are deselected there: `make test` runs them after, in one process.

    tryfirst: xdist's own hook reads the group marks to route tests; a mark added after it
    does nothing, and engine modules (which share state between their tests) split across
    workers."""
    if _loadgroup(config):  # `alone` tests need every core: never beside another worker's
        crowded = [i for i in items if i.get_closest_marker("alone") is not None]
        if crowded:
            config.hook.pytest_deselected(items=crowded)
            if not config.option.markexpr:  # with -m (make test: "not alone"), a choice made
                warnings.warn(pytest.PytestWarning(
                    f"{len(crowded)} tests marked `alone` deselected: they need every core, not an "
                    "xdist worker beside others (make test runs them after, in one process)"), stacklevel=1)
            items[:] = [i for i in items if i.get_closest_marker("alone") is None]
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(pytest.mark.xdist_group(engine_group(item)))
    if _loadgroup(config):
        items.sort(key=lambda i: i.get_closest_marker("vllm") is None)  # stable: order kept


def pytest_collection_finish(session) -> None:
    """Refuse to run engine tests ungrouped under `--dist loadgroup` (the failure it
    prevents is a module's tests on two workers, seen only as missing hits)."""
    if not _loadgroup(session.config):
        return
    loose = [i.nodeid for i in session.items if i.get_closest_marker("vllm") is not None
             and not i.nodeid.endswith("@" + engine_group(i))]
    if loose:
        raise pytest.UsageError(f"vllm tests not in their engine module's xdist group: {loose[:3]}")



def pytest_report_header(config) -> str:
    return ENGINE_DTYPE.describe() if ENGINE_DTYPE else ""


@pytest.fixture(autouse=True)
def _engines_only_in_vllm_tests(request, monkeypatch):
    """A test that starts a vLLM engine (directly or through a dev-tool process) must carry
    the `vllm` marker, which `make test-fast` deselects."""
    if request.node.get_closest_marker("vllm") is None:
        monkeypatch.setenv(UNMARKED_TEST_ENV, request.node.nodeid)


@pytest.fixture(scope="session", autouse=True)
def pool_key():
    """A random pool key for the session, in the environment (engines inherit it)."""
    import secrets

    os.environ[POOL_KEY_ENV] = secrets.token_urlsafe(32)
    yield os.environ[POOL_KEY_ENV]
    os.environ.pop(POOL_KEY_ENV, None)


def skip_or_fail(reason: str) -> None:
    """A capability this machine lacks (a mount, a privilege): a skip on a developer's
    machine, a failure in CI (`CI=true`), where a skip would hide an untested feature."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{reason} (CI=true: this must run in CI, not be skipped)")
    pytest.skip(reason)


def self_signed_cert(directory: Path, host: str = "127.0.0.1") -> tuple[Path, Path]:
    """(cert.pem, key.pem) of a one-day self-signed certificate for `host` (an IP)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.TraditionalOpenSSL,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """2 layers, hidden 128: fast correctness tests."""
    return ensure_model("tiny")


@pytest.fixture(scope="session")
def bench_model() -> Path:
    """8 layers, hidden 1024, 4 KV heads: prefill cost that makes cache hits visible."""
    return ensure_model("bench")


@pytest.fixture(scope="session")
def redis_server():
    """A real redis-server with a password; `.stop()`, `.start()`, `.restart()` for fault tests."""
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def s3_server():
    """moto's standalone S3 server on loopback with one bucket; `.client()` is a boto3 client."""
    with S3Server() as server:
        yield server


def _binary(name: str) -> Path:
    path = REPO / "bin" / name
    if not os.access(path, os.X_OK):
        pytest.fail(f"{path} missing: run `make setup` (installs helm and kubectl into ./bin)")
    return path


@pytest.fixture(scope="session")
def helm() -> Path:
    return _binary("helm")


@pytest.fixture(scope="session")
def kubectl() -> Path:
    return _binary("kubectl")
