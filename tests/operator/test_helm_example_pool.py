"""The chart's `examplePool.spec` is checked by values.schema.json against the CRD's spec schema
(charts/kvpool/hack/sync.py generates that definition), so a bad example pool fails `helm lint`
and `helm install` naming the field, instead of a post-install hook the API server refuses."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.operator.chartkit import CHART, helm, load_sync_module, values_schema
from tests.operator.conftest import EXAMPLES, examples


def lint(*set_values: str) -> object:
    args = [a for v in set_values for a in ("--set", v)]
    return helm("lint", str(CHART), "--set", "examplePool.enabled=true", *args, check=False)


@pytest.mark.parametrize(("value", "field", "why"), [
    ("examplePool.spec.tiers.cpu.size=10Gb", "/examplePool/spec/tiers/cpu/size", "'10Gb' does not match pattern"),
    ("examplePool.spec.connector=sideways", "/examplePool/spec/connector", "must be one of"),
    ("examplePool.spec.tiers.cpuu.size=8Gi", "/examplePool/spec/tiers", "cpuu"),
    ("examplePool.spec.model.gpus=-1", "/examplePool/spec/model/gpus", "minimum"),
])
def test_a_bad_example_pool_fails_helm_lint_naming_the_field(value, field, why):
    proc = lint(value)
    assert proc.returncode != 0
    assert f"at '{field}'" in proc.stdout + proc.stderr and why in proc.stdout + proc.stderr, proc.stdout


def test_the_default_example_pool_lints():
    proc = lint()
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_shipped_example_spec_fits_the_chart_schema():
    """The definition is the CRD's: what the examples (valid pools) hold, the chart accepts."""
    import yaml

    definition = values_schema()["definitions"]["kvcachepoolSpec"]
    for path in examples():
        spec = yaml.safe_load(path.read_text())["spec"]
        jsonschema.Draft7Validator({**values_schema(), **definition}).validate(spec)
    assert EXAMPLES.is_dir()


def test_the_definition_is_generated_from_the_crd():
    sync = load_sync_module()
    current = json.loads((CHART / "values.schema.json").read_text())
    assert (CHART / "values.schema.json").read_text() == sync.values_schema(current)
    assert current["properties"]["examplePool"]["properties"]["spec"] == {"$ref": "#/definitions/kvcachepoolSpec"}
