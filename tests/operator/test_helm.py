"""The kvpool chart rendered and linted by the real helm binary.

Every scenario (default values, each optional toggle, namespaced mode, peering) renders manifests
that validate against the Kubernetes OpenAPI schemas (kubernetes-validate, newest version it
ships, strict: unknown fields fail). Kinds defined by CRDs are not in those schemas: KVCachePool
is checked against the generated CRD schema and the operator's pydantic model, the kopf peering
objects against the peering CRD the chart ships, and Prometheus Operator monitors against the
subset of their CRD schema the chart uses (MONITOR_SCHEMA below; the full CRD is not available
offline).
"""

from __future__ import annotations

import json
import re

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvpool_operator.settings import Settings
from tests.operator.chartkit import (
    CHART,
    CRD_KINDS,
    by_kind,
    chart_values,
    helm,
    one,
    render,
    set_args,
    values_schema,
)

K8S_VERSION = kubernetes_validate.latest_version()
NS = "kvpool-system"

SCENARIOS: dict[str, dict] = {
    "default": {},
    "namespaced": {"watch.namespaces": ["team-a", "team-b"]},
    "cluster-wide": {"watch.allNamespaces": True},
    "peering": {"replicaCount": 3},
    "peering-namespaced": {"replicaCount": 2, "watch.namespaces": ["team-a"]},
    "service-monitor": {"metrics.serviceMonitor.enabled": True, "metrics.serviceMonitor.labels": {"release": "prom"}},
    "pod-monitor": {"metrics.podMonitor.enabled": True},
    "dashboard": {"dashboards.grafana.enabled": True},
    "example-pool": {"examplePool.enabled": True},
    "no-crds": {"crds.install": False},
    "crds-not-kept": {"crds.keep": False},
    "existing-service-account": {"serviceAccount.create": False, "serviceAccount.name": "ops", "rbac.create": False},
    "everything": {
        "replicaCount": 2,
        "watch.namespaces": ["team-a", "kvpool-system"],
        "metrics.serviceMonitor.enabled": True,
        "metrics.podMonitor.enabled": True,
        "dashboards.grafana.enabled": True,
        "examplePool.enabled": True,
        "operator.logLevel": "debug",
        "operator.settings": {
            "connectorImage": "registry.example/kvpool-vllm:1.2.3",
            "redisImage": "redis:7.4.2",
            "minioImage": "minio/minio:latest",
            "minioClientImage": "registry.example/mc@sha256:" + "b" * 64,
            "imagePullPolicy": "Always",
            "reconcileInterval": 120,
            "retryDelay": 15.5,
            "backendWaitSeconds": 0,
            "allowedHostPathPrefixes": ["/mnt/nvme0", "/mnt/nvme1"],
            "allowedImagePrefixes": ["registry.example/", "redis:"],
            "allowExternalBackends": False,
            "engineUidFirst": 2000,
            "engineUidCount": 2001,
            "engineFsGroup": 2002,
        },
        "operator.extraEnv": [{"name": "EXTRA", "value": "1"}],
        "operator.extraArgs": ["--debug"],
        "image.digest": "sha256:" + "a" * 64,
        "imagePullSecrets": [{"name": "pull"}],
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ops", "effect": "NoSchedule"}],
        "priorityClassName": "system-cluster-critical",
        "podAnnotations": {"a": "b"},
        "podLabels": {"team": "ml"},
    },
}

# Prometheus Operator monitoring.coreos.com/v1 fields the chart sets (a subset of the CRD schema,
# with the same names and types; additionalProperties false so a typo fails).
_ENDPOINT = {
    "type": "object",
    "additionalProperties": False,
    "required": ["port"],
    "properties": {
        "port": {"type": "string"},
        "path": {"type": "string", "pattern": "^/"},
        "interval": {
            "type": "string",
            "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
        },
    },
}
MONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"enum": ["ServiceMonitor", "PodMonitor"]},
        "metadata": {"type": "object", "required": ["name", "namespace"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector"],
            "properties": {
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}},
                },
                "endpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT},
                "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT},
            },
        },
    },
}


def _crd_schema(docs: list[dict], group: str, kind: str) -> dict:
    for doc in docs:
        if (
            doc["kind"] == "CustomResourceDefinition"
            and doc["spec"]["group"] == group
            and doc["spec"]["names"]["kind"] == kind
        ):
            return doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    raise AssertionError(f"no CRD for {group}/{kind} in the rendered chart")


def _validate_custom(doc: dict, docs: list[dict]) -> None:
    kind = doc["kind"]
    if kind in ("ServiceMonitor", "PodMonitor"):
        jsonschema.validate(doc, MONITOR_SCHEMA)
    elif kind in ("KopfPeering", "ClusterKopfPeering"):
        jsonschema.validate(doc, _crd_schema(docs, "kopf.dev", kind))
    elif kind == "KVCachePool":
        from kvpool_operator import models

        models.KVCachePoolSpec.model_validate(doc["spec"])
        crd = yaml.safe_load(next((CHART / "files" / "crds").glob("*.yaml")).read_text())
        jsonschema.validate(doc, crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    else:  # pragma: no cover - a new CRD kind needs a validation here
        raise AssertionError(f"no validation for custom kind {kind}")


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_rendered_manifests_validate(scenario):
    docs = render(SCENARIOS[scenario])
    assert docs
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
            _validate_custom(doc, docs)
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("values", [{}, SCENARIOS["everything"]], ids=["default", "everything"])
@pytest.mark.parametrize("strict", [False, True], ids=["lint", "lint-strict"])
def test_helm_lint_clean(values, strict, tmp_path):
    values_file = tmp_path / "values.yaml"
    nested: dict = {}
    for dotted, value in values.items():
        node = nested
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    values_file.write_text(yaml.safe_dump(nested))
    out = helm("lint", str(CHART), "-f", str(values_file), *(["--strict"] if strict else [])).stdout
    assert "0 chart(s) failed" in out
    assert "[WARNING]" not in out and "[ERROR]" not in out, out


def _names(docs: list[dict]) -> set[tuple[str, str]]:
    return {(d["kind"], d["metadata"]["name"]) for d in docs}


@pytest.mark.parametrize(
    ("values", "added", "removed"),
    [
        (
            {"metrics.serviceMonitor.enabled": True},
            {("ServiceMonitor", "kvpool-engines"), ("ServiceMonitor", "kvpool-routers"),
             ("ServiceMonitor", "kvpool-prefill")},
            set(),
        ),
        (
            {"metrics.podMonitor.enabled": True},
            {("PodMonitor", "kvpool-engines"), ("PodMonitor", "kvpool-routers"), ("PodMonitor", "kvpool-prefill")},
            set(),
        ),
        ({"dashboards.grafana.enabled": True}, {("ConfigMap", "kvpool-dashboard")}, set()),
        ({"examplePool.enabled": True}, {("KVCachePool", "example")}, set()),
        (
            {"replicaCount": 2},
            {("CustomResourceDefinition", "kopfpeerings.kopf.dev"), ("KopfPeering", "kvpool-operator")},
            set(),
        ),
        ({"replicaCount": 2, "operator.peering.installCRDs": False}, {("KopfPeering", "kvpool-operator")}, set()),
        ({"crds.install": False}, set(), {("CustomResourceDefinition", "kvcachepools.kvpool.dev")}),
    ],
    ids=["servicemonitor", "podmonitor", "dashboard", "example-pool", "peering", "peering-no-crd", "no-crds"],
)
def test_each_toggle_adds_exactly_its_objects(values, added, removed):
    base = _names(render())
    toggled = _names(render(values))
    assert toggled - base == added
    assert base - toggled == removed


def test_default_is_one_replica_recreate_watching_the_release_namespace_standalone():
    """Least privilege by default: the operator watches (and holds its verbs in) the release
    namespace only; every other namespace is opted in by name, all of them by watch.allNamespaces."""
    docs = render(namespace="ml-serving")
    dep = one(docs, "Deployment")
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith("--namespace")] == ["--namespace=ml-serving"]
    assert "--all-namespaces" not in args
    assert not [a for a in args if a.startswith("--peering")], "no --peering: kopf standalone"
    assert [(r["metadata"]["namespace"]) for r in by_kind(docs, "Role")] == ["ml-serving"]


def test_cluster_wide_is_opt_in_and_excludes_a_namespace_list():
    args = one(render({"watch.allNamespaces": True}), "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--all-namespaces" in args and not [a for a in args if a.startswith("--namespace")]
    assert not by_kind(render({"watch.allNamespaces": True}), "Role")
    proc = helm("template", "kvpool", str(CHART), *set_args({"watch.allNamespaces": True, "watch.namespaces": ["a"]}),
                check=False)
    assert proc.returncode != 0 and "/watch/namespaces" in proc.stderr, proc.stderr


def test_more_replicas_use_peering_and_rolling_update():
    dep = one(render({"replicaCount": 3}), "Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--peering=kvpool-operator" in args
    assert dep["spec"]["strategy"]["type"] == "RollingUpdate"
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0


def test_namespaced_mode_watches_the_listed_namespaces():
    docs = render({"watch.namespaces": ["team-a", "team-b"], "replicaCount": 2})
    args = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith("--namespace")] == ["--namespace=team-a", "--namespace=team-b"]
    assert "--all-namespaces" not in args
    peerings = by_kind(docs, "KopfPeering")
    assert sorted(p["metadata"]["namespace"] for p in peerings) == ["team-a", "team-b"]
    assert not by_kind(docs, "ClusterKopfPeering")


def test_operator_pod_is_locked_down():
    pod = one(render(), "Deployment")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    liveness = [a for a in container["args"] if a.startswith("--liveness=")]
    assert liveness == ["--liveness=http://0.0.0.0:8080/healthz"]


def _env(docs: list[dict]) -> dict[str, str]:
    container = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value") for e in container["env"] if "value" in e}


def test_settings_reach_the_operator_as_it_reads_them():
    """The rendered env, fed to the operator's own Settings.from_env, gives back the chart values."""
    settings = Settings.from_env(_env(render(SCENARIOS["everything"])))
    assert settings.connector_image == "registry.example/kvpool-vllm:1.2.3"
    assert settings.redis_image == "redis:7.4.2"
    assert settings.minio_image == "minio/minio:latest"
    assert settings.minio_client_image == "registry.example/mc@sha256:" + "b" * 64
    assert settings.image_pull_policy == "Always"
    assert settings.reconcile_interval == 120
    assert settings.retry_delay == 15.5
    assert settings.backend_wait_seconds == 0
    assert settings.allowed_host_path_prefixes == ("/mnt/nvme0", "/mnt/nvme1")
    assert settings.allowed_image_prefixes == ("registry.example/", "redis:")
    assert settings.allow_external_backends is False
    assert (settings.engine_uid_first, settings.engine_uid_count, settings.engine_fs_group) == (2000, 2001, 2002)
    assert settings.namespaces == ("team-a", "kvpool-system")
    assert settings.log_format == "json"


def test_default_values_keep_the_operator_defaults():
    env = _env(render())
    settings = Settings.from_env(env)
    defaults = Settings()
    chart_set = {"log_format", "namespaces", "router_discovery_role"}  # the chart's own, checked below
    assert settings.model_dump(exclude=chart_set) == defaults.model_dump(exclude=chart_set)
    assert settings.namespaces == ("kvpool-system",)  # the release namespace
    assert settings.router_discovery_role == "kvpool-router-discovery"  # the ClusterRole templates/rbac.yaml ships
    assert set(env) == {"KVPOOL_NAMESPACES", "KVPOOL_LOG_FORMAT", "KVPOOL_ROUTER_DISCOVERY_ROLE"}


def test_every_operator_setting_has_a_chart_value():
    """A new field in kvpool_operator.settings fails here until the chart can pass it."""
    chart_keys = {re.sub(r"(?<!^)(?=[A-Z])", "_", k).lower() for k in chart_values()["operator"]["settings"]}
    assert chart_keys | {"namespaces", "log_format", "router_discovery_role"} == set(Settings.model_fields)


def test_no_hard_coded_namespace_and_no_lookup():
    docs = render(SCENARIOS["everything"], namespace="somewhere-else")
    watched = set(SCENARIOS["everything"]["watch.namespaces"])
    for doc in docs:
        ns = doc["metadata"].get("namespace")
        if doc["kind"] in ("Role", "RoleBinding", "KopfPeering"):
            assert ns in watched
        elif doc["kind"] in ("CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding", "ClusterKopfPeering"):
            assert ns is None
        else:
            assert ns == "somewhere-else", doc["kind"]
    for template in (CHART / "templates").iterdir():
        text = template.read_text()
        assert not re.search(r"{{[^}]*\blookup\b", text), f"{template.name} uses lookup (Argo CD cannot run it)"
        assert "kvpool-system" not in text and "namespace: default" not in text


def test_values_yaml_matches_its_schema():
    schema = values_schema()
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.Draft7Validator(schema).validate(chart_values())


@pytest.mark.parametrize(
    ("values", "field", "why"),
    [
        ({"replicaCount": 0}, "/replicaCount", "minimum"),
        ({"replicaCount": "2"}, "/replicaCount", "string"),
        ({"operator.logFormat": "xml"}, "/operator/logFormat", "plain"),
        ({"operator.logLevel": "quiet"}, "/operator/logLevel", "debug"),
        ({"watch.namespaces": ["Team_A"]}, "/watch/namespaces/0", "Team_A"),
        ({"image.pullPolicy": "Sometimes"}, "/image/pullPolicy", "IfNotPresent"),
        ({"image.digest": "latest"}, "/image/digest", "latest"),
        ({"operator.settings.reconcileInterval": 0}, "/operator/settings/reconcileInterval", "exclusiveMinimum"),
        ({"operator.settings.connectorImage": "has space"}, "/operator/settings/connectorImage", "has space"),
        ({"operator.settings.connectorImage": "r/vllm@sha256:abc"}, "/operator/settings/connectorImage", "sha256:abc"),
        ({"operator.settings.allowedHostPathPrefixes": ["/mnt/../etc"]}, "/operator/settings/allowedHostPathPrefixes/0",
         "'not' failed"),
        ({"operator.settings.allowedHostPathPrefixes": ["relative"]}, "/operator/settings/allowedHostPathPrefixes/0",
         "relative"),
        ({"operator.settings.engineUidFirst": 0}, "/operator/settings/engineUidFirst", "minimum"),
        ({"operator.settings.bogus": 1}, "/operator/settings", "bogus"),
        ({"metrics.interval": "30 seconds"}, "/metrics/interval", "30 seconds"),
        ({"crds.install": "yes"}, "/crds/install", "boolean"),
        ({"examplePool.name": "Example"}, "/examplePool/name", "Example"),
        ({"imagee": {"tag": "1"}}, "", "imagee"),
    ],
)
def test_bad_values_fail_at_install_naming_the_field(values, field, why):
    """values.schema.json makes `helm install` (and template/upgrade) refuse bad values."""
    proc = helm("install", "kvpool", str(CHART), "--dry-run=client", "--namespace", NS, *set_args(values), check=False)
    assert proc.returncode != 0
    assert "values don't meet the specifications of the schema" in proc.stderr
    assert f"at '{field}'" in proc.stderr and why in proc.stderr, proc.stderr


def test_good_values_install_dry_run_and_print_notes():
    proc = helm(
        "install",
        "kvpool",
        str(CHART),
        "--dry-run=client",
        "--namespace",
        NS,
        *set_args({"watch.namespaces": ["team-a"]}),
    )
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert "rollout status deployment/kvpool" in notes
    assert "team-a" in notes and 'release namespace "kvpool-system" is not watched' in notes
    assert "kubectl wait --for=condition=Ready kvp/" in notes


def test_example_pool_is_a_post_install_hook():
    pool = one(render({"examplePool.enabled": True}, namespace="demo"), "KVCachePool")
    assert pool["metadata"]["namespace"] == "demo"
    assert pool["metadata"]["annotations"]["helm.sh/hook"] == "post-install"
    assert "helm.sh/hook-delete-policy" not in pool["metadata"]["annotations"], "re-creating it would restart the fleet"


def test_dashboard_configmap_carries_the_dashboard_json():
    cm = one(render({"dashboards.grafana.enabled": True}), "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["kvpool-connector.json"])
    assert dashboard == json.loads((CHART / "dashboards" / "kvpool-connector.json").read_text())


@pytest.mark.parametrize("scenario", ["default", "namespaced", "peering", "everything"])
def test_rendered_args_are_accepted_by_kvpool_operator_run(scenario, monkeypatch):
    """The image's entrypoint is `kvpool-operator run`; the chart's args go through its real parser."""
    from kvpool_operator import cli

    seen = {}
    monkeypatch.setattr(cli, "_run", lambda args: seen.setdefault("args", args) and 0)
    values = dict(SCENARIOS[scenario])
    values.pop("operator.extraArgs", None)  # user-supplied; not the chart's contract
    container = one(render(values), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert cli.main(["run", *container["args"]]) == 0
    args = seen["args"]
    cluster_wide = values.get("watch.allNamespaces", False)
    watched = [] if cluster_wide else values.get("watch.namespaces") or [NS]
    assert (args.namespace or []) == watched
    assert args.all_namespaces is cluster_wide
    assert args.liveness == "http://0.0.0.0:8080/healthz"
    assert args.peering == ("kvpool-operator" if values.get("replicaCount", 1) > 1 else None)
    assert args.verbose is (values.get("operator.logLevel") == "debug")


def test_docs_cover_every_value_and_the_two_sections():
    docs = (CHART.parents[1] / "docs" / "helm.md").read_text()
    assert "## Install with Helm" in docs and "## Manage with Argo CD / Flux" in docs
    values = chart_values()
    for key in values:
        assert f"`{key}" in docs, f"values key {key} is not documented in docs/helm.md"
    for key in values["operator"]["settings"]:
        assert f"`{key}`" in docs, f"operator.settings.{key} is not documented"


def test_packaged_chart_renders_like_the_source_tree(tmp_path):
    """`helm package` (what a chart repository serves) keeps every file the templates read."""
    helm("package", str(CHART), "-d", str(tmp_path))
    (tgz,) = tmp_path.glob("kvpool-*.tgz")
    values = SCENARIOS["everything"]
    packaged = helm("template", "kvpool", str(tgz), "--namespace", NS, *set_args(values)).stdout
    assert [d for d in yaml.safe_load_all(packaged) if d] == render(values)
    listing = helm("show", "chart", str(tgz)).stdout
    assert "name: kvpool" in listing


def test_values_comments_state_the_operator_defaults():
    """values.yaml says which default an empty setting keeps; that must be the operator's."""
    import kvpool_operator

    text = (CHART / "values.yaml").read_text()
    defaults = Settings()
    for key in chart_values()["operator"]["settings"]:
        block = re.search(rf"((?:\n    # [^\n]*)+)\n    {key}:", text)
        assert block, f"operator.settings.{key} has no comment"
        said = re.search(r"Default (\S+?)\.?(?:\s|$)", block.group(1).replace("\n    #", " "))
        assert said, f"operator.settings.{key}: comment does not state the default"
        stated = said.group(1).strip('"').replace("<version>", kvpool_operator.__version__)
        field = re.sub(r"(?<!^)(?=[A-Z])", "_", key).lower()
        actual = getattr(defaults, field)
        if isinstance(actual, tuple):
            assert stated == json.dumps(list(actual)), key
        elif isinstance(actual, bool):
            assert stated == str(actual).lower(), key
        elif isinstance(actual, (int, float)):
            assert float(stated) == float(actual), key
        else:
            assert stated == str(actual), key
