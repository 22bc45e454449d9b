"""A thin Kubernetes API shell over the official client: apply, create, get, list, patch, delete.

Server-side apply (`application/apply-patch+yaml`, field manager `kvpool-operator`, force) for
every child; the official client does transport, auth and TLS. Only the kinds the operator
manages are known (kinds.CHILD_KINDS, the table RBAC derives from too, plus Events and pools).
"""

from __future__ import annotations

from typing import Any

import kubernetes
from kubernetes.client import ApiClient, ApiException, Configuration

from kvpool_operator import models
from kvpool_operator.kinds import CHILD_KINDS
from kvpool_operator.naming import MANAGER

PLURALS = {
    **{kind.key: kind.plural for kind in CHILD_KINDS},
    ("v1", "Event"): "events",
    (models.API_VERSION, models.KIND): models.PLURAL,
}

# (connect, read) seconds of every call: a handler thread stuck on a silent API server would block
# kopf's shutdown and every later pass of that pool; a timeout becomes an ApiError kopf retries.
TIMEOUT = (5.0, 15.0)

APPLY = "application/apply-patch+yaml"
MERGE = "application/merge-patch+json"


def path(api_version: str, kind: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    url = f"{base}/namespaces/{namespace}/{PLURALS[(api_version, kind)]}"
    if name:
        url += f"/{name}"
    if sub:
        url += f"/{sub}"
    return url


class Kube:
    """Synchronous (kopf runs sync handlers in its thread pool)."""

    def __init__(self, api_client: ApiClient):
        self.api = api_client

    @classmethod
    def from_environment(cls) -> Kube:
        """In-cluster service account, else the local kubeconfig (like kubectl)."""
        try:
            kubernetes.config.load_incluster_config()
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config()
        return cls(ApiClient())

    @classmethod
    def for_host(cls, host: str) -> Kube:
        config = Configuration(host=host)
        return cls(ApiClient(config))

    def _call(self, method: str, url: str, *, query=None, body=None, content_type: str | None = None) -> Any:
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        return self.api.call_api(
            url,
            method,
            query_params=query or [],
            header_params=headers,
            body=body,
            response_type="object",
            auth_settings=["BearerToken"],
            _return_http_data_only=True,
            _preload_content=True,
            _request_timeout=TIMEOUT,
        )

    def apply(self, manifest: dict[str, Any], manager: str = MANAGER) -> dict[str, Any]:
        meta = manifest["metadata"]
        url = path(manifest["apiVersion"], manifest["kind"], meta["namespace"], meta["name"])
        query = [("fieldManager", manager), ("force", "true")]
        return self._call("PATCH", url, query=query, body=manifest, content_type=APPLY)

    def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """POST: fails (409) when the object exists, so it never replaces anything."""
        meta = manifest["metadata"]
        return self._call("POST", path(manifest["apiVersion"], manifest["kind"], meta["namespace"]), body=manifest)

    def patch(self, api_version: str, kind: str, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """JSON merge patch: only the fields in `body` change."""
        return self._call("PATCH", path(api_version, kind, namespace, name), body=body, content_type=MERGE)

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._call("GET", path(api_version, kind, namespace, name))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, api_version: str, kind: str, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        try:
            result = self._call("GET", path(api_version, kind, namespace), query=[("labelSelector", selector)])
        except ApiException as exc:
            if exc.status == 404:  # the API is not served here: nothing of that kind exists
                return []
            raise
        items = result.get("items") or []
        # The selector is re-checked locally: cheap, and correct even against servers that ignore it.
        for item in items:
            item.setdefault("apiVersion", api_version)
            item.setdefault("kind", kind)
        return [i for i in items if labels.items() <= (i.get("metadata", {}).get("labels") or {}).items()]

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        try:
            self._call("DELETE", path(api_version, kind, namespace, name), body=body)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        url = path(models.API_VERSION, models.KIND, namespace, name, "status")
        return self._call("PATCH", url, body={"status": status}, content_type=MERGE)
