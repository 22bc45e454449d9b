"""examples/admission/: the sample ValidatingAdmissionPolicy is a valid Kubernetes object and its
CEL rules (evaluated with cel-python on pools defaulted like the API server does) refuse exactly
what it says."""

from __future__ import annotations

import copy
from pathlib import Path

import celpy
import kubernetes_validate
import pytest
import yaml

from tests.operator.conftest import K8S_VERSION, load_example
from tests.operator.schema_check import apply_defaults, pool_schema

POLICY_FILE = Path(__file__).resolve().parents[2] / "examples" / "admission" / "kvcachepool-guardrails.yaml"
DOCS = [d for d in yaml.safe_load_all(POLICY_FILE.read_text()) if d]


def denials(pool: dict) -> list[str]:
    """Messages of the validations that deny `pool` (CREATE), as the API server would evaluate them."""
    policy = next(d for d in DOCS if d["kind"] == "ValidatingAdmissionPolicy")
    obj = celpy.json_to_cel(apply_defaults(pool_schema(), pool))
    env = celpy.Environment()
    out = []
    for validation in policy["spec"]["validations"]:
        result = env.program(env.compile(validation["expression"])).evaluate({"object": obj})
        assert not isinstance(result, Exception), (validation["expression"], result)
        if not result:
            out.append(validation["message"])
    return out


def trusted_looking_pool() -> dict:
    pool = load_example("tiered-emptydir")
    pool["spec"]["service"] = {"apiKeySecretRef": {"name": "llm-api", "key": "token"}}
    return pool


def test_policy_and_binding_are_valid_kubernetes_objects():
    assert [d["kind"] for d in DOCS] == ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    for doc in DOCS:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    binding = DOCS[1]["spec"]
    assert binding["policyName"] == DOCS[0]["metadata"]["name"] and binding["validationActions"] == ["Deny"]


def test_a_pool_within_the_guardrails_is_admitted():
    assert denials(trusted_looking_pool()) == []
    pool = trusted_looking_pool()
    pool["spec"]["model"]["image"] = "registry.example/kvpool-vllm@sha256:" + "c" * 64
    assert denials(pool) == []
    pool["spec"]["router"] = {}  # the operator's default router image
    assert denials(pool) == []
    pool["spec"]["router"] = {"image": "registry.example/kvpool-router:1"}
    assert denials(pool) == []


@pytest.mark.parametrize(("change", "message"), [
    (lambda p: p["spec"]["tiers"]["disk"].update(volume={"hostPath": {"path": "/mnt/nvme0"}}), "hostPath"),
    (lambda p: p["spec"]["model"].update(volume={"hostPath": {"path": "/srv/models"}}), "model.volume.hostPath"),
    (lambda p: p["spec"]["tiers"].update(redis={"external": {"url": "rediss://r:6380/0"}}), "external Redis/S3"),
    (lambda p: p["spec"]["tiers"].update(s3={"external": {"endpoint": "https://s3.example", "bucket": "kvb"}}),
     "external Redis/S3"),
    (lambda p: p["spec"]["model"].update(image="docker.io/someone/vllm:latest"), "images"),
    (lambda p: p["spec"]["tiers"].update(redis={"managed": {"memory": "1Gi", "image": "redis:7"}}), "images"),
    (lambda p: p["spec"].update(router={"image": "docker.io/someone/router:latest"}), "images"),
    (lambda p: p["spec"].pop("service"), "apiKeySecretRef"),
], ids=["hostPath", "model-hostPath", "external-redis", "external-s3", "model-image", "redis-image", "router-image",
        "no-api-key"])
def test_what_the_guardrails_refuse(change, message):
    pool = copy.deepcopy(trusted_looking_pool())
    change(pool)
    (denied,) = denials(pool)
    assert message in denied


def test_the_examples_that_need_trust():
    assert any("hostPath" in m for m in denials(load_example("tiered-full")))
    assert any("external" in m for m in denials(load_example("tiered-external")))
