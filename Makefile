# Two commands: `make test` (install everything, run the suite) and `make demo` (the main job).
# `make test-images` builds and runs the container images (minutes; not part of `make test`).
VENV := .venv
PY := $(VENV)/bin/python
export PATH := $(CURDIR)/bin:$(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: setup test test-fast demo bench golden crds lint clean images test-images

setup:
	@bash scripts/setup.sh

# Two pytest-xdist workers, each running one engine test module at a time (a module is one
# xdist group, queued first; tests/conftest.py) on its own cores, then the short tests; then
# the tests marked `alone` (tensor-parallel engines: one rank per core) in one process, with
# nothing beside them (exit 5, none selected by PYTEST_ARGS, is fine there).
# PYTEST_WORKERS=0 runs the first phase in one process.
PYTEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadgroup)

test: setup
	$(PY) -m pytest $(XDIST) -m "not alone" $(PYTEST_ARGS)
	$(PY) -m pytest -m alone $(PYTEST_ARGS) || [ $$? -eq 5 ]

# The edit-test loop: everything but the tests that start vLLM engines (marker `vllm`).
test-fast: setup
	$(PY) -m pytest $(XDIST) -m "not vllm" $(PYTEST_ARGS)

# ruff (style, import order, likely bugs) over every Python file; mypy over the three shipped
# packages, strict on the operator's render and models and the store's public API (pyproject.toml).
lint: setup
	$(PY) -m ruff check .
	$(PY) -m mypy

# Every Dockerfile target built with buildah (no Docker daemon, no registry); test-images also runs
# each image as its manifest does (tests/images). IMAGES_ARGS: e.g. `--bases public` or targets.
images: setup
	@bash scripts/images.sh build $(IMAGES_ARGS)

test-images: setup
	@bash scripts/images.sh test $(IMAGES_ARGS)

# demo, bench and golden run the dev tooling (dev/, package kvpool_dev), which setup installs
# beside kvpool; the kvpool wheel and the images do not carry it.
demo: setup
	$(PY) -m kvpool_cli demo $(DEMO_ARGS)

bench: setup
	$(PY) -m kvpool_cli bench store
	$(PY) -m kvpool_cli bench e2e

# Regenerate checked-in artefacts derived from the pydantic models / render function.
crds: setup
	$(PY) -m kvpool_operator.cli crd --write crds/
	$(PY) charts/kvpool/hack/sync.py --write

golden: setup
	$(PY) -m kvpool_operator.cli golden --write tests/operator/golden/

clean:
	rm -rf $(VENV) bin .pytest_cache
