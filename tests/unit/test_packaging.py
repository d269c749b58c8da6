"""What gets installed, and which way the imports run.

Installing the project puts one package into site-packages, `updatelens`, with the repository's
top-level folders under it (assets/ -> updatelens.assets, ...): no generic top-level names. Inside,
imports only go down: orchestration -> assets -> reports -> storage -> the engine.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from updatelens import CODE_VERSION
from updatelens.registry import PACKAGED_REGISTRY, REPO_REGISTRY
from updatelens.versions import stage_versions

REPO = Path(__file__).resolve().parents[2]
# lower number = lower layer; a module may import its own layer or any lower one
LAYERS = {"orchestration": 4, "assets": 3, "reports": 2, "storage": 1}
ENGINE = 0


def _layer_of_module(name: str) -> int | None:
    """The layer of an `updatelens.*` module name; None for anything outside the project."""
    parts = name.split(".")
    if parts[0] != "updatelens":
        return None
    return LAYERS.get(parts[1], ENGINE) if len(parts) > 1 else ENGINE


def upward_imports(folder: Path, layer: int) -> list[str]:
    """`file: module` for every import in `folder` of a module in a higher layer."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level
                     else [])
            for name in names:
                target = _layer_of_module(name)
                if target is not None and target > layer:
                    found.append(f"{path.relative_to(REPO)}: {name}")
    return found


def test_imports_only_go_down() -> None:
    folders = {REPO / name: layer for name, layer in LAYERS.items()} | {REPO / "updatelens": ENGINE}
    upward = [hit for folder, layer in folders.items() for hit in upward_imports(folder, layer)]
    assert upward == [], "imports up the layers:\n" + "\n".join(upward)


def test_the_import_check_sees_an_upward_import(tmp_path: Path) -> None:
    (tmp_path / "storage").mkdir()
    (tmp_path / "storage" / "bad.py").write_text("from updatelens.assets.checks import CheckSettings\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys.modules[__name__], "REPO", tmp_path)
        assert upward_imports(tmp_path / "storage", LAYERS["storage"]) == [
            "storage/bad.py: updatelens.assets.checks"]


def test_the_packaged_registry_is_the_repository_registry() -> None:
    """One registry file: the package's is a link to the repository's (the wheel carries its content,
    test below)."""
    assert PACKAGED_REGISTRY.is_symlink() and PACKAGED_REGISTRY.resolve() == REPO_REGISTRY.resolve()
    assert tomllib.loads(PACKAGED_REGISTRY.read_text())["models"]


def test_the_wheel_installs_one_namespace_and_runs_from_outside_the_repository(tmp_path: Path) -> None:
    """Build the wheel, install it (no dependencies: those of this environment serve) into a folder,
    and from a directory outside the repository: the generic names import nothing of ours, the
    project's modules import from the installed copy, and the CLI answers."""
    wheels, site, outside = tmp_path / "wheels", tmp_path / "site", tmp_path / "elsewhere"
    outside.mkdir()
    # built from a copy of the repository's files: a build in the checkout would leave build/ there,
    # and the next build would package whatever it still holds (modules removed since included)
    source = tmp_path / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "data", "*.egg-info", "__pycache__", ".pytest_cache", ".dagster_home", ".mypy_cache",
        ".ruff_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(wheels), str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("updatelens-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"updatelens", wheel.name.split("-")[0] + "-" +
                                                wheel.name.split("-")[1] + ".dist-info"}
    assert "updatelens/assets/checks.py" in names and "updatelens/default_registry.toml" in names
    assert "updatelens/power/calibration-smollm2-135m.json" in names  # the shipped power record (updatelens.power)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop("UPDATELENS_REGISTRY", None)
    probe = """
import importlib.util
for generic in ("assets", "storage", "reports", "orchestration"):
    assert importlib.util.find_spec(generic) is None, generic
import updatelens.assets.checks, updatelens.orchestration.definitions
from updatelens.registry import registry_path
from updatelens import CODE_VERSION
from updatelens.versions import stage_versions
import json
print(updatelens.assets.checks.__file__)
print(registry_path())
print(CODE_VERSION)
print(json.dumps(stage_versions(), separators=(",", ":")))
"""
    out = subprocess.run([sys.executable, "-c", probe], cwd=outside, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    checks_file, registry, installed_version, installed_stages = out.stdout.split()
    assert checks_file.startswith(str(site)) and registry == str(site / "updatelens" / "default_registry.toml")
    installed = Path(registry)  # the link's content, as a file of its own
    assert not installed.is_symlink() and installed.read_text() == REPO_REGISTRY.read_text()
    # the version recorded with every row counts the same sources whether installed or checked out
    assert installed_version == CODE_VERSION
    assert json.loads(installed_stages) == stage_versions()  # and each stage's version the same
    cli = subprocess.run([sys.executable, "-m", "updatelens.orchestration.cli", "--help"], cwd=outside, env=env,
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0 and "usage: updatelens" in cli.stdout, cli.stderr


def test_the_code_version_follows_the_engine_assets_and_storage_not_the_rest(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import updatelens

    for name in updatelens._MAPPED:
        (tmp_path / name).mkdir()
        (tmp_path / name / "mod.py").write_text("X = 1\n")
    monkeypatch.setattr(updatelens, "_mapped_dir", lambda name: tmp_path / name)
    before = updatelens._source_hash()
    (tmp_path / "reports" / "mod.py").write_text("X = 2\n")
    (tmp_path / "orchestration" / "mod.py").write_text("X = 2\n")
    assert updatelens._source_hash() == before  # reports and the CLI do not change stored rows
    (tmp_path / "assets" / "mod.py").write_text("X = 2\n")
    after_assets = updatelens._source_hash()
    (tmp_path / "storage" / "mod.py").write_text("X = 2\n")
    assert len({before, after_assets, updatelens._source_hash()}) == 3


def test_the_code_version_ignores_comments_and_docstrings_but_not_code() -> None:
    """A typo fixed in a comment or a docstring leaves every stored partition current; a changed
    constant or statement does not."""
    from updatelens import _code_of

    base = b'"""Module."""\n\ndef f(x):\n    """Doc."""\n    return x + 1  # add one\n'
    assert _code_of(base) == _code_of(b'"""Modul, fixed."""\n\n\ndef f(x):\n    """Dco."""\n    return x + 1\n')
    assert _code_of(base) != _code_of(base.replace(b"x + 1", b"x + 2"))
    assert _code_of(base) != _code_of(base.replace(b"return x + 1", b"y = x\n    return x + 1"))


def module_imports(folder: Path, package: str) -> dict[str, set[str]]:
    """For each module of `folder` (imported as `package`.<name>): the modules of the same folder it
    imports, at any depth (a function-level import closes a cycle as surely as a top-level one)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(folder.glob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
        graph[path.stem] = {n.removeprefix(package + ".").split(".")[0] for n in names if n.startswith(package + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of `graph`, each as the path that returns to its start."""
    found: list[list[str]] = []

    def walk(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt == path[0]:
                found.append([*path, nxt])
            elif nxt not in path and nxt > path[0]:  # each cycle once, from its smallest module
                walk(nxt, [*path, nxt])

    for start in sorted(graph):
        walk(start, [start])
    return found


def test_the_orchestration_modules_import_without_cycles(tmp_path: Path) -> None:
    graph = module_imports(REPO / "orchestration", "updatelens.orchestration")
    assert "definitions" in graph and "runner" in graph
    assert cycles(graph) == []
    # the check sees a cycle closed inside a function
    (tmp_path / "a.py").write_text("from pkg.b import x\n")
    (tmp_path / "b.py").write_text("def f():\n    from pkg.a import y\n")
    assert cycles(module_imports(tmp_path, "pkg")) == [["a", "b", "a"]]


def test_importing_the_code_location_builds_nothing() -> None:
    """`defs` is Dagster's lazy entry point: the module imports without constructing Definitions
    (workers and tools that import it pay nothing); calling it builds the code location."""
    probe = """
import dagster as dg
built = []
original = dg.Definitions
def counting(*args, **kwargs):
    built.append(1)
    return original(*args, **kwargs)
dg.Definitions = counting
import updatelens.orchestration.definitions as location
assert built == [], built
assert location.defs().resolve_job_def("analyse").name == "analyse"
assert built, "calling defs() builds the definitions"
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
