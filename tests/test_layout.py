"""The package's layout: no import cycle among keras_tfr modules at import time.

Only the imports that run when a module is imported count: module-level ``import`` and
``from ... import`` statements (also inside a module-level ``try``/``if``), but not those
under ``if TYPE_CHECKING:`` nor inside functions, which run later and are the way
keras-tfr keeps heavy or mutual imports out of import time.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "keras_tfr"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _top_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append(node)
            elif isinstance(node, ast.If):
                if not _is_type_checking(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)

    visit(tree.body)
    return found


def _all_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    skip = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and _is_type_checking(node.test)
        for stmt in node.body
        for n in ast.walk(stmt)
    }
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in skip
    ]


@functools.cache
def _tree(path: Path) -> ast.Module:
    """A module's syntax tree, parsed once per test run (three tests walk every module)."""
    return ast.parse(path.read_text(encoding="utf-8"))


def import_graph(deferred: bool = False) -> dict[str, set[str]]:
    """keras_tfr module -> the keras_tfr modules it imports at import time (with
    ``deferred``, also those imported inside functions: who calls whom)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        tree = _tree(path)
        for node in _all_imports(tree) if deferred else _top_level_imports(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:  # relative: from the package of this module
                    package = name.split(".")
                    keep = len(package) - node.level + (1 if is_package else 0)
                    base = ".".join(package[:keep] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                # `from pkg import sub` imports the submodule `pkg.sub` when there is one.
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return cycles


def test_no_import_cycle_among_keras_tfr_modules():
    cycles = find_cycles(import_graph())
    assert cycles == [], "import cycles (top-level imports):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


# With the imports inside functions too (who calls whom), one cycle is left: it closes
# when keras_tfr/read/graph.py and keras_tfr/read/options.py import the split from
# `keras_tfr.read.split` rather than through `keras_tfr.distribute`. It must not grow.
KNOWN_DEFERRED_CYCLE: set[str] = set()


def test_no_new_cycle_through_imports_inside_functions():
    cycles = find_cycles(import_graph(deferred=True))
    assert all(set(c) <= KNOWN_DEFERRED_CYCLE for c in cycles), cycles


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_this_packages_imports():
    graph = import_graph()
    assert "keras_tfr.errors" in graph["keras_tfr.source"]
    # Imports inside functions do not count: the CLI loads TensorFlow only when run.
    assert "keras_tfr.source" not in graph.get("keras_tfr.verifier", set())
