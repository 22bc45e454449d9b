"""kmock's Kubernetes emulator, completed with the API-server behaviour the operator relies on.

kmock stores plain JSON and merges patches. A real API server additionally:
- fills metadata.namespace from the URL and name from generateName, assigns metadata.uid,
  creationTimestamp, resourceVersion and bumps generation on spec changes
  (added here: kopf's consistency checks and the pool's observedGeneration need them);
- fills apiVersion and kind of created objects and folds a Secret's write-only `stringData` into
  base64 `data` (added here: kubectl and the operator read `data`, as against a cluster);
- serves discovery with the core group version `v1` and singular names (fixed here, so the real
  kubectl can run documented commands against the emulator);
- creates the object when a server-side apply (application/apply-patch+yaml) names a missing one
  (added here as an upsert);
- serves the cluster-scoped list and watch of namespaces, `/api/v1/namespaces` (kmock 0.8's path
  parser takes the segment for a namespace and fails on it: fixed here, so kopf can run in the
  chart's default namespaced mode, where it lists namespaces to match its `--namespace`);
- tracks field ownership per field manager and removes fields a manager stopped applying,
  garbage-collects children through ownerReferences, runs admission, defaulting and CEL
  (NOT emulated: tests assert the request the operator sends instead, and say so).
"""

from __future__ import annotations

import asyncio
import base64
import copy
import datetime
import functools
import itertools
import uuid
from typing import Any

import kmock
from aiohttp.test_utils import RawTestServer
from kmock._internal import dicts, k8s_views, parsing as kmock_parsing  # noqa: F401  (merge semantics of the emulator itself)

from kvpool_operator import models
from kvpool_operator.kinds import CHILD_KINDS

APPLY = "application/apply-patch+yaml"

RESOURCES = {
    f"{models.GROUP}/{models.VERSION}/{models.PLURAL}": kmock.ResourceInfo(
        kind=models.KIND, singular=models.SINGULAR, namespaced=True, shortnames={"kvp"},
        subresources={"status", "scale"}, verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    ),
    # every kind a pool's children can be (the InferencePool's CRD too, as on a cluster that runs it)
    **{f"{kind.api_version}/{kind.plural}": kmock.ResourceInfo(kind=kind.kind, namespaced=True)
       for kind in CHILD_KINDS},
    "v1/events": kmock.ResourceInfo(kind="Event", namespaced=True),
    # kopf's discovery waits for these core APIs (its "backbone") before watching anything.
    "v1/namespaces": kmock.ResourceInfo(kind="Namespace", namespaced=False),
    "apiextensions.k8s.io/v1/customresourcedefinitions": kmock.ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False),
    "rbac.authorization.k8s.io/v1/roles": kmock.ResourceInfo(kind="Role", namespaced=True),
}
for info in RESOURCES.values():
    info.verbs.update({"get", "list", "watch", "create", "patch", "update", "delete"})


_kmock_parse_path = kmock_parsing.parse_path


def _parse_path(path: str) -> kmock_parsing.ParsedPath:
    """kmock's parser, plus the core group's cluster-scoped `namespaces` collection."""
    if path.strip("/") == "api/v1/namespaces":
        return kmock_parsing.ParsedPath(group="", version="v1", plural="namespaces")
    return _kmock_parse_path(path)


kmock_parsing.parse_path = _parse_path


class ApiServer(kmock.KubernetesEmulator):
    """See the module docstring for what is added and what is not."""

    _versions = itertools.count(1)

    async def __call__(self, raw_request):
        # No keep-alive: every response closes its connection (see http_server)
        response = await super().__call__(raw_request)
        response.force_close()
        return response

    async def _handle(self, request: kmock.Request):
        if request.resource is not None and isinstance(request.data, dict):
            await self._complete(request)
        return await super()._handle(request)

    async def _serve_version(self, request):
        doc = await super()._serve_version(request)
        doc["groupVersion"] = doc["groupVersion"].lstrip("/")  # kmock says "/v1" for the core group
        for resource in doc.get("resources", []):
            if resource.get("kind") and "/" not in resource["name"]:
                resource["singularName"] = resource["kind"].lower()
        return doc

    async def _complete(self, request: kmock.Request) -> None:
        data = request.data
        meta = data.setdefault("metadata", {})
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        if request.resource.plural == "secrets" and isinstance(data.get("stringData"), dict):
            encoded = {k: base64.b64encode(str(v).encode()).decode() for k, v in data.pop("stringData").items()}
            data["data"] = {**(data.get("data") or {}), **encoded}
        if request.action == kmock.action.CREATE:
            res = request.resource
            group_version = f"{res.group}/{res.version}" if res.group else res.version
            info = RESOURCES.get(f"{group_version}/{res.plural}")
            if info is not None:
                data.setdefault("apiVersion", group_version)
                data.setdefault("kind", info.kind)
            if request.namespace:
                meta.setdefault("namespace", request.namespace)
            if "name" not in meta and "generateName" in meta:
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", now)
            meta["generation"] = 1
            meta["resourceVersion"] = str(next(self._versions))
            return
        if request.action != kmock.action.UPDATE or request.name is None:
            return
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            exists = key in self.objects and not self.objects[key].deleted
            if not exists and request.headers.get("Content-Type", "").startswith(APPLY):
                created = copy.deepcopy(data)
                created["metadata"].update(
                    uid=str(uuid.uuid4()), creationTimestamp=now, generation=1,
                    resourceVersion=str(next(self._versions)),
                )
                self.objects[key] = created
                await self._buses[request.resource].put({"type": "ADDED", "object": self.objects[key].raw})
                meta["resourceVersion"] = created["metadata"]["resourceVersion"]
                return
            if not exists:
                return  # the emulator answers 404 itself
            old = self.objects[key].raw
            meta["resourceVersion"] = str(next(self._versions))
            if request.subresource is None and "spec" in data:
                new_spec = dicts.patch_dict(copy.deepcopy(old), {"spec": data["spec"]}).get("spec")
                if new_spec != old.get("spec"):
                    meta["generation"] = old.get("metadata", {}).get("generation", 1) + 1


def http_server(api: ApiServer, host: str = "127.0.0.1") -> kmock.Server:
    """The emulator on a free port of `host` (loopback; the image smoke tests bind the container
    network's gateway), its connections never left idle: kopf, when it stops,
    gives the tasks started while it ran 5 s to end, and here those include the emulator's
    connection handlers (a real API server is not in kopf's event loop). So no keep-alive,
    and a handler is cancelled when its client goes away (an ended watch)."""
    return kmock.Server(api, host=host, server_cls=functools.partial(RawTestServer, handler_cancellation=True))


def apiserver_with_resources() -> ApiServer:
    server = ApiServer()
    for name, info in RESOURCES.items():
        server.resources[name] = info
    return server


async def eventually(check, timeout: float = 30.0, interval: float = 0.1, message: str = ""):
    """Poll until `check()` returns a truthy value (operators converge asynchronously)."""
    deadline = asyncio.get_running_loop().time() + timeout
    last_exc: Exception | None = None
    while True:
        try:
            value = check()
            if value:
                return value
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            last_exc = exc
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out: {message or check}; last error: {last_exc!r}")
        await asyncio.sleep(interval)


def live(server: ApiServer, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
    key = (kmock.resource(resource), namespace, name)
    if key not in server.objects or server.objects[key].deleted:
        return None
    return server.objects[key].raw


def requests(server: ApiServer) -> list[kmock.Request]:
    """Every request the emulator received, in order."""
    return list(server)
