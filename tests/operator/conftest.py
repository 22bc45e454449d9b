"""Fixtures of the operator tests: examples, settings, the newest Kubernetes schema version."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpool_dev.golden import EXAMPLES, GOLDEN_NAMESPACE, GOLDEN_SETTINGS, examples
from kvpool_operator.settings import Settings
from tests.operator.schema_check import K8S_VERSION  # noqa: F401  (re-exported for the tests)

GOLDEN_DIR = Path(__file__).parent / "golden"
REQUIRED_EXAMPLES = ["native-cpu", "native-nvme", "tiered-full", "tiered-external", "tiered-emptydir"]


def load_example(name: str) -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())


@pytest.fixture
def settings() -> Settings:
    return GOLDEN_SETTINGS


@pytest.fixture
def namespace() -> str:
    return GOLDEN_NAMESPACE


def example_ids() -> list[str]:
    return [p.stem for p in examples()]
