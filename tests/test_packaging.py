"""The `kvpool` wheel is the product: the connector and the operator, no dev tooling.

The test bed, the benchmarks, the demo and the golden/apidoc generators are the `kvpool-dev`
distribution (dev/, package kvpool_dev). Both wheels are built here, offline, from a copy of
the checkout (no stale build/ directory can leak into them), and read as zip files.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path, PurePosixPath

import pytest

REPO = Path(__file__).resolve().parents[1]
DEV_NAMES = ("testbed", "bench", "demo.py", "golden.py", "apidoc.py")
# not sources: the environment, build outputs, caches
SKIP_TOP = {".venv", ".git", "bin", "build", "dist", "out", ".hypothesis", ".pytest_cache", ".cache", ".gl", ".whl"}


def _ignore(directory: str, names: list[str]) -> set[str]:
    skip = {n for n in names if n == "__pycache__" or n.endswith((".egg-info", ".pyc"))}
    if Path(directory).resolve() == REPO:
        skip |= SKIP_TOP & set(names)
    return skip


def build_wheel(tmp: Path, project: str) -> zipfile.ZipFile:
    """`pip wheel` of one project of the checkout (".": kvpool, "dev": kvpool-dev)."""
    src = tmp / "src"
    if not src.exists():
        shutil.copytree(REPO, src, ignore=_ignore, symlinks=True)
    out = tmp / f"wheel-{project.replace('/', '_')}"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "--no-index", "-w", str(out), str(src / project)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = out.glob("*.whl")
    return zipfile.ZipFile(wheel)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, zipfile.ZipFile]:
    tmp = tmp_path_factory.mktemp("packaging")
    return {"kvpool": build_wheel(tmp, "."), "kvpool-dev": build_wheel(tmp, "dev")}


def _packages(names: list[str]) -> set[str]:
    return {PurePosixPath(n).parts[0] for n in names if not PurePosixPath(n).parts[0].endswith(".dist-info")}


def _module_name(path: str) -> tuple[str, bool]:
    """Dotted module name of a .py entry, and whether it is a package's __init__."""
    parts = list(PurePosixPath(path).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts.pop()
    return ".".join(parts), is_package


def imported_modules(source: str, module: str, is_package: bool) -> set[str]:
    """Every module an `import`/`from ... import` anywhere in the source names (relative ones
    resolved against the module's package); strings, such as a lazy dispatch table's, are not imports."""
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}  # `from pkg import submodule`
    return found


def test_the_kvpool_wheel_has_the_product_and_no_dev_tooling(wheels):
    names = wheels["kvpool"].namelist()
    assert _packages(names) == {"kvpool_connector", "kvpool_operator", "kvpool_cli"}
    assert {"kvpool_connector/vllm.py", "kvpool_operator/cli.py", "kvpool_cli/main.py",
            "kvpool_cli/__main__.py"} <= set(names)
    for name in names:
        parts = PurePosixPath(name).parts
        assert "kvpool_dev" not in name, name
        assert not set(parts) & set(DEV_NAMES), f"dev tooling in the kvpool wheel: {name}"


def test_no_product_module_imports_the_dev_tooling_and_the_connector_not_the_operator_or_cli(wheels):
    wheel = wheels["kvpool"]
    checked = 0
    for name in wheel.namelist():
        if not name.endswith(".py") or ".dist-info/" in name:
            continue
        module, is_package = _module_name(name)
        tops = {m.split(".")[0] for m in imported_modules(wheel.read(name).decode(), module, is_package)}
        assert "kvpool_dev" not in tops, f"{module} imports kvpool_dev (only the CLIs name it, as strings)"
        if module.startswith("kvpool_connector"):
            assert not tops & {"kvpool_operator", "kvpool_cli"}, f"{module} imports the operator or the CLI"
        if module.startswith("kvpool_operator"):
            assert "kvpool_cli" not in tops, f"{module} imports the umbrella CLI"
        if module.startswith("kvpool_cli"):
            assert "kvpool_operator" not in tops, f"{module} imports kvpool_operator (its tables name it, as strings)"
        checked += 1
    assert checked > 40


def test_the_console_scripts_are_the_clis(wheels):
    entry_points = next(n for n in wheels["kvpool"].namelist() if n.endswith(".dist-info/entry_points.txt"))
    text = wheels["kvpool"].read(entry_points).decode()
    assert "kvpool = kvpool_cli.main:main" in text and "kvpool-operator = kvpool_operator.cli:main" in text


def test_the_installed_kvpool_command_runs(wheels, tmp_path):
    """The wheel installed alone (no dependencies, no dev tooling) in a fresh venv: its `kvpool`
    script and `python -m kvpool_cli` answer, and the dev commands say what is missing."""
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "env")], check=True, timeout=120)
    python, kvpool = tmp_path / "env" / "bin" / "python", tmp_path / "env" / "bin" / "kvpool"
    proc = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheels["kvpool"].filename],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    env = {"PATH": "/usr/bin:/bin"}  # nothing of this checkout or its venv on any path
    for command in ([str(kvpool), "--help"], [str(python), "-m", "kvpool_cli", "--help"]):
        out = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
        assert out.returncode == 0 and out.stdout.startswith("usage: kvpool <command> [args]"), out
    out = subprocess.run([str(kvpool), "bench", "store"], capture_output=True, text=True, timeout=60, env=env,
                         cwd=tmp_path)
    assert (out.returncode, out.stderr) == (2, "`kvpool bench store` is dev tooling: pip install -e ./dev from a "
                                               "kvpool checkout\n")


def test_the_kvpool_dev_wheel_has_the_dev_tooling_only(wheels):
    names = wheels["kvpool-dev"].namelist()
    assert _packages(names) == {"kvpool_dev"}
    for expected in ("kvpool_dev/__init__.py", "kvpool_dev/testbed/engine.py", "kvpool_dev/bench/e2e_bench.py",
                     "kvpool_dev/demo.py", "kvpool_dev/golden.py", "kvpool_dev/apidoc.py"):
        assert expected in names


# Imported by the connector but brought by the vLLM image it runs in, never installed by kvpool.
FROM_THE_IMAGE = {"vllm", "torch"}


def third_party_imports(package_dir: Path) -> set[str]:
    """Top-level modules outside the standard library and kvpool that a package's code imports."""
    found = set()
    for path in package_dir.rglob("*.py"):
        module = ".".join(path.relative_to(package_dir.parent).with_suffix("").parts)
        found |= {m.split(".")[0] for m in imported_modules(path.read_text(), module, path.name == "__init__.py")}
    return {m for m in found if m and m not in sys.stdlib_module_names and not m.startswith("kvpool")}


def distributions(modules: set[str]) -> set[str]:
    """The (normalised) distributions that install these top-level modules here."""
    from importlib.metadata import packages_distributions

    from packaging.utils import canonicalize_name

    owners = packages_distributions()
    missing = {m for m in modules if m not in owners}
    assert not missing, f"imported but not installed here: {missing}"
    return {canonicalize_name(d) for m in modules for d in owners[m]}


def requirement_names(requirements: list[str]) -> set[str]:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    return {canonicalize_name(Requirement(r).name) for r in requirements}


@pytest.mark.parametrize("extra,package", [("connector", "connector/kvpool_connector"),
                                           ("operator", "operator/kvpool_operator")])
def test_each_extra_lists_what_its_code_imports(extra, package):
    """`pip install kvpool[connector]` (the engine image) and `kvpool[operator]` (the operator
    image) must install every module that code imports, directly, not by luck of another's needs."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = requirement_names(project["dependencies"] + project["optional-dependencies"][extra])
    needed = distributions(third_party_imports(REPO / package) - FROM_THE_IMAGE)
    assert needed - declared == set(), f"kvpool[{extra}] lacks {sorted(needed - declared)}"


def test_requires_python_is_what_the_code_needs():
    """datetime.UTC and tomllib arrived in Python 3.11; both projects must say so."""
    from packaging.specifiers import SpecifierSet

    assert "datetime.UTC" in (REPO / "operator" / "kvpool_operator" / "reconcile" / "handlers.py").read_text()
    for path in (REPO / "pyproject.toml", REPO / "dev" / "pyproject.toml"):
        spec = SpecifierSet(tomllib.loads(path.read_text())["project"]["requires-python"])
        assert "3.11" in spec and "3.10" not in spec, path


def test_every_package_data_glob_matches_a_file():
    """A package-data glob that matches nothing is a dead promise of files the wheel lacks."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = [REPO / where for where in setuptools["packages"]["find"]["where"]]
    for package, globs in setuptools.get("package-data", {}).items():
        for glob in globs:
            matched = any(next(root.rglob(glob), None) for root in roots)
            assert matched, f"package-data {package}: {glob} matches nothing"


def test_dev_version_is_the_main_version():
    main = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    dev = tomllib.loads((REPO / "dev" / "pyproject.toml").read_text())["project"]
    assert dev["name"] == "kvpool-dev" and dev["version"] == main["version"]


def test_the_imports_walker_sees_relative_and_nested_imports():
    src = "from . import a\nfrom ..b import c\ndef f():\n    import kvpool_dev.x\n"
    assert imported_modules(src, "pkg.sub.mod", False) == {"pkg.sub", "pkg.sub.a", "pkg.b", "pkg.b.c",
                                                           "kvpool_dev.x"}
    assert imported_modules('T = {"x": "kvpool_dev.demo"}', "pkg.cli", False) == set()
