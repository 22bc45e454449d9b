"""docs/operator.md: the API reference is generated from the models and must be current."""

from __future__ import annotations

from pathlib import Path

from kvpool_dev.apidoc import reference, replace_section
from tests.operator.conftest import example_ids

DOC = Path(__file__).resolve().parents[2] / "docs" / "operator.md"


def test_api_reference_is_current():
    text = DOC.read_text()
    assert replace_section(text) == text, "run `python -m kvpool_dev.apidoc --write docs/operator.md`"
    assert "`spec.tiers.redis.managed.memory`" in reference()


def test_examples_are_documented():
    text = DOC.read_text()
    for name in example_ids():
        assert f"`{name}`" in text, name
