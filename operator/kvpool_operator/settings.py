"""Operator settings, read once from the environment (the Helm chart sets these variables)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kvpool_operator import __version__

ENV_PREFIX = "KVPOOL_"


class Settings(BaseModel):
    """Defaults the operator fills into rendered children and how it runs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    connector_image: str = Field(
        f"ghcr.io/kvpool/kvpool-vllm:{__version__}", description="Default engine image (vLLM + kvpool_connector)."
    )
    redis_image: str = Field("redis:7.4-alpine", description="Default image of managed Redis.")
    minio_image: str = Field(
        "quay.io/minio/minio:RELEASE.2025-04-22T22-12-26Z", description="Default image of managed MinIO."
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field("IfNotPresent")
    namespaces: tuple[str, ...] = Field((), description="Watched namespaces; empty: all namespaces.")
    log_format: Literal["plain", "json", "full"] = Field("plain", description="kopf log format.")
    reconcile_interval: float = Field(300.0, gt=0, description="Seconds between drift-correction passes.")
    retry_delay: float = Field(15.0, gt=0, description="Seconds before retrying after API errors or a missing Secret.")
    backend_wait_seconds: int = Field(
        120, ge=0, description="How long an engine pod waits for its managed backends before starting anyway."
    )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """`KVPOOL_<FIELD>` for every field (KVPOOL_CONNECTOR_IMAGE, KVPOOL_NAMESPACES as a comma
        list, KVPOOL_RETRY_DELAY, ...); unset or empty variables keep the defaults."""
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        for name in cls.model_fields:
            raw = env.get(ENV_PREFIX + name.upper())
            if raw is None or raw == "":
                continue
            values[name] = tuple(n.strip() for n in raw.split(",") if n.strip()) if name == "namespaces" else raw
        return cls.model_validate(values)
