"""docs/operator.md: the API reference is generated from the models and must be current;
docs/development.md: every path it names exists (the map must stay true)."""

from __future__ import annotations

import re
from pathlib import Path

from kvpool_dev.apidoc import reference, replace_section
from tests.operator.conftest import example_ids

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "operator.md"


def test_api_reference_is_current():
    text = DOC.read_text()
    assert replace_section(text) == text, "run `python -m kvpool_dev.apidoc --write docs/operator.md`"
    assert "`spec.tiers.redis.managed.memory`" in reference()


def test_the_settings_table_is_generated_from_the_settings_model():
    """Every operator setting documented (KVPOOL_INFERENCE_POOLS was not), with its chart value."""
    import yaml

    from kvpool_dev.apidoc import SETTINGS_BEGIN, settings_table
    from kvpool_operator.settings import Settings, env_name

    text = DOC.read_text()
    assert settings_table() in text, "run `python -m kvpool_dev.apidoc --write docs/operator.md`"
    chart = yaml.safe_load((REPO / "charts" / "kvpool" / "values.yaml").read_text())["operator"]["settings"]
    for name, info in Settings.model_fields.items():
        assert info.description, f"Settings.{name} has no description"
        row = next(line for line in settings_table().splitlines() if line.startswith(f"| `{env_name(name)}` |"))
        value = re.search(r"`operator\.settings\.(\w+)`", row)
        assert value is None or value.group(1) in chart, row  # the chart value named exists
    assert text.index(SETTINGS_BEGIN) < text.index("## Model sources")


def test_examples_are_documented():
    text = DOC.read_text()
    for name in example_ids():
        assert f"`{name}`" in text, name


def test_every_path_the_development_guide_names_exists():
    text = (REPO / "docs" / "development.md").read_text()
    paths = set(re.findall(r"`([\w.-]+/[\w./-]*)`", text))  # `a/b.py`, `connector/` (no placeholders)
    assert len(paths) > 30
    assert [p for p in sorted(paths) if not (REPO / p).exists()] == []
