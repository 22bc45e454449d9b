"""spec.model's sources: a volume with the weights (PVC, hostPath, OCI image volume), a shared
Hugging Face cache and the token of a gated model. Each renders a read-only mount (the cache
writable unless asked), validates against the Kubernetes schema, and the API server's CEL rules
and the models refuse the same specs."""

from __future__ import annotations

import copy

import pytest

from kvpool_operator import models
from kvpool_operator.render import InvalidPool, load_pool, render
from kvpool_operator.render.common import CONFIG_DIR, DISK_PATH, TLS_CA_DIR
from kvpool_operator.render.engine import HOME
from kvpool_operator.render.secretrefs import referenced_secrets
from kvpool_operator.settings import Settings, SettingsError
from tests.operator.conftest import load_example
from tests.operator.schema_check import api_server_errors, validate_child

SOURCES = {
    "pvc": {"persistentVolumeClaim": {"claimName": "models"}, "subPath": "llama"},
    "hostPath": {"hostPath": {"path": "/srv/models"}},
    "image": {"image": {"reference": "registry.example/weights/llama:1", "pullPolicy": "IfNotPresent"},
              "mountPath": "/weights"},
}


def pool_with(**model) -> dict:
    pool = copy.deepcopy(load_example("tiered-cpu-only"))
    pool["spec"]["model"].update(model)
    return pool


def engine(pool: dict, settings: Settings) -> tuple[dict, dict]:
    """(the engine pod spec, its vllm container)."""
    dep = next(m for m in render(pool, settings, "ml") if m["kind"] == "Deployment"
               and m["metadata"]["labels"]["app.kubernetes.io/component"] == "engine")
    pod = dep["spec"]["template"]["spec"]
    return pod, pod["containers"][0]


@pytest.mark.parametrize("source", list(SOURCES))
def test_a_model_volume_is_mounted_read_only_and_schema_valid(source, settings):
    pool = pool_with(name="/models/llama", volume=SOURCES[source])
    assert api_server_errors(pool) == []
    pod, container = engine(pool, settings)
    [volume] = [v for v in pod["volumes"] if v["name"] == "model"]
    [mount] = [m for m in container["volumeMounts"] if m["name"] == "model"]
    assert mount["readOnly"] is True
    assert mount["mountPath"] == SOURCES[source].get("mountPath", "/models")
    if source == "pvc":
        assert volume["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
        assert mount["subPath"] == "llama"
    elif source == "hostPath":
        assert volume["hostPath"] == {"path": "/srv/models", "type": "Directory"}  # never created by the kubelet
    else:
        assert volume["image"] == {"reference": "registry.example/weights/llama:1", "pullPolicy": "IfNotPresent"}
    assert container["args"][0] == "/models/llama"
    for manifest in render(pool, settings, "ml"):
        validate_child(manifest)


def test_the_hf_cache_is_hf_home_and_the_token_comes_by_secret_key_ref(settings):
    pool = pool_with(hfCache={"persistentVolumeClaim": {"claimName": "hf"}},
                     hfTokenSecretRef={"name": "hf-token", "key": "token"})
    assert api_server_errors(pool) == []
    pod, container = engine(pool, settings)
    env = {e["name"]: e for e in container["env"]}
    assert env["HF_HOME"] == {"name": "HF_HOME", "value": models.HF_CACHE_DIR}
    assert env["HF_TOKEN"] == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}
    assert "HF_HUB_OFFLINE" not in env
    assert {"name": "hf-cache", "persistentVolumeClaim": {"claimName": "hf"}} in pod["volumes"]
    assert {"name": "hf-cache", "mountPath": models.HF_CACHE_DIR, "readOnly": False} in container["volumeMounts"]
    refs = [(r.field, r.name, r.key) for r in referenced_secrets(load_pool(pool, settings))]
    assert ("spec.model.hfTokenSecretRef", "hf-token", "token") in refs  # the reconciler checks it exists
    for manifest in render(pool, settings, "ml"):
        validate_child(manifest)


def test_a_read_only_hf_cache_runs_the_engines_offline(settings):
    pool = pool_with(hfCache={"persistentVolumeClaim": {"claimName": "hf"}, "readOnly": True})
    pod, container = engine(pool, settings)
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["HF_HUB_OFFLINE"] == "1"
    assert {"name": "hf-cache", "persistentVolumeClaim": {"claimName": "hf", "readOnly": True}} in pod["volumes"]
    assert {"name": "hf-cache", "mountPath": models.HF_CACHE_DIR, "readOnly": True} in container["volumeMounts"]


def test_tiered_full_serves_its_gated_model_with_a_token(settings):
    """The example serves meta-llama (gated): without HF_TOKEN every engine would fail to start."""
    _, container = engine(load_example("tiered-full"), settings)
    token = next(e for e in container["env"] if e["name"] == "HF_TOKEN")
    assert "secretKeyRef" in token["valueFrom"] and "value" not in token


def test_a_model_host_path_is_under_its_own_allow_list():
    pool = pool_with(name="/models/llama", volume=SOURCES["hostPath"])
    with pytest.raises(InvalidPool, match=r"^spec.model.volume.hostPath: refused by this operator \(its setting "
                                          r"allowedModelHostPathPrefixes is empty\)"):
        load_pool(pool, Settings())
    # the disk tiers' allow-list admits no model volume (it did: a model could mount a disk-tier prefix)
    with pytest.raises(InvalidPool, match=r"allowedModelHostPathPrefixes is empty"):
        load_pool(pool, Settings(allowed_host_path_prefixes=("/srv",)))
    with pytest.raises(InvalidPool, match=r"^spec.model.volume.hostPath.path: /srv/models is not under"):
        load_pool(pool, Settings(allowed_model_host_path_prefixes=("/data",)))
    load_pool(pool, Settings(allowed_model_host_path_prefixes=("/srv/models",)))


@pytest.mark.parametrize("path", ["/mnt/nvme0", "/mnt/nvme0/kvpool", "/mnt"])
def test_a_model_volume_never_reads_a_disk_tier_directory(path):
    """The attack: a pool mounts the node's disk-tier directory (or one above or below it) as its
    model and reads every other pool's hostPath disk tier there."""
    pool = pool_with(name="/models/llama", volume={"hostPath": {"path": path}})
    settings = Settings(allowed_host_path_prefixes=("/mnt/nvme0",), allowed_model_host_path_prefixes=("/srv",))
    with pytest.raises(InvalidPool) as exc:
        load_pool(pool, settings)
    assert str(exc.value).startswith("spec.model.volume.hostPath"), exc.value
    # and an operator cannot be set up to allow it: model and disk-tier prefixes never overlap
    with pytest.raises(ValueError, match=r"KVPOOL_ALLOWED_MODEL_HOST_PATH_PREFIXES: .* overlaps the disk-tier prefix "
                                         r"/mnt/nvme0 \(KVPOOL_ALLOWED_HOST_PATH_PREFIXES\)"):
        Settings(allowed_host_path_prefixes=("/mnt/nvme0",), allowed_model_host_path_prefixes=(path,))
    with pytest.raises(SettingsError, match="overlaps the disk-tier prefix"):
        Settings.from_env({"KVPOOL_ALLOWED_HOST_PATH_PREFIXES": "/mnt/nvme0",
                           "KVPOOL_ALLOWED_MODEL_HOST_PATH_PREFIXES": path})


def test_a_model_image_is_under_the_operators_image_prefixes():
    pool = pool_with(name="/models/llama", volume=SOURCES["image"])
    with pytest.raises(InvalidPool, match=r"spec.model.volume.image.reference: registry.example/weights/llama:1 "
                                          r"does not start with an allowed prefix"):
        load_pool(pool, Settings(allowed_image_prefixes=("ghcr.io/kvpool",)))
    load_pool(pool, Settings(allowed_image_prefixes=("registry.example/weights", "ghcr.io/kvpool")))


INVALID = [
    ({}, "spec.model.volume", "exactly one of persistentVolumeClaim, hostPath, image must be set"),
    ({**SOURCES["pvc"], **SOURCES["hostPath"]}, "spec.model.volume", "exactly one of"),
    ({**SOURCES["hostPath"], "mountPath": "/home/kvpool/models"}, "spec.model.volume.mountPath",
     "must not be /, nor be, hold or lie under a directory of the engine's own"),
    ({**SOURCES["hostPath"], "mountPath": "/var"}, "spec.model.volume.mountPath", "must not be /"),
    ({**SOURCES["hostPath"], "mountPath": "/"}, "spec.model.volume.mountPath", "must not be /"),
    ({**SOURCES["hostPath"], "mountPath": "/a/../etc"}, "spec.model.volume.mountPath",
     "must be a normal absolute path"),
    ({**SOURCES["pvc"], "subPath": "../other"}, "spec.model.volume.subPath", "must be a relative path"),
    ({**SOURCES["pvc"], "subPath": "/abs"}, "spec.model.volume.subPath", "must be a relative path"),
    ({"image": {"reference": "reg/w@latest"}}, "spec.model.volume.image.reference", "match"),
    ({"hostPath": {"path": "/mnt//models"}}, "spec.model.volume.hostPath.path", "must be a normal absolute path"),
]


@pytest.mark.parametrize(("volume", "field", "message"), INVALID, ids=lambda v: str(v)[:40])
def test_bad_model_volumes_are_refused_by_the_api_server_and_the_models_alike(volume, field, message, settings):
    pool = pool_with(name="/models/llama", volume=volume)
    errors = api_server_errors(pool)
    assert any(message in e for e in errors), errors
    with pytest.raises(InvalidPool) as exc:
        load_pool(pool, settings)
    assert str(exc.value).startswith(field) and message in str(exc.value)


def test_no_mount_path_of_the_engines_own_is_left_out():
    """models.RESERVED_MOUNTS (the models cannot import the renderers) holds every directory
    the engine container mounts itself."""
    own = {CONFIG_DIR, TLS_CA_DIR, "/dev/shm", HOME, DISK_PATH.rsplit("/", 1)[0], models.HF_CACHE_DIR}
    assert own == set(models.RESERVED_MOUNTS)
