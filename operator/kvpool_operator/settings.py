"""Operator settings, read once from the environment (the Helm chart sets these variables)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Annotated, Literal, get_origin

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvpool_connector.config import UsageError
from kvpool_operator import __version__

ENV_PREFIX = "KVPOOL_"
MAX_UID = 2**31 - 1  # Kubernetes' runAsUser/runAsGroup/fsGroup are int64 capped here by validation

# An image by tag or pinned by digest (`repo:tag@sha256:<64 hex>`); the digest wins where both are given.
IMAGE_PATTERN = r"^[^\s@]+(@sha256:[a-f0-9]{64})?$"
Image = Annotated[str, Field(pattern=IMAGE_PATTERN)]


def under(path: str, prefix: str) -> bool:
    """Whole path components: /mnt/nvme0/kv is under /mnt/nvme0, /mnt/nvme0evil is not."""
    return prefix == "/" or path == prefix or path.startswith(prefix + "/")


def overlaps(a: str, b: str) -> bool:
    """Whether one node directory is, holds or lies under the other."""
    return under(a, b) or under(b, a)


def _node_dirs(prefixes: tuple[str, ...]) -> tuple[str, ...]:
    for prefix in prefixes:
        if not prefix.startswith("/") or re.search(r"(^|/)[.]{1,2}(/|$)|//", prefix):
            raise ValueError(f"{prefix!r} is not a normal absolute path")
    return tuple(p.rstrip("/") or "/" for p in prefixes)


class SettingsError(UsageError):
    """Bad `KVPOOL_*` variables: one line per problem, each naming the variable and its value."""


def env_name(field: str) -> str:
    """The environment variable of a setting (`retry_delay` -> KVPOOL_RETRY_DELAY)."""
    return ENV_PREFIX + field.upper()


# KVPOOL_* variables that are not operator settings but may stand in the same environment (the
# engines' and the dev tools'): never reported as typos.
OTHER_VARIABLES = ("KVPOOL_DTYPE", "KVPOOL_POOL_KEY", "KVPOOL_POOL_KEY_PREVIOUS", "KVPOOL_REDIS_PASSWORD",
                   "KVPOOL_S3_ACCESS_KEY", "KVPOOL_S3_SECRET_KEY")


# Settings that are gone, and what replaced them: set, they are reported, never silently ignored.
REMOVED_VARIABLES = {
    "KVPOOL_ENGINE_RUN_AS_USER": "each pool's engines run as a uid of their own (KVPOOL_ENGINE_UID_FIRST, "
    "KVPOOL_ENGINE_UID_COUNT)",
    "KVPOOL_ENGINE_RUN_AS_GROUP": "each pool's engines run as a gid of their own, equal to their uid "
    "(KVPOOL_ENGINE_UID_FIRST, KVPOOL_ENGINE_UID_COUNT)",
}


def misspelled(env: Mapping[str, str] | None = None) -> list[str]:
    """`KVPOOL_*` variables close to a setting's name but not one (KVPOOL_ALLOWED_HOSTPATH_PREFIXES):
    from_env ignores them, so the setting keeps its default while the user thinks it is set."""
    import difflib

    env = os.environ if env is None else env
    names = [env_name(f) for f in Settings.model_fields]
    out = []
    for var in sorted(env):
        if var in REMOVED_VARIABLES:
            out.append(f"{var} is no longer an operator setting (ignored): {REMOVED_VARIABLES[var]}")
        elif var.startswith(ENV_PREFIX) and var not in names and var not in OTHER_VARIABLES:
            close = difflib.get_close_matches(var, names, n=1, cutoff=0.85)
            if close:
                out.append(f"{var} is not an operator setting (ignored); did you mean {close[0]}?")
    return out


class Settings(BaseModel):
    """Defaults the operator fills into rendered children and how it runs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    connector_image: Image = Field(
        f"ghcr.io/kvpool/kvpool-vllm:{__version__}",
        description="Default engine image (vLLM + kvpool_connector, Dockerfile target "
        "`connector`). Not "
        "published: build it (`make images`), push it to your registry and set this."
    )
    redis_image: Image = Field("redis:7.4-alpine", description="Default image of managed Redis.")
    minio_image: Image = Field(
        "quay.io/minio/minio:RELEASE.2025-04-22T22-12-26Z", description="Default image of managed MinIO."
    )
    minio_client_image: Image = Field(
        "quay.io/minio/mc:RELEASE.2025-04-16T18-13-26Z",
        description="MinIO client (mc) that bootstraps managed MinIO: bucket, lifecycle, quota, engine user.",
    )
    router_image: Image = Field(
        f"ghcr.io/kvpool/kvpool-router:{__version__}",
        description="Default router image (vllm-router, Dockerfile target `router`) for pools with spec.router. "
        "Not published: build and push it like the engine image.",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="imagePullPolicy of every child container (Always, IfNotPresent or Never).")
    namespaces: tuple[str, ...] = Field((), description="Watched namespaces; empty: all namespaces.")
    log_format: Literal["plain", "json", "full"] = Field("plain", description="kopf log format.")
    reconcile_interval: float = Field(300.0, gt=0, description="Seconds between drift-correction passes.")
    retry_delay: float = Field(15.0, gt=0, description="Seconds before retrying after API errors or a missing Secret.")
    backend_wait_seconds: int = Field(
        120, ge=0, description="How long an engine pod waits for its managed backends before starting anyway."
    )
    # What pool creators may ask for (policy.py): these hold whatever RBAC lets them write into a pool.
    allowed_host_path_prefixes: Annotated[tuple[str, ...], AfterValidator(_node_dirs)] = Field(
        (), description="Node directories a hostPath disk tier may live under (each pool mounts only its own "
        "subdirectory); empty: hostPath disk tiers are refused."
    )
    allowed_model_host_path_prefixes: Annotated[tuple[str, ...], AfterValidator(_node_dirs)] = Field(
        (), description="Node directories a hostPath model volume may be (it is mounted whole, read-only); empty: "
        "hostPath model volumes are refused. None may be, hold or lie under a disk-tier prefix "
        "(allowedHostPathPrefixes): a model volume there would read other pools' disk tiers."
    )
    allowed_image_prefixes: tuple[str, ...] = Field(
        (), description="Prefixes of the images a pool may name (model, router, managed backends), matched on a "
        "/, : or @ boundary; empty: any image."
    )
    allow_external_backends: bool = Field(
        True, description="Whether pools may name an external Redis or S3 (engines connect wherever it points)."
    )
    inference_pools: bool = Field(
        False,
        description="Whether pools may render an InferencePool (inference.networking.k8s.io/v1). Off: the "
        "operator never lists or writes InferencePools (it holds no RBAC for them, the CRD may be absent).",
    )
    keda: bool = Field(
        False,
        description="Whether KEDA is installed: pools with spec.autoscaling get a KEDA ScaledObject (Prometheus "
        "triggers; scale to zero allowed) instead of an autoscaling/v2 HorizontalPodAutoscaler on Pods metrics "
        "(served by prometheus-adapter). Off: the operator never lists or writes ScaledObjects (no RBAC for them).",
    )
    keda_prometheus_address: str = Field(
        "http://prometheus-operated.monitoring.svc:9090", pattern=r"^https?://[^\s?#@]+$",
        description="The Prometheus KEDA's triggers query (serverAddress), which scrapes the engines with the "
        "chart's PodMonitor (their series carry namespace and kvpool_dev_pool).",
    )
    router_discovery_role: str = Field(
        "kvpool-router-discovery", min_length=1, max_length=253,
        description="ClusterRole (pods list/watch) a pool's router is bound to in its namespace; the chart ships "
        "it as <fullname>-router-discovery and grants the operator `bind` on it alone.",
    )
    # The vLLM image runs as root by default; each pool's engines run as a non-root uid of their own.
    engine_uid_first: int = Field(
        1_000_000, ge=1, le=MAX_UID,
        description="Lowest uid/gid of engine containers. Each pool's engines run as uid = gid = engineUidFirst + "
        "(a digest of <namespace>/<name> mod engineUidCount): what one pool's connector writes (0600 files, 0700 "
        "directories) another pool cannot read.",
    )
    engine_uid_count: int = Field(
        1_000_000_000, ge=1, le=MAX_UID,
        description="How many uids pools' engines are spread over (engineUidFirst + engineUidCount - 1 is at most "
        f"{MAX_UID}, the largest runAsUser Kubernetes takes).",
    )
    engine_fs_group: int = Field(
        1000, ge=1, le=MAX_UID,
        description="fsGroup of engine pods, shared by every pool: the group that may enter the per-pool "
        "directories the kubelet creates on hostPath and PVC disk tiers (prepare hostPath prefixes with "
        "`install -d -m 2770 -g <engineFsGroup>`); the files inside are the pool's uid's alone.",
    )

    @model_validator(mode="after")
    def _engine_uids_in_range(self) -> Settings:
        last = self.engine_uid_first + self.engine_uid_count - 1
        if last > MAX_UID:
            raise ValueError(
                f"{env_name('engine_uid_count')}: {env_name('engine_uid_first')} + {env_name('engine_uid_count')} "
                f"- 1 = {last} is above {MAX_UID}, the largest uid Kubernetes runs a container as")
        return self

    @model_validator(mode="after")
    def _model_dirs_apart_from_disk_tiers(self) -> Settings:
        for model_dir in self.allowed_model_host_path_prefixes:
            for disk_dir in self.allowed_host_path_prefixes:
                if overlaps(model_dir, disk_dir):
                    raise ValueError(
                        f"{env_name('allowed_model_host_path_prefixes')}: {model_dir} overlaps the disk-tier prefix "
                        f"{disk_dir} ({env_name('allowed_host_path_prefixes')}): a model volume there would read "
                        "other pools' disk tiers")
        return self

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """`KVPOOL_<FIELD>` for every field (KVPOOL_CONNECTOR_IMAGE, KVPOOL_RETRY_DELAY, ...; lists
        such as KVPOOL_NAMESPACES comma-separated); unset or empty variables keep the defaults."""
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        for name, info in cls.model_fields.items():
            raw = env.get(ENV_PREFIX + name.upper())
            if raw is None or raw == "":
                continue
            is_list = get_origin(info.annotation) is tuple
            values[name] = tuple(n.strip() for n in raw.split(",") if n.strip()) if is_list else raw
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            problems = []
            for err in exc.errors():
                field = str(err["loc"][0]) if err["loc"] else ""
                shown = env.get(env_name(field), "") if field else ""
                message = err["msg"].removeprefix("Value error, ")
                problems.append(f"{env_name(field)}={shown!r}: {message}" if field else message)
            raise SettingsError("; ".join(problems)) from None
