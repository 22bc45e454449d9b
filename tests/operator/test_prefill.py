"""spec.prefill (prefill/decode disaggregation): what the pool renders and its status per role.

The router's P/D arguments are run with the real vllm-router in test_router_discovery.py, the
operator end to end in test_operator_e2e.py; the CEL rules and their pydantic mirrors in
test_crd.py (INVALID)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from kvpool_connector.connector.config import ConnectorConfig
from kvpool_dev.golden import GOLDEN_SETTINGS
from kvpool_operator import policy
from kvpool_operator.render import load_pool, render
from kvpool_operator.render.common import CHECKSUM_ANNOTATION
from kvpool_operator.status import Observation, compute_status
from tests.operator.conftest import load_example

NS = "ml"
ROLE = "llm-d.ai/role"
T0 = "2026-01-01T00:00:00Z"


def children(pool: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(m["kind"], m["metadata"]["name"]): m for m in render(pool, GOLDEN_SETTINGS, NS)}


def without_prefill() -> dict[str, Any]:
    pool = load_example("tiered-pd")
    del pool["spec"]["prefill"]
    return pool


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.fixture(scope="module")
def pd() -> dict[tuple[str, str], dict[str, Any]]:
    return children(load_example("tiered-pd"))


def template(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]


def test_prefill_engines_are_the_decode_engines_with_the_prefill_role(pd):
    decode, prefill = pd[("Deployment", "tiered-pd")], pd[("Deployment", "tiered-pd-prefill")]
    assert prefill["spec"]["replicas"] == 2 and decode["spec"]["replicas"] == 4
    d, p = template(decode), template(prefill)
    assert d["metadata"]["labels"][ROLE] == "decode" and p["metadata"]["labels"][ROLE] == "prefill"
    # the same connector config, keys (hash seed, pool key), volumes and image: each role reads what
    # the other wrote
    assert p["metadata"]["annotations"][CHECKSUM_ANNOTATION] == d["metadata"]["annotations"][CHECKSUM_ANNOTATION]
    dc, pc = d["spec"]["containers"][0], p["spec"]["containers"][0]
    assert pc["env"] == dc["env"] and pc["image"] == dc["image"] and pc["volumeMounts"] == dc["volumeMounts"]
    assert p["spec"]["volumes"] == d["spec"]["volumes"]
    assert p["spec"].get("initContainers") == d["spec"].get("initContainers")  # both wait for Redis
    # the prefill's extraArgs last; its connector alone honours a request's ask for a handover
    at = dc["args"].index("--kv-transfer-config") + 1
    decode_kv, prefill_kv = json.loads(dc["args"][at]), json.loads(pc["args"][at])
    assert "handover_requests" not in decode_kv["kv_connector_extra_config"]
    assert prefill_kv["kv_connector_extra_config"].pop("handover_requests") is True
    assert prefill_kv == decode_kv
    assert pc["args"][:at] == dc["args"][:at]
    assert pc["args"][at + 1:] == [*dc["args"][at + 1:], "--max-num-batched-tokens", "16384"]
    assert "handover_requests" in ConnectorConfig.model_fields  # a key the connector reads


def test_prefill_resources_merge_over_the_engines():
    pool = load_example("tiered-pd")
    pool["spec"]["model"]["resources"] = {"requests": {"cpu": "4"}}
    pool["spec"]["prefill"]["resources"] = {"requests": {"cpu": "16"}, "limits": {"nvidia.com/gpu": 2}}
    out = children(pool)
    decode = template(out[("Deployment", "tiered-pd")])["spec"]["containers"][0]["resources"]
    prefill = template(out[("Deployment", "tiered-pd-prefill")])["spec"]["containers"][0]["resources"]
    assert decode["requests"]["cpu"] == "4" and prefill["requests"]["cpu"] == "16"
    assert prefill["requests"]["memory"] == decode["requests"]["memory"]  # the tiers' memory, both roles
    assert prefill["limits"]["nvidia.com/gpu"] == 2 and decode["limits"]["nvidia.com/gpu"] == 1


def test_the_engines_selectors_never_take_in_prefill_pods(pd):
    """The engines' Deployment selector cannot change; their Service, PodDisruptionBudget and the
    scale subresource select by it: prefill pods must match none of them."""
    prefill_labels = template(pd[("Deployment", "tiered-pd-prefill")])["metadata"]["labels"]
    decode = pd[("Deployment", "tiered-pd")]
    assert decode["spec"]["selector"] == children(without_prefill())[("Deployment", "tiered-pd")]["spec"]["selector"]
    for selector in (decode["spec"]["selector"]["matchLabels"], pd[("Service", "tiered-pd")]["spec"]["selector"],
                     pd[("PodDisruptionBudget", "tiered-pd")]["spec"]["selector"]["matchLabels"]):
        assert not matches(selector, prefill_labels)
    prefill = pd[("Deployment", "tiered-pd-prefill")]
    assert not matches(prefill["spec"]["selector"]["matchLabels"], template(decode)["metadata"]["labels"])
    assert matches(pd[("Service", "tiered-pd-prefill")]["spec"]["selector"], prefill_labels)
    assert pd[("Service", "tiered-pd-prefill")]["spec"]["type"] == "ClusterIP"
    assert pd[("PodDisruptionBudget", "tiered-pd-prefill")]["spec"]["maxUnavailable"] == 1


def test_without_prefill_nothing_changes():
    """No role label, no prefill children, the router as before: a plain pool's pods do not roll."""
    plain = children(without_prefill())
    assert ROLE not in template(plain[("Deployment", "tiered-pd")])["metadata"]["labels"]
    assert not [k for k in plain if "prefill" in k[1]]
    args = template(plain[("Deployment", "tiered-pd-router")])["spec"]["containers"][0]["args"]
    assert "--selector" in args and "--vllm-pd-disaggregation" not in args


def test_router_discovers_each_role_by_its_label(pd):
    args = template(pd[("Deployment", "tiered-pd-router")])["spec"]["containers"][0]["args"]
    assert "--vllm-pd-disaggregation" in args and "--selector" not in args  # not read in P/D mode

    def selector(flag: str) -> dict[str, str]:
        values = args[args.index(flag) + 1:]
        values = values[:next((i for i, v in enumerate(values) if v.startswith("--")), len(values))]
        return dict(v.split("=", 1) for v in values)

    prefill_sel, decode_sel = selector("--prefill-selector"), selector("--decode-selector")
    prefill_labels = template(pd[("Deployment", "tiered-pd-prefill")])["metadata"]["labels"]
    decode_labels = template(pd[("Deployment", "tiered-pd")])["metadata"]["labels"]
    assert matches(prefill_sel, prefill_labels) and not matches(prefill_sel, decode_labels)
    assert matches(decode_sel, decode_labels) and not matches(decode_sel, prefill_labels)
    other = {**prefill_labels, "app.kubernetes.io/instance": "x", "kvpool.dev/pool": "x"}  # another pool's
    assert not matches(prefill_sel, other)
    assert args[args.index("--service-discovery-namespace") + 1] == NS


def test_both_roles_reach_the_backends_and_get_the_engines_ingress_rules():
    pool = load_example("tiered-pd")
    pool["spec"]["networkPolicy"] = {"apiIngress": {"enabled": True}}
    out = children(pool)
    prefill_labels = template(out[("Deployment", "tiered-pd-prefill")])["metadata"]["labels"]
    decode_labels = template(out[("Deployment", "tiered-pd")])["metadata"]["labels"]
    peers = out[("NetworkPolicy", "tiered-pd-backends")]["spec"]["ingress"][0]["from"]
    for labels in (prefill_labels, decode_labels):
        assert any(matches(p["podSelector"]["matchLabels"], labels) for p in peers)
    engines, prefill = out[("NetworkPolicy", "tiered-pd-engines")], out[("NetworkPolicy", "tiered-pd-prefill")]
    assert prefill["spec"]["ingress"] == engines["spec"]["ingress"]  # the router and apiIngress.from
    assert matches(prefill["spec"]["podSelector"]["matchLabels"], prefill_labels)
    assert ("NetworkPolicy", "tiered-pd-prefill") not in children(load_example("tiered-pd"))


def test_a_prefill_pod_no_node_holds_names_the_prefill_resources():
    pool = load_example("tiered-pd")
    pool["spec"]["prefill"]["resources"] = {"requests": {"memory": "9Pi"}, "limits": {"memory": "9Pi"}}
    loaded = load_pool(copy.deepcopy(pool), GOLDEN_SETTINGS, NS)
    warnings = policy.size_warnings(loaded.spec, render(pool, GOLDEN_SETTINGS, NS))
    assert len(warnings) == 1 and warnings[0].startswith("spec.prefill.resources: Deployment/tiered-pd-prefill")


def dep(ready: int, replicas: int) -> dict[str, Any]:
    return {"metadata": {"generation": 1}, "status": {"replicas": replicas, "readyReplicas": ready,
                                                       "updatedReplicas": replicas, "observedGeneration": 1}}


def pd_obs(prefill: dict[str, Any] | None, **kw: Any) -> Observation:
    return Observation(generation=1, desired_replicas=4, selector="s", deployment=dep(4, 4),
                       router=dep(1, 1), router_replicas=1, prefill=prefill, prefill_replicas=2,
                       role_endpoints={"prefill": "http://p-prefill.ml.svc:8000", "decode": "http://p.ml.svc:8000"},
                       **kw)


def test_status_per_role_and_ready_waits_for_the_prefill_engines():
    waiting = compute_status(pd_obs(dep(1, 2)), T0)
    assert waiting["phase"] == "Progressing" and "prefill 1/2 ready" in waiting["conditions"][0]["message"]
    assert waiting["roles"] == {
        "prefill": {"desiredReplicas": 2, "replicas": 2, "readyReplicas": 1,
                    "endpoint": "http://p-prefill.ml.svc:8000"},
        "decode": {"desiredReplicas": 4, "replicas": 4, "readyReplicas": 4, "endpoint": "http://p.ml.svc:8000"}}
    assert compute_status(pd_obs(None), T0)["phase"] != "Ready"  # no prefill Deployment yet
    ready = compute_status(pd_obs(dep(2, 2)), T0)
    assert ready["phase"] == "Ready" and ready["conditions"][0]["message"] == (
        "4/4 engines ready, prefill 2/2 ready, router 1/1 ready")
    assert ready["roles"]["prefill"]["readyReplicas"] == 2


def test_status_drops_the_roles_when_prefill_goes():
    """A merge patch of status keeps what it does not name: roles: null removes the block once."""
    plain = Observation(generation=2, desired_replicas=4, selector="s", deployment=dep(4, 4))
    assert "roles" not in compute_status(plain, T0)
    previous = compute_status(pd_obs(dep(2, 2)), T0)
    gone = Observation(generation=2, desired_replicas=4, selector="s", deployment=dep(4, 4), previous=previous)
    assert compute_status(gone, T0)["roles"] is None


def test_a_spec_that_cannot_be_read_leaves_the_roles_as_they_were():
    """Invalid: the operator does not know the roles and touches no child, so status keeps them."""
    previous = compute_status(pd_obs(dep(2, 2)), T0)
    invalid = Observation(generation=2, desired_replicas=4, selector="s", deployment=dep(4, 4),
                          invalid="spec.prefill: needs router", previous=previous)
    assert "roles" not in compute_status(invalid, T0)
