"""policy.refusals: what the operator's settings let a pool ask for (hostPath, images, external backends)."""

from __future__ import annotations

import copy

import pytest

from kvpool_operator import models
from kvpool_operator.policy import refusals, under
from kvpool_operator.render import InvalidPool, load_pool
from kvpool_operator.settings import Settings
from tests.operator.conftest import load_example


def spec(name: str, **changes) -> models.KVCachePoolSpec:
    raw = copy.deepcopy(load_example(name)["spec"])
    raw.update(changes)
    return models.parse_spec(raw)


def test_host_path_is_refused_unless_under_an_allowed_prefix():
    full = spec("tiered-full")  # hostPath /mnt/nvme0
    assert refusals(full, Settings()) == [
        "spec.tiers.disk.volume.hostPath: refused by this operator (its setting allowedHostPathPrefixes is empty); "
        "use emptyDir, ephemeral or persistentVolumeClaim"]
    assert refusals(full, Settings(allowed_host_path_prefixes=("/mnt",))) == []
    assert refusals(full, Settings(allowed_host_path_prefixes=("/mnt/nvme0/",))) == []
    (message,) = refusals(full, Settings(allowed_host_path_prefixes=("/mnt/nvme", "/data")))
    assert message == ("spec.tiers.disk.volume.hostPath.path: /mnt/nvme0 is not under an allowed prefix "
                       "(operator setting allowedHostPathPrefixes: /mnt/nvme, /data)")
    assert refusals(spec("tiered-emptydir"), Settings()) == []  # no hostPath, nothing to refuse


def test_prefixes_match_whole_path_components():
    assert under("/mnt/nvme0/kv", "/mnt/nvme0") and under("/mnt/nvme0", "/mnt/nvme0") and under("/x", "/")
    assert not under("/mnt/nvme0evil", "/mnt/nvme0") and not under("/mnt", "/mnt/nvme0")


def test_settings_refuse_bad_prefixes():
    with pytest.raises(ValueError, match="not a normal absolute path"):
        Settings(allowed_host_path_prefixes=("/mnt/../etc",))
    with pytest.raises(ValueError, match="not a normal absolute path"):
        Settings(allowed_host_path_prefixes=("mnt",))


def test_images_must_start_with_an_allowed_prefix():
    pool = spec("tiered-full", model={"name": "m", "image": "evil.example/vllm:1"})
    allowed = Settings(allowed_host_path_prefixes=("/mnt",), allowed_image_prefixes=("registry.example/",))
    assert refusals(pool, allowed) == [
        "spec.model.image: evil.example/vllm:1 does not start with an allowed prefix "
        "(operator setting allowedImagePrefixes: registry.example/)"]
    pool = spec("tiered-full", model={"name": "m", "image": "registry.example/vllm@sha256:" + "a" * 64})
    assert refusals(pool, allowed) == []
    raw = copy.deepcopy(load_example("tiered-full")["spec"])
    raw["tiers"]["redis"]["managed"]["image"] = "redis:7"
    assert [m.split(":")[0] for m in refusals(models.parse_spec(raw), allowed)] == ["spec.tiers.redis.managed.image"]
    assert refusals(models.parse_spec(raw), Settings(allowed_host_path_prefixes=("/mnt",))) == []  # empty: any


def test_external_backends_can_be_refused():
    external = spec("tiered-external")
    assert refusals(external, Settings()) == []
    assert refusals(external, Settings(allow_external_backends=False)) == [
        "spec.tiers.redis.external: refused by this operator (its setting allowExternalBackends is false); use managed",
        "spec.tiers.s3.external: refused by this operator (its setting allowExternalBackends is false); use managed"]


def test_load_pool_applies_the_policy():
    with pytest.raises(InvalidPool, match=r"spec\.tiers\.disk\.volume\.hostPath: refused"):
        load_pool(load_example("tiered-full"), Settings())
    load_pool(load_example("tiered-full"), Settings(allowed_host_path_prefixes=("/mnt",)))


def test_settings_read_lists_and_booleans_from_the_environment():
    s = Settings.from_env(
        {
            "KVPOOL_ALLOWED_HOST_PATH_PREFIXES": "/mnt/nvme0, /data/",
            "KVPOOL_ALLOW_EXTERNAL_BACKENDS": "false",
            "KVPOOL_ALLOWED_IMAGE_PREFIXES": "registry.example/",
            "KVPOOL_ENGINE_UID_FIRST": "5",
        }
    )
    assert s.allowed_host_path_prefixes == ("/mnt/nvme0", "/data") and s.allow_external_backends is False
    assert s.allowed_image_prefixes == ("registry.example/",) and s.engine_uid_first == 5
    with pytest.raises(ValueError, match="connector_image"):
        Settings(connector_image="vllm@latest")


@pytest.mark.parametrize("image,admitted", [
    ("registry.example/vllm:1", True),
    ("registry.example:5000/vllm:1", True),
    ("registry.example@sha256:" + "a" * 64, True),
    ("registry.example", True),
    ("registry.example.evil.com/vllm:1", False),  # a longer host name, not the registry
    ("registry.examplevllm:1", False),
])
def test_image_prefixes_end_on_a_name_boundary(image, admitted):
    """A prefix without a trailing `/`, `:` or `@` still names whole parts of the image name."""
    pool = spec("tiered-full", model={"name": "m", "image": image})
    settings = Settings(allowed_host_path_prefixes=("/mnt",), allowed_image_prefixes=("registry.example",))
    assert (not any("spec.model.image" in r for r in refusals(pool, settings))) is admitted


def test_router_image_is_held_to_the_prefixes():
    pool = spec("tiered-router", router={"image": "registry.example.evil.com/router:1"})
    settings = Settings(allowed_image_prefixes=("registry.example",))
    assert [r.split(":")[0] for r in refusals(pool, settings)] == ["spec.router.image"]
