"""Managed MinIO: root credentials only for the bootstrap, a bucket-scoped user for the engines,
an expiry rule and a quota so the bucket cannot fill its volume, optional TLS.

No MinIO server runs here: the rendered bootstrap script runs with a recording stand-in for
`mc` (what it is asked, on argv and stdin), and the engines' IAM policy is compared with the S3
calls kvpool's S3 tier makes (read from its source).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import stat
import subprocess
from pathlib import Path

import kubernetes_validate
import yaml

from kvpool_dev.golden import GOLDEN_SETTINGS
from kvpool_operator.render import render
from tests.operator.conftest import K8S_VERSION, load_example

REPO = Path(__file__).resolve().parents[2]


def rendered(tls: bool = False, **managed) -> list[dict]:
    pool = load_example("tiered-full")
    pool["spec"]["tiers"]["s3"]["managed"] |= managed
    if tls:
        pool["spec"]["tiers"]["s3"]["managed"]["tls"] = {"secretName": "minio-tls"}
    return render(pool, GOLDEN_SETTINGS, "kvpool")


def minio_pod(manifests) -> dict:
    sts = next(m for m in manifests if m["kind"] == "StatefulSet" and m["metadata"]["name"] == "tiered-full-minio")
    return sts["spec"]["template"]["spec"]


def containers(manifests) -> dict[str, dict]:
    return {c["name"]: c for c in minio_pod(manifests)["containers"]}


def engine_env(manifests) -> dict[str, dict]:
    dep = next(m for m in manifests if m["kind"] == "Deployment")
    return {e["name"]: e for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}


def s3_tier(manifests) -> dict:
    cm = next(m for m in manifests if m["kind"] == "ConfigMap")
    return next(t for t in yaml.safe_load(cm["data"]["connector.yaml"])["tiers"] if t["type"] == "s3")


def test_engines_use_the_bucket_scoped_user_never_root():
    m = rendered()
    env = engine_env(m)
    assert env["KVPOOL_S3_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "tiered-full-minio",
        "key": "engineAccessKey",
    }
    assert env["KVPOOL_S3_SECRET_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "tiered-full-minio",
        "key": "engineSecretKey",
    }
    assert s3_tier(m)["create_bucket"] is False  # the bootstrap made it; engines may not create buckets
    secret = next(x for x in m if x["kind"] == "Secret" and x["metadata"]["name"] == "tiered-full-minio")
    assert secret["metadata"]["annotations"]["kvpool.dev/generate-keys"] == \
        "accessKey,secretKey,engineAccessKey,engineSecretKey"


def test_bootstrap_gets_root_credentials_only_through_the_kubelet():
    boot = containers(rendered())["bootstrap"]
    env = boot["env"]
    names = [e["name"] for e in env]
    host = next(e for e in env if e["name"] == "MC_HOST_kvpool")["value"]
    assert host == "http://$(ROOT_USER):$(ROOT_PASSWORD)@127.0.0.1:9000"
    # $(VAR) expands only from variables defined before it, which come from the Secret
    assert names.index("ROOT_USER") < names.index("MC_HOST_kvpool") > names.index("ROOT_PASSWORD")
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"]["key"] for e in env if "valueFrom" in e}
    assert refs == {"ROOT_USER": "accessKey", "ROOT_PASSWORD": "secretKey", "ENGINE_ACCESS_KEY": "engineAccessKey",
                    "ENGINE_SECRET_KEY": "engineSecretKey"}
    assert boot["readinessProbe"]["exec"]["command"] == ["test", "-f", "/tmp/mc/bootstrapped"]
    assert containers(rendered())["minio"]["image"] != boot["image"] == GOLDEN_SETTINGS.minio_client_image


def _policy_and_lifecycle(manifests) -> tuple[dict, dict, int]:
    env = {e["name"]: e.get("value") for e in containers(manifests)["bootstrap"]["env"]}
    return json.loads(env["ENGINE_POLICY_JSON"]), json.loads(env["LIFECYCLE"]), int(env["QUOTA_BYTES"])


def test_bucket_cannot_fill_its_volume():
    _, lifecycle, quota = _policy_and_lifecycle(rendered(storage="100Gi", expireDays=3))
    assert lifecycle == {"Rules": [{"ID": "kvpool-expiry", "Status": "Enabled", "Filter": {},
                                    "Expiration": {"Days": 3}}]}
    assert quota == int(100 * 2**30 * 0.9)
    _, lifecycle, _ = _policy_and_lifecycle(rendered())
    assert lifecycle["Rules"][0]["Expiration"] == {"Days": 1}  # the default


NOT_REQUESTS = {"close"}  # client methods that send nothing to S3
S3_ACTIONS = {"put_object": "s3:PutObject", "get_object": "s3:GetObject", "head_object": "s3:GetObject",
              "delete_objects": "s3:DeleteObject", "head_bucket": "s3:ListBucket", "create_bucket": "s3:CreateBucket"}


def test_engine_policy_grants_exactly_what_the_s3_tier_calls():
    source = (REPO / "connector" / "kvpool_connector" / "store" / "tiers" / "s3.py").read_text()
    calls = set(re.findall(r"self\.client\.(\w+)\(", source)) - NOT_REQUESTS
    assert calls <= set(S3_ACTIONS), f"the S3 tier makes calls this test does not know: {calls - set(S3_ACTIONS)}"
    needed = {S3_ACTIONS[c] for c in calls} - {"s3:CreateBucket"}  # create_bucket is false for managed MinIO
    policy, _, _ = _policy_and_lifecycle(rendered())
    granted = {(a, r) for st in policy["Statement"] for a in st["Action"] for r in st["Resource"]}
    assert all(st["Effect"] == "Allow" for st in policy["Statement"])
    objects = "arn:aws:s3:::kvpool/kvpool.tiered-full/*"  # <bucket>/<store namespace>/ of this pool only
    assert granted == {(a, objects) for a in needed - {"s3:ListBucket"}} | {("s3:ListBucket", "arn:aws:s3:::kvpool")}


def _fake_mc(bindir: Path, log: Path) -> None:
    """`mc` that records argv and stdin (one JSON line per call) and succeeds; `sleep` that returns."""
    bindir.mkdir()
    (bindir / "mc").write_text(f"""#!/bin/sh
stdin=""
case "$*" in *"ilm rule import"*|*"admin user add"*) stdin=$(cat);; esac
python3 -c 'import json, sys; print(json.dumps({{"argv": sys.argv[1:-1], "stdin": sys.argv[-1]}}))' \
    "$@" "$stdin" >> {log}
""")
    (bindir / "sleep").write_text("#!/bin/sh\nexit 0\n")
    for tool in ("mc", "sleep"):
        (bindir / tool).chmod(stat.S_IRWXU)


def _run_bootstrap(tmp_path: Path, manifests) -> tuple[list[dict], dict[str, str], subprocess.CompletedProcess]:
    boot = containers(manifests)["bootstrap"]
    values = {"accessKey": "kvpool-" + secrets.token_hex(6), "secretKey": secrets.token_urlsafe(32),
              "engineAccessKey": "kvpool-" + secrets.token_hex(6), "engineSecretKey": secrets.token_urlsafe(32)}
    env = {}
    for var in boot["env"]:  # resolved like the kubelet: Secret keys, then $(VAR) references
        ref = var.get("valueFrom", {}).get("secretKeyRef")
        value = values[ref["key"]] if ref else var["value"]
        env[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], value)
    log = tmp_path / "mc.log"
    _fake_mc(tmp_path / "bin", log)
    env |= {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "MC_CONFIG_DIR": str(tmp_path),
            "READY_FILE": str(tmp_path / "bootstrapped")}
    proc = subprocess.run(boot["command"], env=env, capture_output=True, text=True, timeout=60)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    return calls, values, proc


def test_bootstrap_script_creates_bucket_rules_policy_and_user_without_secrets_on_argv(tmp_path):
    manifests = rendered()
    calls, values, proc = _run_bootstrap(tmp_path, manifests)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "bootstrapped").exists()
    verbs = [" ".join(a for a in c["argv"] if not a.startswith("-"))[:40] for c in calls]
    assert [v.split(" kvpool")[0] for v in verbs] == [
        "ready", "mb", "ilm rule import", "quota set", "admin policy create", "admin user add", "admin policy attach"]
    user_add = calls[5]
    assert user_add["argv"][-1] == values["engineAccessKey"] and user_add["stdin"] == values["engineSecretKey"]
    policy, lifecycle, _ = _policy_and_lifecycle(manifests)
    assert json.loads(calls[2]["stdin"]) == lifecycle
    assert json.loads((tmp_path / "engine-policy.json").read_text()) == policy
    for secret in (values["secretKey"], values["engineSecretKey"]):
        assert not [c for c in calls if secret in " ".join(c["argv"])]  # never on a command line


def test_minio_tls():
    m = rendered(tls=True)
    pod = minio_pod(m)
    minio, boot = containers(m)["minio"], containers(m)["bootstrap"]
    assert minio["args"] == ["server", "--certs-dir", "/certs", "/data"]
    assert minio["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    tls = {v["name"]: v for v in pod["volumes"]}["tls"]["secret"]
    assert tls["secretName"] == "minio-tls" and {i["path"] for i in tls["items"]} == {"public.crt", "private.key",
                                                                                          "CAs/ca.crt"}
    env = {e["name"]: e.get("value") for e in boot["env"]}
    assert env["MC_HOST_kvpool"].startswith("https://") and env["MC_FLAGS"] == "--insecure"  # loopback only
    tier = s3_tier(m)
    assert tier["endpoint"] == "https://tiered-full-minio.kvpool.svc:9000"
    assert tier["tls_ca_file"] == "/etc/kvpool-tls/s3/ca.crt"
    dep = next(x for x in m if x["kind"] == "Deployment")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in dep["volumes"]}
    assert volumes["s3-ca"]["secret"] == {"secretName": "minio-tls", "items": [{"key": "ca.crt", "path": "ca.crt"}]}
    for manifest in m:
        kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)


def test_connector_accepts_the_s3_ca_file():
    from kvpool_connector.config import S3TierConfig

    S3TierConfig.model_validate(s3_tier(rendered(tls=True)))


def test_tls_secrets_are_checked_before_anything_is_applied():
    from kvpool_operator.render import load_pool
    from kvpool_operator.render.secretrefs import referenced_secrets

    pool = load_example("tiered-full")
    pool["spec"]["tiers"]["s3"]["managed"]["tls"] = {"secretName": "minio-tls"}
    pool["spec"]["tiers"]["redis"]["managed"]["tls"] = {"secretName": "redis-tls"}
    refs = {(r.field, r.name, r.key) for r in referenced_secrets(load_pool(pool, GOLDEN_SETTINGS))
            if r.field.startswith("spec.tiers.")}  # the example's Hugging Face token is checked too
    assert refs == {(f"spec.tiers.{tier}.managed.tls", f"{name}-tls", key)
                    for tier, name in (("redis", "redis"), ("s3", "minio")) for key in ("tls.crt", "tls.key", "ca.crt")}
