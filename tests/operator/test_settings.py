"""Operator settings from the environment (what the Helm chart sets)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvpool_operator.settings import Settings


def test_from_env_reads_prefixed_variables():
    s = Settings.from_env({
        "KVPOOL_CONNECTOR_IMAGE": "reg/vllm:1", "KVPOOL_NAMESPACES": "a, b,,c", "KVPOOL_LOG_FORMAT": "json",
        "KVPOOL_RECONCILE_INTERVAL": "60", "KVPOOL_REDIS_IMAGE": "", "UNRELATED": "x",
    })
    assert s.connector_image == "reg/vllm:1" and s.namespaces == ("a", "b", "c")
    assert s.log_format == "json" and s.reconcile_interval == 60.0
    assert s.redis_image == Settings().redis_image  # empty keeps the default


def test_bad_values_name_the_setting():
    with pytest.raises(ValidationError, match="log_format"):
        Settings.from_env({"KVPOOL_LOG_FORMAT": "xml"})
    with pytest.raises(ValidationError, match="reconcile_interval"):
        Settings.from_env({"KVPOOL_RECONCILE_INTERVAL": "-1"})
