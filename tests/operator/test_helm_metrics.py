"""The chart's monitors and dashboard fit what the operator and the connector really produce.

ServiceMonitor/PodMonitor selectors are checked against the Service and pod labels that
kvpool_operator.render gives a pool's engines; the dashboard's queries against the metrics that
a vLLM API server with the connector exports (the connector's and vLLM's own).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml

from kvpool_dev.golden import GOLDEN_SETTINGS
from kvpool_operator.render import render as render_pool
from tests.operator.chartkit import CHART, REPO, by_kind, render

EXAMPLE = REPO / "examples" / "tiered-full.yaml"
ROUTER_EXAMPLE = REPO / "examples" / "tiered-router.yaml"
DASHBOARD = json.loads((CHART / "dashboards" / "kvpool-connector.json").read_text())


@pytest.fixture(scope="module")
def engine_children() -> tuple[dict, dict]:
    pool = yaml.safe_load(EXAMPLE.read_text())
    children = render_pool(pool, GOLDEN_SETTINGS, "llm")
    deployments = [c for c in children if c["kind"] == "Deployment"]
    assert len(deployments) == 1
    service = next(c for c in children if c["kind"] == "Service" and c["metadata"]["name"] == pool["metadata"]["name"])
    return deployments[0], service


def monitor(values: dict, kind: str, name: str) -> dict:
    """The chart's `kvpool-<name>` monitor of `kind` (one for engines, one for routers)."""
    found = [d for d in by_kind(render(values), kind) if d["metadata"]["name"] == f"kvpool-{name}"]
    assert len(found) == 1, [d["metadata"]["name"] for d in by_kind(render(values), kind)]
    return found[0]


@pytest.fixture(scope="module")
def router_children() -> list[dict]:
    return render_pool(yaml.safe_load(ROUTER_EXAMPLE.read_text()), GOLDEN_SETTINGS, "llm")


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def test_pod_monitor_selects_engine_pods_and_their_metrics_port(engine_children):
    deployment, _ = engine_children
    engines_monitor = monitor({"metrics.podMonitor.enabled": True}, "PodMonitor", "engines")["spec"]
    pod = deployment["spec"]["template"]
    assert _matches(engines_monitor["selector"]["matchLabels"], pod["metadata"]["labels"])
    ports = {p.get("name") for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    assert engines_monitor["podMetricsEndpoints"][0]["port"] in ports
    # the pool label on every engine; the role label only on P/D pools' (test_prefill_monitors_...)
    assert engines_monitor["podTargetLabels"] == ["kvpool.dev/pool", "llm-d.ai/role"]
    assert "kvpool.dev/pool" in pod["metadata"]["labels"] and "llm-d.ai/role" not in pod["metadata"]["labels"]


def test_service_monitor_selects_the_engine_service_only(engine_children):
    deployment, service = engine_children
    engines_monitor = monitor({"metrics.serviceMonitor.enabled": True}, "ServiceMonitor", "engines")["spec"]
    assert _matches(engines_monitor["selector"]["matchLabels"], service["metadata"]["labels"])
    assert engines_monitor["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    others = [c for c in render_pool(yaml.safe_load(EXAMPLE.read_text()), GOLDEN_SETTINGS, "llm")
              if c["kind"] == "Service" and c is not service and c["metadata"]["name"] != service["metadata"]["name"]]
    assert others, "the example has backend Services (Redis, MinIO) that must not be scraped as engines"
    for other in others:
        assert not _matches(engines_monitor["selector"]["matchLabels"], other["metadata"]["labels"])


def test_router_monitors_select_only_router_pods_and_services(router_children):
    """vllm-router's metrics port on the routers of pools with spec.router, and nothing else."""
    pods = {c["metadata"]["name"]: c["spec"]["template"] for c in router_children if c["kind"] == "Deployment"}
    router_pod, engine_pod = pods["tiered-router-router"], pods["tiered-router"]
    spec = monitor({"metrics.podMonitor.enabled": True}, "PodMonitor", "routers")["spec"]
    assert _matches(spec["selector"]["matchLabels"], router_pod["metadata"]["labels"])
    assert not _matches(spec["selector"]["matchLabels"], engine_pod["metadata"]["labels"])
    ports = {p["name"] for c in router_pod["spec"]["containers"] for p in c.get("ports", [])}
    assert spec["podMetricsEndpoints"][0]["port"] in ports
    assert spec["podTargetLabels"] == ["kvpool.dev/pool"]
    services = {c["metadata"]["name"]: c for c in router_children if c["kind"] == "Service"}
    spec = monitor({"metrics.serviceMonitor.enabled": True}, "ServiceMonitor", "routers")["spec"]
    selected = [n for n, s in services.items() if _matches(spec["selector"]["matchLabels"], s["metadata"]["labels"])]
    assert selected == ["tiered-router-router"]
    assert spec["endpoints"][0]["port"] in {p["name"] for p in services["tiered-router-router"]["spec"]["ports"]}
    engines = monitor({"metrics.serviceMonitor.enabled": True}, "ServiceMonitor", "engines")["spec"]
    assert not _matches(engines["selector"]["matchLabels"], services["tiered-router-router"]["metadata"]["labels"])


def test_prefill_monitors_select_only_the_prefill_engines():
    """spec.prefill: the prefill engines' /metrics (their component is not the engines')."""
    children = render_pool(yaml.safe_load((REPO / "examples" / "tiered-pd.yaml").read_text()), GOLDEN_SETTINGS, "llm")
    pods = {c["metadata"]["name"]: c["spec"]["template"] for c in children if c["kind"] == "Deployment"}
    services = {c["metadata"]["name"]: c for c in children if c["kind"] == "Service"}
    spec = monitor({"metrics.podMonitor.enabled": True}, "PodMonitor", "prefill")["spec"]
    assert [n for n, p in pods.items() if _matches(spec["selector"]["matchLabels"], p["metadata"]["labels"])] == [
        "tiered-pd-prefill"]
    ports = {p["name"] for c in pods["tiered-pd-prefill"]["spec"]["containers"] for p in c.get("ports", [])}
    assert spec["podMetricsEndpoints"][0]["port"] in ports
    # each role's series carry its role (llm_d_ai_role), which each role's autoscaler queries by
    assert spec["podTargetLabels"] == ["kvpool.dev/pool", "llm-d.ai/role"]
    engines = monitor({"metrics.podMonitor.enabled": True}, "PodMonitor", "engines")["spec"]
    for name, role in (("tiered-pd-prefill", "prefill"), ("tiered-pd", "decode")):
        labels = pods[name]["metadata"]["labels"]
        assert all(labels.get(k) for k in spec["podTargetLabels"]) and labels["llm-d.ai/role"] == role
    assert engines["podTargetLabels"] == spec["podTargetLabels"]
    spec = monitor({"metrics.serviceMonitor.enabled": True}, "ServiceMonitor", "prefill")["spec"]
    selected = [n for n, s in services.items() if _matches(spec["selector"]["matchLabels"], s["metadata"]["labels"])]
    assert selected == ["tiered-pd-prefill"]
    assert spec["endpoints"][0]["port"] in {p["name"] for p in services["tiered-pd-prefill"]["spec"]["ports"]}
    engines = monitor({"metrics.podMonitor.enabled": True}, "PodMonitor", "engines")["spec"]
    assert _matches(engines["selector"]["matchLabels"], pods["tiered-pd"]["metadata"]["labels"])  # decode
    assert not _matches(engines["selector"]["matchLabels"], pods["tiered-pd-prefill"]["metadata"]["labels"])


@pytest.mark.parametrize("kind", ["PodMonitor", "ServiceMonitor"])
@pytest.mark.parametrize("name", ["engines", "routers", "prefill"])
def test_monitors_follow_the_watched_namespaces(kind, name):
    toggle = {"PodMonitor": "metrics.podMonitor.enabled", "ServiceMonitor": "metrics.serviceMonitor.enabled"}[kind]
    spec = monitor({toggle: True, "watch.namespaces": ["a", "b"]}, kind, name)["spec"]
    assert spec["namespaceSelector"] == {"matchNames": ["a", "b"]}
    spec = monitor({toggle: True}, kind, name)["spec"]
    assert spec["namespaceSelector"] == {"matchNames": ["kvpool-system"]}  # the default: the release namespace
    spec = monitor({toggle: True, "watch.allNamespaces": True}, kind, name)["spec"]
    assert spec["namespaceSelector"] == {"any": True}


def _exprs() -> list[str]:
    return [t["expr"] for p in DASHBOARD["panels"] for t in p["targets"]] + [
        v["query"]["query"] for v in DASHBOARD["templating"]["list"] if v["type"] == "query"
    ]


def _series(registry) -> set[str]:
    """Series names a registry's kvpool metrics expose (counters get _total, histograms
    _bucket...)."""
    names = set()
    for metric in registry.collect():
        if metric.name.startswith("kvpool_"):
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(metric.type, [""])
            names |= {metric.name + s for s in suffixes}
    return names


def _connector_series() -> set[str]:
    """What a vLLM API server with the connector exports: the connector's KVPoolPromMetrics,
    built as vLLM builds it (the store's series too: its stores run in the engine-core
    process, and their series reach /metrics through vLLM's connector stats). A real
    server's /metrics is checked against every panel by tests/e2e/test_metrics_dashboard.py."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvpool_connector.connector.stats import KVPoolPromMetrics

    reg = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=reg) for cls in (Counter, Gauge, Histogram)}

    class _Cfg:
        kv_transfer_config = None

    KVPoolPromMetrics(_Cfg(), types, ["model_name", "engine"], {0: ["m", "0"]})
    return _series(reg)


def test_api_server_exports_the_store_series_a_standalone_store_does():
    """One dashboard for both: the names (and so the panels) of a store that exports its
    own series are those the API server exports for the connector's stores."""
    from prometheus_client import REGISTRY

    from kvpool_connector.store.metrics import registered

    registered()
    standalone = {n for n in _series(REGISTRY) if n.startswith("kvpool_store_")}
    assert standalone and standalone <= _connector_series()


def _vllm_metric_names() -> set[str]:
    spec = importlib.util.find_spec("vllm")  # the installed package's files; importing it is slow
    assert spec is not None and spec.origin is not None
    names = set()
    for path in Path(spec.origin).parent.joinpath("v1", "metrics").rglob("*.py"):
        names |= set(re.findall(r'"(vllm:[a-z_]+)"', path.read_text()))
    return names


def _metric_part(expr: str) -> str:
    """The expression without label matchers, grouping clauses and label_values' label argument."""
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\b(by|without)\s*\([^)]*\)", "", expr)
    return re.sub(r"label_values\(([^,]+),[^)]*\)", r"\1", expr)


def test_dashboard_uses_only_real_metrics():
    series = _connector_series()
    vllm_names = _vllm_metric_names()
    used = {m for e in _exprs() for m in re.findall(r"\b((?:kvpool_|vllm:)[a-z_:]+)", _metric_part(e))}
    assert any(u.startswith("kvpool_") for u in used) and any(u.startswith("vllm:") for u in used)
    for name in used:
        if name.startswith("kvpool_"):
            assert name in series, f"{name} is not exported by a server with the connector ({sorted(series)})"
        else:
            base = re.sub(r"_(total|bucket|sum|count)$", "", name)
            assert base in vllm_names, f"{name} is not a vLLM metric"


def test_dashboard_shows_hits_bytes_latency_drops_and_corruption_per_tier_and_pool():
    titles = " ".join(p["title"].lower() for p in DASHBOARD["panels"])
    for topic in ("hit rate per tier", "bytes moved", "load latency", "drops", "corrupt"):
        assert topic in titles
    from kvpool_connector.store.metrics import EVENTS

    events = {m for e in _exprs() for m in re.findall(r'event=~?"([a-z_|]+)"', e) for m in m.split("|")}
    assert events <= set(EVENTS), events - set(EVENTS)
    assert {"hits", "misses", "drops", "corrupt"} <= events
    pool_label = "kvpool_dev_pool"  # podTargetLabels kvpool.dev/pool, sanitised by Prometheus
    assert monitor({"metrics.podMonitor.enabled": True}, "PodMonitor", "engines")["spec"]["podTargetLabels"][0] == (
        "kvpool.dev/pool")
    assert all(pool_label in e for p in DASHBOARD["panels"] for e in (t["expr"] for t in p["targets"]))
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
