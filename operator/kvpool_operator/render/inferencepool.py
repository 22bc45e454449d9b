"""InferencePool `<name>` (Gateway API Inference Extension, `inference.networking.k8s.io/v1`).

It selects the engines (not the router: a Gateway with the inference extension picks a model
server itself, through its endpoint picker) on their API port. Rendered only with
`spec.inferencePool.enabled`, which the operator admits only with its `inferencePools` setting.
`appProtocol` is left out: its default (http) is what the engines speak, and releases before
v1.4 do not know the field.
"""

from __future__ import annotations

from typing import Any

from kvpool_operator.render.common import HTTP_PORT, Pool

API_VERSION = "inference.networking.k8s.io/v1"
KIND = "InferencePool"


def render_inference_pool(pool: Pool) -> list[dict[str, Any]]:
    spec = pool.spec.inference_pool
    if spec is None or not spec.enabled:
        return []
    body: dict[str, Any] = {
        "selector": {"matchLabels": pool.selector("engine")},
        "targetPorts": [{"number": HTTP_PORT}],
    }
    ref = spec.endpoint_picker_ref
    if ref is not None:
        picker: dict[str, Any] = {"group": ref.group, "kind": ref.kind, "name": ref.name,
                                  "failureMode": ref.failure_mode}
        if ref.port is not None:
            picker["port"] = {"number": ref.port.number}
        body["endpointPickerRef"] = picker
    return [{"apiVersion": API_VERSION, "kind": KIND, "metadata": pool.meta(pool.name, "engine"), "spec": body}]
