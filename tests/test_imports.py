"""The package's import graph, read from the source: no module of ``kvmove`` imports itself
through others (issue 26: router ↔ planner ↔ routing, metrics ↔ workers, config → planner
were one cycle).

Every ``import kvmove...`` and ``from kvmove... import ...`` counts, wherever it stands: in a
function (a lazy import still ties the two modules together) or under ``if TYPE_CHECKING:``
(the type checker follows it, and a reader must hold both modules to read either). An import
of a package's submodule is an edge to that submodule only, not to the packages above it:
every module runs ``kvmove/__init__.py`` first, which is not a dependency anyone chose.
"""

from __future__ import annotations

import ast
from collections.abc import Collection
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "kvmove"  # the source checked, not an install
Graph = dict[str, set[str]]


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources(root: Path) -> dict[str, Path]:
    """Module name → its file, for every module of the package at ``root``: its ``.py``
    file, or for a compiled one (``kvmove._C``) its stub."""
    stubs = {_module_name(p, root): p for p in sorted(root.rglob("*.pyi"))}
    return stubs | {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def _base(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module ``from <base> import ...`` names, relative ones resolved from ``module``'s
    package (its own, for a package's ``__init__``)."""
    if not node.level:
        return node.module or ""
    package = module.split(".")
    package = package[:len(package) - node.level + (1 if is_package else 0)]
    return ".".join([*package, *([node.module] if node.module else [])])


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool,
              modules: Collection[str]) -> set[str]:
    """The modules of ``modules`` that ``node`` imports: ``import M`` is M; ``from M import
    x`` is ``M.x`` where that is a module, else M (x is a name defined in M)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names} & set(modules)
    base = _base(node, module, is_package)
    names = {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
             for alias in node.names}
    return names & set(modules)


def import_graph(root: Path) -> Graph:
    """Module → the modules of the package at ``root`` that it imports."""
    sources = _sources(root)
    graph: Graph = {}
    for module, path in sources.items():
        is_package = path.stem == "__init__"
        edges = graph.setdefault(module, set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                edges |= _imported(node, module, is_package, sources) - {module}
    return graph


def find_cycle(graph: Graph) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None (a depth-first search that keeps
    the path it is on; a module whose imports are all searched is done)."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                done.add(path.pop())
                stack.pop()
            elif nxt in path:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in done:
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_kvmove_has_no_import_cycle() -> None:
    cycle = find_cycle(import_graph(ROOT))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_a_cycle_through_type_checking_and_lazy_imports_is_found(tmp_path: Path) -> None:
    """The search itself: a package whose cycle closes only under ``TYPE_CHECKING`` and in a
    function, with relative imports, is reported, named module by module."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from . import a\n")
    (package / "sub" / "a.py").write_text("from typing import TYPE_CHECKING\n"
                                           "if TYPE_CHECKING:\n    from pkg.b import B\n")
    (package / "b.py").write_text("def f():\n    from .sub.a import x\n")
    (package / "c.py").write_text("import pkg.b\nimport os\n")
    graph = import_graph(package)
    assert graph == {"pkg": set(), "pkg.sub": {"pkg.sub.a"}, "pkg.sub.a": {"pkg.b"},
                     "pkg.b": {"pkg.sub.a"}, "pkg.c": {"pkg.b"}}
    assert find_cycle(graph) == ["pkg.b", "pkg.sub.a", "pkg.b"]
    (package / "b.py").write_text("import os\n")
    assert find_cycle(import_graph(package)) is None
