"""Golden renders: examples/<name>.yaml -> tests/operator/golden/<name>.yaml (namespace `kvpool`).

Written by `make golden` (`kvpool-operator golden --write DIR [--examples DIR]`), reviewed by
hand, compared byte for byte by the tests. Dev tooling: the examples are read from the kvpool
checkout this package lives in (dev/kvpool_dev/ -> the checkout) unless a directory is given.
"""

from __future__ import annotations

from pathlib import Path

from kvpool_operator.settings import Settings

REPO = Path(__file__).resolve().parents[2]  # dev/kvpool_dev/golden.py -> the kvpool checkout
EXAMPLES = REPO / "examples"
GOLDEN_NAMESPACE = "kvpool"
# hostPath under /mnt, InferencePools allowed and KEDA installed: what the examples ask of the operator
GOLDEN_SETTINGS = Settings(connector_image="ghcr.io/kvpool/kvpool-vllm:golden", allowed_host_path_prefixes=("/mnt",),
                           allowed_model_host_path_prefixes=("/srv/models",),
                           inference_pools=True, keda=True)
# Examples rendered under other settings: the one that shows the HorizontalPodAutoscaler (no KEDA).
GOLDEN_OVERRIDES: dict[str, dict[str, object]] = {"tiered-autoscaling": {"keda": False}}


def golden_settings(name: str) -> Settings:
    """The settings example `name` is rendered with into its golden file."""
    return GOLDEN_SETTINGS.model_copy(update=GOLDEN_OVERRIDES.get(name, {}))


def examples(directory: Path | None = None) -> list[Path]:
    return sorted((EXAMPLES if directory is None else Path(directory)).glob("*.yaml"))


def golden_text(example: Path) -> str:
    from kvpool_operator.cli import render_file

    header = f"# Golden render of examples/{example.name} (make golden). Review changes by hand.\n"
    return header + render_file(str(example), GOLDEN_NAMESPACE, golden_settings(example.stem))


def write_golden(directory: Path, examples_dir: Path | None = None) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for example in examples(examples_dir):
        path = directory / example.name
        path.write_text(golden_text(example))
        written.append(path)
    return written
