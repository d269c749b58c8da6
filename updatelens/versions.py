"""Each stage's code version: the code that computes its tables, and its inputs' versions.

A stage's version hashes its asset module (`assets/<stage>.py`) and every engine module that module
imports, directly or through other engine modules (the import closure, read from the sources'
syntax trees without importing anything), as syntax trees without comments or docstrings, together
with the versions of the stages it reads. So:

- a fixed typo in a comment, a docstring or a setting's help text changes no version;
- a change to reports, the command line, orchestration or storage changes none (no stage's closure
  holds them: the asset modules' imports of other asset modules and of storage are wiring, not followed);
- a change to the geometry code changes the version of geometry and of what reads its tables (none of
  the stages: the reports and the findings read them) and leaves activations, fits and residuals current;
- a change to the fits changes the fits' version and so every stage that reads them.

Rows record their stage's version (`code_version`), the Dagster assets carry it as their
`code_version` (the UI shows a partition made by another as stale), and `updatelens run`, the registry
sensor and the schedule recompute the stale stages of a layer and the stages that read them.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
from pathlib import Path

from updatelens import __version__, _code_of, _mapped_dir, _memoized
from updatelens.stages import STAGES, Stage

ENGINE = Path(__file__).parent
# folders installed as updatelens.<name>: never followed (wiring, storage, reports, the CLI)
MAPPED = ("assets", "storage", "reports", "orchestration")


def engine_file(module: str, engine: Path = ENGINE) -> Path | None:
    """The engine's source file of `updatelens.<...>` (a module or a package's __init__), or None for
    the package itself, a mapped folder's module or a name that is not a module (an attribute)."""
    parts = module.split(".")
    if parts[0] != "updatelens" or len(parts) == 1 or parts[1] in MAPPED:
        return None
    base = engine.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_modules(source: bytes) -> set[str]:
    """Every `updatelens.*` module a source names in an import, at any depth of the code (imports
    inside functions count): `from updatelens.x import y` names updatelens.x and updatelens.x.y
    (y may be a module or a name in x; `engine_file` keeps the modules)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names if alias.name.startswith("updatelens"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("updatelens"):
            assert node.module is not None
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def computed_code(source: bytes) -> bytes:
    """What a module computes (`_code_of`: no comments, docstrings or layout), also without the help texts
    of the settings (`help=` of `config.setting`): rewording a setting's help changes no result."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setting":
            node.keywords = [k for k in node.keywords if k.arg != "help"]
    return _code_of(ast.unparse(tree).encode())


def closure(start: Path, engine: Path = ENGINE) -> list[Path]:
    """`start` and every engine module it imports, directly or through other engine modules."""
    seen: dict[Path, None] = {start: None}
    todo = [start]
    while todo:
        for name in imported_modules(todo.pop().read_bytes()):
            path = engine_file(name, engine)
            if path is not None and path not in seen and path.name != "versions.py":
                seen[path] = None
                todo.append(path)
    return sorted(seen)


def stage_sources(stage: Stage, engine: Path = ENGINE, assets: Path | None = None) -> list[Path]:
    """The files whose code is the stage's own: its asset module and that module's engine closure."""
    return closure((assets or _mapped_dir("assets")) / f"{stage.name}.py", engine)


# The convention sweep (asset `convention_sweep`, module assets/sweep.py) runs the stages' engine code
# on the stored activations: its version covers its module's closure (which holds that code) and the
# activations' version.
SWEEP_ASSET, SWEEP_MODULE, SWEEP_READS = "convention_sweep", "sweep", ("activations",)


def _version(sources: list[Path], reads: tuple[str, ...], versions: dict[str, str], engine: Path, assets: Path) -> str:
    h = hashlib.sha1()
    for path in sources:
        relative = path.relative_to(assets.parent if path.is_relative_to(assets) else engine.parent)
        h.update(relative.as_posix().encode() + b"\0" + computed_code(path.read_bytes()) + b"\0")
    for read in reads:
        h.update(f"{read}={versions[read]}".encode())
    return f"{__version__}+{h.hexdigest()[:8]}"


def compute_versions(engine: Path = ENGINE, assets: Path | None = None) -> dict[str, str]:
    """{stage: version}, and the convention sweep's, for the sources under `engine` and `assets` (the
    tests point them at a copy)."""
    assets = assets or _mapped_dir("assets")
    versions: dict[str, str] = {}
    for stage in STAGES:  # in order: a stage's inputs come before it
        versions[stage.name] = _version(stage_sources(stage, engine, assets), stage.reads, versions, engine, assets)
    versions[SWEEP_ASSET] = _version(closure(assets / f"{SWEEP_MODULE}.py", engine), SWEEP_READS, versions, engine,
                                     assets)
    return versions


@functools.cache
def stage_versions() -> dict[str, str]:
    """{stage: version}, and the convention sweep's, of this code, kept on disk per exact set of engine
    and asset sources (parsing them costs a fraction of a second; reading them, milliseconds)."""
    assets = _mapped_dir("assets")
    raw = hashlib.sha1(__version__.encode())
    for path in sorted([*ENGINE.rglob("*.py"), *assets.glob("*.py")]):
        raw.update(path.as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return json.loads(_memoized("versions.json", raw.hexdigest(), lambda: json.dumps(compute_versions(ENGINE, assets))))


def stage_version(name: str) -> str:
    return stage_versions()[name]
