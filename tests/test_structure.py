"""The package's import structure, read with the standard library's ``ast``: no import circles, every import points
down the layers (README, "Development"), ``zoo.ops`` is a leaf under the variant layer, and no function hides an
import of the package (the old way of holding a circle open)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Bottom to top; a module may import its own layer and those below. A name covers the module and its submodules.
LAYERS = [
    ("zoo.call", "zoo.reporting", "zoo.data", "zoo.metrics"),
    ("zoo.pattern",),
    ("zoo.ops",),
    ("zoo.cache",),
    ("zoo.modules",),
    ("zoo.variant",),
    ("zoo.registry",),
    ("zoo.variants",),
    ("zoo.plug",),
    ("zoo.convert", "zoo.hub", "zoo.testing"),
    ("zoo.training",),
    ("zoo.bench",),
    ("zoo.eval",),
    ("zoo.retrofit",),
    ("zoo.cli", "zoo.contract", "zoo.interop", "zoo"),
]


def module_files() -> dict[str, Path]:
    files = {}
    for path in (ROOT / "zoo").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for path in (ROOT / "variants").rglob("*.py"):
        parts = ["zoo", "variants", *path.relative_to(ROOT / "variants").with_suffix("").parts]
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


MODULES = module_files()


def imports_of(path: Path) -> list[tuple[str, int, bool]]:
    """(imported zoo module, line, inside a function) for every import statement of the file."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((alias.name, child.lineno, in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                # `from zoo.ops.backends import flex` imports the module zoo.ops.backends.flex (and its packages)
                submodules = [f"{child.module}.{a.name}" for a in child.names if f"{child.module}.{a.name}" in MODULES]
                if len(submodules) < len(child.names):
                    found.append((child.module, child.lineno, in_function))
                found.extend((name, child.lineno, in_function) for name in submodules)
            visit(child, inner)

    visit(ast.parse(path.read_text()), False)
    return [(name, line, inside) for name, line, inside in found if name == "zoo" or name.startswith("zoo.")]


def graph() -> dict[str, set[str]]:
    return {module: {name for name, _, _ in imports_of(path) if name in MODULES and name != module}
            for module, path in MODULES.items()}


def layer_of(module: str) -> int:
    best = None
    for rank, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (best is None or len(name) > len(best[1])):
                best = (rank, name)
    assert best is not None, f"{module} is in no layer of tests/test_structure.py: add it to LAYERS"
    return best[0]


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def connect(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in edges[node]:
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in edges:
        if node not in index:
            connect(node)
    return found


def test_the_package_has_no_import_circle():
    assert circles(graph()) == []


def test_the_circle_finder_finds_one():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_import_points_down_the_layers():
    upward = [f"{module} ({layer_of(module)}) imports {target} ({layer_of(target)})"
              for module, targets in graph().items() for target in targets if layer_of(target) > layer_of(module)]
    assert upward == []


def test_ops_is_a_leaf_that_never_sees_the_variant_layer():
    allowed = ("zoo.call", "zoo.pattern", "zoo.ops")
    bad = [f"{module} imports {target}" for module, targets in graph().items() if module.startswith("zoo.ops")
           for target in targets if not any(target == a or target.startswith(a + ".") for a in allowed)]
    assert bad == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_function_imports_the_package(module):
    hidden = [f"line {line}: {name}" for name, line, inside in imports_of(MODULES[module]) if inside]
    assert hidden == [], f"{module}: import at the top of the module instead"
