"""Types across the folders (`make lint`): mypy over the package as it is installed.

The top-level folders assets/, storage/, reports/ and orchestration/ are installed as
`updatelens.<name>` (pyproject.toml's package-dir). mypy does not follow that mapping, so checked in
place each folder would be a package of its own and every call between them unchecked. Here mypy
reads a tree of symbolic links laid out as the installed package (`<tree>/updatelens/` holds the
engine's files and a link per mapped folder, `<tree>/bench` links the benchmarks) and its messages
name the repository's own paths again.

    python -m tests.typecheck            # the repository (exit status: mypy's)
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAPPED = ("assets", "storage", "reports", "orchestration")
TREE = REPO / "build" / "typecheck"


def build_tree(repo: Path, tree: Path, planted: dict[str, str] | None = None) -> Path:
    """Lay out `tree` as the installed package, each entry a link into `repo`; `planted` adds modules
    of its own to the mapped folders ({"reports/planted.py": source}: a test's planted fault)."""
    planted = planted or {}
    if tree.exists():
        shutil.rmtree(tree)
    package = tree / "updatelens"
    package.mkdir(parents=True)
    for entry in sorted((repo / "updatelens").iterdir()):
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for name in MAPPED:
        folder = repo / name
        if any(key.startswith(f"{name}/") for key in planted):  # a folder with a planted module: link file by file
            (package / name).mkdir()
            for file in folder.glob("*.py"):
                (package / name / file.name).symlink_to(file)
        else:
            (package / name).symlink_to(folder)
    for relative, source in planted.items():
        (package / relative).write_text(source)
    (tree / "bench").symlink_to(repo / "bench")
    return tree


def check(repo: Path = REPO, tree: Path = TREE, planted: dict[str, str] | None = None,
          targets: tuple[str, ...] = ("updatelens", "bench")) -> subprocess.CompletedProcess[str]:
    """mypy over the tree (`targets`, paths in it) with the repository's settings; its output with
    the repository's paths."""
    build_tree(repo, tree, planted)
    done = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(repo / "pyproject.toml"),
                           "--cache-dir", str(tree.parent / f"{tree.name}-cache"), *targets],
                          cwd=tree, capture_output=True, text=True)
    mapped = "|".join(MAPPED)
    text = re.sub(rf"(?m)^updatelens/({mapped})/", r"\1/", done.stdout + done.stderr)
    return subprocess.CompletedProcess(done.args, done.returncode, text, "")


def main() -> int:
    done = check()
    print(done.stdout, end="")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
