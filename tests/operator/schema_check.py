"""Check pools the way the API server would: structural-schema defaulting, OpenAPI validation,
then every `x-kubernetes-validations` CEL rule (evaluated with cel-python); and every child the
operator renders against its schema (`validate_child`)."""

from __future__ import annotations

import copy
from functools import cache
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import kubernetes_validate
import yaml
from kubernetes_validate.utils import latest_version

from kvpool_operator.crd import build_crd
from tests.operator import inferencepool_schema

K8S_VERSION = latest_version()  # the newest schema kubernetes-validate ships (offline)


# KEDA's own CRD at a pinned release (the file's header names it), and what its Prometheus scaler
# reads from a trigger's metadata at that release (pkg/scalers/prometheus_scaler.go, prometheusMetadata).
KEDA_CRD = Path(__file__).parent / "crds" / "keda.sh_scaledobjects.yaml"
KEDA_PROMETHEUS_REQUIRED = {"serverAddress", "query", "threshold"}
KEDA_PROMETHEUS_OPTIONAL = {"queryParameters", "activationThreshold", "namespace", "customHeaders", "ignoreNullValues",
                            "unsafeSsl", "awsRegion", "timeout", "identityOwner"}


@cache
def keda_schema() -> dict[str, Any]:
    crd = yaml.safe_load(KEDA_CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["storage"]]
    return version["schema"]["openAPIV3Schema"]


def closed(schema: Any) -> Any:
    """A CRD schema whose objects with listed properties admit no others: the API server would
    prune a misspelled field silently; here it fails."""
    if isinstance(schema, list):
        return [closed(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def validate_scaled_object(manifest: dict[str, Any]) -> None:
    """KEDA's CRD (OpenAPI, closed, and its CEL rules), then each Prometheus trigger's metadata as
    KEDA's scaler parses it: the required keys, no unknown ones, decimal thresholds."""
    schema = keda_schema()
    jsonschema.Draft7Validator(openapi_to_jsonschema(closed(schema))).validate(manifest)
    problems = cel_errors(schema, apply_defaults(schema, manifest))
    assert not problems, problems
    for trigger in manifest["spec"]["triggers"]:
        assert trigger["type"] == "prometheus", trigger
        metadata = trigger["metadata"]
        assert KEDA_PROMETHEUS_REQUIRED <= set(metadata) <= KEDA_PROMETHEUS_REQUIRED | KEDA_PROMETHEUS_OPTIONAL
        for key in ("threshold", "activationThreshold"):
            if key in metadata:
                float(metadata[key])


def validate_child(manifest: dict[str, Any]) -> None:
    """A rendered child against its schema, strictly: the Kubernetes OpenAPI (kubernetes-validate)
    for built-in kinds, the Inference Extension's v1 schema for an InferencePool, KEDA's CRD for a
    ScaledObject."""
    if (manifest["apiVersion"], manifest["kind"]) == (inferencepool_schema.API_VERSION, inferencepool_schema.KIND):
        inferencepool_schema.validate(manifest)
    elif (manifest["apiVersion"], manifest["kind"]) == ("keda.sh/v1alpha1", "ScaledObject"):
        validate_scaled_object(manifest)
    else:
        kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)


def pool_schema() -> dict[str, Any]:
    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting: absent properties with a default get it, recursively."""
    if isinstance(value, dict) and "properties" in schema:
        out = dict(value)
        for name, sub in schema["properties"].items():
            if name not in out and "default" in sub:
                out[name] = copy.deepcopy(sub["default"])
            if name in out:
                out[name] = apply_defaults(sub, out[name])
        return out
    if isinstance(value, list) and "items" in schema:
        return [apply_defaults(schema["items"], v) for v in value]
    return value


def openapi_to_jsonschema(schema: Any) -> Any:
    if isinstance(schema, dict):
        return {k: openapi_to_jsonschema(v) for k, v in schema.items() if not k.startswith("x-kubernetes")}
    if isinstance(schema, list):
        return [openapi_to_jsonschema(v) for v in schema]
    return schema


@cache
def _program(rule: str):
    env = celpy.Environment()
    return env.program(env.compile(rule))


def cel_errors(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    errors = []
    for rule in schema.get("x-kubernetes-validations", []):
        result = _program(rule["rule"]).evaluate({"self": celpy.json_to_cel(value)})
        if isinstance(result, Exception) or not bool(result):
            errors.append(f"{path or '<root>'}: {rule['message']}")
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                errors += cel_errors(sub, value[name], f"{path}.{name}" if path else name)
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += cel_errors(schema["items"], item, f"{path}[{i}]")
    return errors


def field_schema(*path: str) -> dict[str, Any]:
    """The CRD's schema of one field of the spec (`field_schema("tiers", "cpu", "size")`)."""
    schema = pool_schema()["properties"]["spec"]
    for name in path:
        schema = schema["properties"][name]
    return schema


def crd_accepts(schema: dict[str, Any], value: Any) -> bool:
    """OpenAPI (pattern, length) and then every CEL rule, as the API server checks one field."""
    if list(jsonschema.Draft7Validator(openapi_to_jsonschema(schema)).iter_errors(value)):
        return False
    return not cel_errors(schema, value)


def api_server_errors(pool: dict[str, Any]) -> list[str]:
    """[] if the API server would accept the pool; else one message per violation."""
    schema = pool_schema()
    defaulted = apply_defaults(schema, pool)
    validator = jsonschema.Draft7Validator(openapi_to_jsonschema(schema))
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(defaulted)]
    if errors:
        return errors  # the API server stops before CEL when the schema fails
    return cel_errors(schema, defaulted)
