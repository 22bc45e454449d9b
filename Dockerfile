# syntax=docker/dockerfile:1
# kvpool images. Three targets:
#   docker build --target operator  -t ghcr.io/kvpool/kvpool-operator:0.1.0 .
#   docker build --target connector -t ghcr.io/kvpool/kvpool-vllm:0.1.0 .
#   docker build --target router    -t ghcr.io/kvpool/kvpool-router:0.1.0 .
# The images carry the `kvpool` distribution only (operator/, connector/, cli/): the dev tooling in
# dev/ (kvpool-dev: test bed, benchmarks, demo, generators) is never copied (.dockerignore).
# Package versions come from pyproject.toml (the extras `operator` and `connector`); the vLLM base
# tag must match the vLLM API the connector targets, and VLLM_ROUTER_VERSION the vllm-router the
# tests run (tests/operator/test_images.py checks all three).
# Pin the bases by digest for reproducible, tamper-evident builds (a tag can be moved, a digest
# cannot), keeping the tag for humans:
#   docker build --build-arg VLLM_IMAGE=vllm/vllm-openai:v0.32.0@sha256:<digest> --target connector ...
# and deploy the built images by digest too (chart image.digest, operator.settings.*Image
# `repo@sha256:...`, spec.model.image).

ARG PYTHON_IMAGE=python:3.12.11-slim-bookworm
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0

# ---- operator: build a self-contained virtualenv ---------------------------------------------
FROM ${PYTHON_IMAGE} AS operator-build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY connector ./connector
COPY cli ./cli
RUN python -m venv /opt/kvpool \
 && /opt/kvpool/bin/pip install --no-compile ".[operator]"

# ---- operator: slim runtime, no torch, no vLLM, non-root, read-only root filesystem ------------
FROM ${PYTHON_IMAGE} AS operator
LABEL org.opencontainers.image.title="kvpool-operator" \
      org.opencontainers.image.description="KVCachePool operator (kopf)" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 65532 kvpool \
 && useradd --system --no-log-init --uid 65532 --gid 65532 --home-dir /nonexistent --shell /usr/sbin/nologin kvpool
COPY --from=operator-build /opt/kvpool /opt/kvpool
# Nothing is written at run time: no bytecode cache, unbuffered logs, /tmp is an emptyDir in the chart.
ENV PATH=/opt/kvpool/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 65532:65532
ENTRYPOINT ["kvpool-operator", "run"]

# ---- connector: the pinned vLLM release plus kvpool's connector; vLLM's entrypoint stays ------
FROM ${VLLM_IMAGE} AS connector
LABEL org.opencontainers.image.title="kvpool-vllm" \
      org.opencontainers.image.description="vLLM with the kvpool tiered KV connector" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY pyproject.toml README.md /tmp/kvpool-src/
COPY operator /tmp/kvpool-src/operator
COPY connector /tmp/kvpool-src/connector
COPY cli /tmp/kvpool-src/cli
# Constrain to what the image already has, so installing the connector never moves vLLM's own
# dependencies (torch, pydantic, ...): a conflict fails the build instead of shipping a broken image.
# No WORKDIR, USER or ENTRYPOINT change: the image runs exactly like vllm/vllm-openai.
RUN python3 -m pip list --format=freeze > /tmp/vllm-constraints.txt \
 && python3 -m pip install --constraint /tmp/vllm-constraints.txt "/tmp/kvpool-src[connector]" \
 && rm -rf /tmp/kvpool-src /tmp/vllm-constraints.txt

# ---- router: the vLLM project's router (a Rust binary in the PyPI wheel), non-root --------------
# The console script `vllm-router` is a Python launcher around the extension, so the image keeps
# Python; the manylinux wheel bundles its libssl/libcrypto, no compiler is needed. Nothing is written
# at run time (the operator mounts an emptyDir on /tmp and sets readOnlyRootFilesystem).
FROM ${PYTHON_IMAGE} AS router
LABEL org.opencontainers.image.title="kvpool-router" \
      org.opencontainers.image.description="vllm-router in front of a KVCachePool's engines" \
      org.opencontainers.image.licenses="Apache-2.0"
ARG VLLM_ROUTER_VERSION=0.1.17
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/router \
 && /opt/router/bin/pip install --no-compile "vllm-router==${VLLM_ROUTER_VERSION}" \
 && groupadd --system --gid 65532 kvpool \
 && useradd --system --no-log-init --uid 65532 --gid 65532 --home-dir /nonexistent --shell /usr/sbin/nologin kvpool
ENV PATH=/opt/router/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 65532:65532
EXPOSE 8000 29000
ENTRYPOINT ["vllm-router"]
