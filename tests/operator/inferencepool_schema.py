"""JSON Schema of `inference.networking.k8s.io/v1` InferencePool, for what the operator renders.

Transcribed by hand (not copied) from the Gateway API Inference Extension's released v1 API:
kubernetes-sigs/gateway-api-inference-extension, tag v1.6.0, files
config/crd/bases/inference.networking.k8s.io_inferencepools.yaml and api/v1/inferencepool_types.go.
Field names, types, bounds, patterns, enums and defaults are those of the release; its two CEL rules
are expressed in JSON Schema: "port is required when kind is 'Service' or unspecified" (if/then:
an absent kind matches the `if`, as the default Service would) and "port number must be unique"
(uniqueItems: a Port has no other field). Stricter than the CRD on purpose: additionalProperties
is false everywhere, so a field the release does not define (a typo, or a name from the
v1alpha2 API such as extensionRef or targetPortNumber) fails.

Differences between releases that matter to the renderer (checked against every v1 tag):
v1.0-v1.5 *require* endpointPickerRef (v1.6 made it optional), v1.0 allows only one target port,
appProtocol exists from v1.4 on. The renderer leaves appProtocol out (its default, http, is what
the engines speak); `REQUIRED_BEFORE_V1_6` lets a test check a render against the older rule.
The status (written by Gateway controllers, never by the operator) is not modelled.
"""

from __future__ import annotations

from typing import Any

import jsonschema

RELEASE = "v1.6.0"
API_VERSION = "inference.networking.k8s.io/v1"
KIND = "InferencePool"

_LABEL_VALUE = {"type": "string", "minLength": 0, "maxLength": 63,
                "pattern": "^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"}
_PORT = {  # Port: {number: PortNumber}, number int32 in [1, 65535], required
    "type": "object",
    "additionalProperties": False,
    "required": ["number"],
    "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}},
}
_ENDPOINT_PICKER_REF = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name"],
    "properties": {
        "group": {"type": "string", "default": "", "minLength": 0, "maxLength": 253,
                  "pattern": r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"},
        "kind": {"type": "string", "default": "Service", "minLength": 1, "maxLength": 63,
                 "pattern": "^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"},
        "name": {"type": "string", "minLength": 1, "maxLength": 253},
        "port": _PORT,
        "failureMode": {"type": "string", "default": "FailClose", "enum": ["FailOpen", "FailClose"]},
    },
    # CEL `self.kind != 'Service' || has(self.port)`
    "if": {"properties": {"kind": {"const": "Service"}}},
    "then": {"required": ["port"]},
}
SPEC_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["selector", "targetPorts"],
    "properties": {
        "selector": {
            "type": "object",
            "additionalProperties": False,
            "required": ["matchLabels"],
            "properties": {
                "matchLabels": {"type": "object", "minProperties": 1, "maxProperties": 64,
                                "additionalProperties": _LABEL_VALUE},
            },
        },
        # CEL `self.all(p1, self.exists_one(p2, p1.number==p2.number))`
        "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "uniqueItems": True, "items": _PORT},
        "appProtocol": {"type": "string", "default": "http", "enum": ["http", "kubernetes.io/h2c"]},
        "endpointPickerRef": _ENDPOINT_PICKER_REF,
    },
}
_DNS_SUBDOMAIN = {"type": "string", "minLength": 1, "maxLength": 253,
                  "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"}
SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": API_VERSION},
        "kind": {"const": KIND},
        "metadata": {  # ObjectMeta, as far as the operator writes it
            "type": "object",
            "additionalProperties": False,
            "required": ["name", "namespace"],
            "properties": {
                "name": _DNS_SUBDOMAIN,
                "namespace": _DNS_SUBDOMAIN,
                "labels": {"type": "object", "additionalProperties": _LABEL_VALUE},
                "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
                "ownerReferences": {"type": "array", "items": {"type": "object"}},
            },
        },
        "spec": SPEC_SCHEMA,
    },
}
# v1.0.0 - v1.5.0: `required: [endpointPickerRef, selector, targetPorts]`
REQUIRED_BEFORE_V1_6 = ["endpointPickerRef", "selector", "targetPorts"]


def errors(manifest: dict[str, Any]) -> list[str]:
    """[] when the InferencePool is valid under the v1 schema, else one message per violation."""
    validator = jsonschema.Draft7Validator(SCHEMA)
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(manifest)]


def validate(manifest: dict[str, Any]) -> None:
    problems = errors(manifest)
    assert not problems, problems
