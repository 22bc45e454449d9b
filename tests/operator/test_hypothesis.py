"""Property tests: the pydantic model and the CRD (OpenAPI + CEL) agree on every random spec;
accepted specs always render to manifests valid for Kubernetes; rejected ones name the field; a
secret written into a spec (a URL with credentials) never reaches a rendered object or status."""

from __future__ import annotations

import yaml
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

from kvpool_connector.connector.config import load_connector_config
from kvpool_operator.render import InvalidPool, render
from kvpool_operator.settings import Settings
from tests.operator.schema_check import api_server_errors, validate_child
from tests.operator.secret_leaks import SENTINEL, assert_no_secret_values

SETTINGS = Settings(allowed_host_path_prefixes=("/mnt",), inference_pools=True, keda=True)  # what the specs may ask
SIZES = st.sampled_from(["1Gi", "64Gi", "500G", "1.5Ti", "10", "0Gi", "0.0", "-1Gi", "1e3",
                         "1.5", "0.3Ki", "1.0000001k", "0.5Ki"])  # the middle three: fractions of a byte
VOLUMES = st.fixed_dictionaries({}, optional={
    "hostPath": st.just({"path": "/mnt/nvme0"}),
    "emptyDir": st.sampled_from([{}, {"medium": "Memory"}]),
    "ephemeral": st.sampled_from([{}, {"storageClassName": "local-nvme"}]),
    "persistentVolumeClaim": st.just({"claimName": "shared"}),
})
REDIS = st.fixed_dictionaries({}, optional={
    "managed": st.builds(lambda m: {"memory": m}, SIZES),
    "external": st.sampled_from([{"url": "redis://r:6379/0"},
                                 {"url": "rediss://r:6380/0", "passwordSecretRef": {"name": "r", "key": "p"}},
                                 {"url": "rediss://r:6380/0?ssl_cert_reqs=required", "username": "kv"},
                                 {"url": f"redis://:{SENTINEL}@r:6379/0"},
                                 {"url": f"rediss://kv:{SENTINEL}@r:6380/0"},
                                 {"url": "redis://kv@r:6379/0"},
                                 {"url": f"redis://r:6379/0?Password={SENTINEL}"},
                                 {"url": f"redis://r:6379/0?db=1&username={SENTINEL}"},
                                 {"url": f"redis://r:6379/0?%70assword={SENTINEL}"},
                                 {"url": "redis://r:6379?db=2"},
                                 {"url": "redis://r:6379", "cluster": True},
                                 {"url": "rediss://r:6380/0", "cluster": True},
                                 {"url": "redis://r:6379/1", "cluster": True},
                                 {"url": "redis://r:6379/0/x", "cluster": True}]),
})
S3 = st.fixed_dictionaries({}, optional={
    "managed": st.builds(lambda s: {"storage": s, "storageClassName": "fast"}, SIZES),
    "external": st.sampled_from([{"endpoint": "https://s3.example", "bucket": "kvb"},
                                 {"endpoint": "http://minio:9000", "bucket": "kvb", "pathStyle": True,
                                  "credentialsSecretRef": {"name": "c"}},
                                 {"endpoint": f"https://AKIA:{SENTINEL}@s3.example", "bucket": "kvb"},
                                 {"endpoint": f"https://s3.example/?password={SENTINEL}", "bucket": "kvb"}]),
})
TIERS = st.fixed_dictionaries({}, optional={
    "cpu": st.builds(lambda s, e: {"size": s, "evictionPolicy": e}, SIZES, st.sampled_from(["lru", "arc"])),
    "disk": st.builds(lambda s, v: {"size": s, "volume": v}, SIZES, VOLUMES),
    "redis": REDIS,
    "s3": S3,
})
SPECS = st.fixed_dictionaries(
    {
        "model": st.builds(
            lambda g, tp, args: {"name": "org/model", "gpus": g, "tensorParallelSize": tp, "extraArgs": args},
            st.integers(0, 8),
            st.integers(1, 8),
            st.lists(
                st.sampled_from(["--enforce-eager", "--seed=1", f"--api-key={SENTINEL}", "--hf-token"]), max_size=2
            ),
        ),
        "tiers": TIERS,
    },
    optional={
        "replicas": st.integers(0, 5),
        "connector": st.sampled_from(["tiered", "native"]),
        "chunkTokens": st.sampled_from([16, 256, 100, 4096]),
        "native": st.builds(lambda b: {"kvpoolSecondaryTier": b}, st.booleans()),
        "networkPolicy": st.builds(
            lambda b, api: {"enabled": b, "apiIngress": api},
            st.booleans(),
            st.sampled_from(
                [
                    {},
                    {"enabled": True},
                    {
                        "enabled": True,
                        "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}],
                    },
                ]
            ),
        ),
        "service": st.sampled_from(
            [{}, {"type": "LoadBalancer", "port": 80}, {"apiKeySecretRef": {"name": "api", "key": "key"}}]
        ),
        "scheduling": st.just(
            {"nodeSelector": {"gpu": "h100"}, "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]}
        ),
        "router": st.fixed_dictionaries(
            {},
            optional={
                "policy": st.sampled_from(["cache_aware", "consistent_hash", "power_of_two", "round_robin", "random"]),
                "replicas": st.integers(-1, 17),
                "cacheThreshold": st.sampled_from([0, 0.5, 1, 1.5]),
                "balanceRelThreshold": st.sampled_from([0.5, 1, 2]),
                "image": st.sampled_from(["", "reg/router:1", "reg/router@sha256:" + "c" * 64, "bad image"]),
            },
        ),
        "inferencePool": st.fixed_dictionaries(
            {"enabled": st.booleans()},
            optional={
                "endpointPickerRef": st.sampled_from(
                    [
                        {"name": "epp", "port": {"number": 9002}},
                        {"name": "epp"},
                        {"name": "epp", "kind": "Backend", "group": "example.io"},
                        {"name": "epp", "port": {"number": 0}},
                        {"name": "epp", "port": {"number": 9002}, "failureMode": "FailOpen"},
                        {"name": "", "port": {"number": 9002}},
                    ]
                ),
            },
        ),
        "prefill": st.fixed_dictionaries(
            {},
            optional={
                "replicas": st.integers(0, 3),
                "extraArgs": st.lists(st.sampled_from(["--max-num-batched-tokens=8192", f"--api-key={SENTINEL}"]),
                                      max_size=1),
                "resources": st.just({"requests": {"cpu": "8"}}),
            },
        ),
        "autoscaling": st.fixed_dictionaries(
            {"maxReplicas": st.integers(0, 9)},
            optional={
                "minReplicas": st.integers(-1, 9),
                "triggers": st.fixed_dictionaries({}, optional={
                    "waitingRequests": st.sampled_from([0, 0.0005, 3, 2000.5]),
                    "kvCacheUsage": st.sampled_from([0.001, 0.7, 1, 1.5]),
                    "promptTokensComputed": st.sampled_from([1500, -1]),
                }),
                "rateWindow": st.sampled_from(["2m", "30s", "0m", "1d", "2 m"]),
                "scaleDownStabilizationSeconds": st.sampled_from([0, 300, 3601]),
            },
        ),
        "kvEvents": st.fixed_dictionaries(
            {"enabled": st.booleans()},
            optional={
                "port": st.sampled_from([5557, 8000, 80, 6000]),
                "from": st.just([{"podSelector": {"matchLabels": {"app": "epp"}}}]),
            },
        ),
    },
)


def pool(spec):
    return {"apiVersion": "kvpool.dev/v1alpha1", "kind": "KVCachePool",
            "metadata": {"name": "prop", "namespace": "ns"}, "spec": spec}


@hsettings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(SPECS)
def test_model_and_crd_agree_and_accepted_specs_render_valid_manifests(spec):
    obj = pool(spec)
    server_errors = api_server_errors(obj)
    try:
        manifests = render(obj, SETTINGS)
    except InvalidPool as exc:
        message = str(exc)
        assert message.startswith(("spec.", "spec:", "metadata.")), message  # names the field
        assert server_errors, f"model rejects but the CRD accepts: {message}"
        return
    assert not server_errors, f"CRD rejects but the model accepts: {server_errors}"
    kinds = [m["kind"] for m in manifests]
    workloads = 1 + ("router" in spec) + ("prefill" in spec)  # engines, router, prefill engines: each a Service
    assert kinds.count("Deployment") == workloads and kinds.count("Service") == workloads + sum(
        m["kind"] == "StatefulSet" for m in manifests)
    assert kinds.count("InferencePool") == int(spec.get("inferencePool", {}).get("enabled", False))
    assert kinds.count("ScaledObject") == int("autoscaling" in spec)  # SETTINGS say KEDA is installed
    for manifest in manifests:
        validate_child(manifest)
    assert_no_secret_values(obj, manifests, SETTINGS)
    assert_connector_accepts(manifests)


def assert_connector_accepts(manifests):
    """What the CRD accepts, the connector accepts: the rendered config file loads with the
    connector's own loader (sizes, URLs, keys and all)."""
    data = next(m for m in manifests if m["kind"] == "ConfigMap")["data"]
    if "connector.yaml" in data:
        load_connector_config(yaml.safe_load(data["connector.yaml"]))
