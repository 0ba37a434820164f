"""Counts of the package's structure, read with the ast reading of ``tests/test_structure.py``: modules, the largest
ones, import arrows within and between folders, import circles and back-arrows (imports up the layers).

Usage: python scripts/structure_counts.py [ROOT]   (ROOT: a checkout, default this one; e.g. a `git worktree` of an
older commit, to compare before and after a restructure). Prints one markdown table.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def load_structure(root: Path):
    spec = importlib.util.spec_from_file_location("structure_of_checkout", root / "tests" / "test_structure.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def folder_of(module: str, modules: dict) -> str:
    """The folder a module lives in: its package (``zoo.cache.windowed`` -> ``zoo.cache``; ``zoo.call`` -> ``zoo``)."""
    is_package = modules[module].name == "__init__.py"
    return module if is_package else module.rpartition(".")[0]


def counts(root: Path) -> dict[str, str]:
    structure = load_structure(root)
    modules, edges = structure.MODULES, structure.graph()
    lines = {name: len(path.read_text().splitlines()) for name, path in modules.items()}
    largest = sorted(lines.items(), key=lambda item: -item[1])[:3]
    between = sum(folder_of(a, modules) != folder_of(b, modules) for a, targets in edges.items() for b in targets)
    total = sum(len(targets) for targets in edges.values())
    back = sum(structure.layer_of(b) > structure.layer_of(a) for a, targets in edges.items() for b in targets)
    return {
        "modules": str(len(modules)),
        "modules over 600 lines": str(sum(n > 600 for n in lines.values())),
        "largest modules": ", ".join(f"{name} ({n})" for name, n in largest),
        "import arrows (between folders / all)": f"{between} / {total}",
        "import circles": str(len(structure.circles(edges))),
        "back-arrows (up the layers)": str(back),
    }


def main(argv: list[str]) -> None:
    root = Path(argv[0]).resolve() if argv else Path(__file__).resolve().parents[1]
    print(f"| {root} | |\n|---|---|")
    for key, value in counts(root).items():
        print(f"| {key} | {value} |")


if __name__ == "__main__":
    main(sys.argv[1:])
