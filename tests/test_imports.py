"""The import graph of `moe`: one way only. Every ``import`` in moe/ is read from the source -- at the
top of a module and inside functions alike (an import inside a function runs too, just later) -- and
the graph of modules they form must have no cycle. Imports under ``if TYPE_CHECKING:`` never run and
are left out.

    python -m pytest tests/test_imports.py -q      # re-run the check; `module_graph()` is the graph
"""

from __future__ import annotations

import ast
from pathlib import Path

MOE = Path(__file__).resolve().parents[1] / "moe"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(MOE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(MOE.rglob("*.py"))}


def _target(name: str) -> str | None:
    """The module of `moe` that importing ``name`` (a module or a module's attribute) runs."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        if ".".join(parts[:cut]) in MODULES:
            return ".".join(parts[:cut])
    return None


def _imports(module: str) -> dict[str, list[int]]:
    """{imported module of moe: [line, ...]} of every import statement in ``module`` that can run."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: dict[str, list[int]] = {}

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue  # annotations only: never executed
            names = []
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                names = [f"{base}.{alias.name}" for alias in child.names]
            for name in names:
                target = _target(name)
                if target is not None and target != module:
                    found.setdefault(target, []).append(child.lineno)
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def module_graph() -> dict[str, dict[str, list[int]]]:
    return {module: _imports(module) for module in MODULES}


def cycles(graph: dict[str, dict[str, list[int]]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    return found


def test_the_import_graph_has_no_cycle():
    graph = module_graph()
    assert len(graph) > 80 and "moe.platform" in graph["moe.experts.base"]  # the parser sees the imports
    found = cycles(graph)
    detail = [" <-> ".join(c) + ": " + "; ".join(f"{a} -> {b} (line {graph[a][b][0]})" for a in c for b in c
                                                  if b in graph[a]) for c in found]
    assert not found, "import cycles:\n" + "\n".join(detail)


def test_the_cycle_finder_finds_one():
    graph = {"a": {"b": [1]}, "b": {"c": [2]}, "c": {"a": [3]}, "d": {"a": [4]}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_the_library_never_imports_the_tools_and_the_tools_never_the_test_kit():
    graph = module_graph()
    up = {m: sorted(t for t in targets if t.startswith("moe.tools")) for m, targets in graph.items()
          if not m.startswith("moe.tools") and m != "moe.__main__"}  # `python -m moe` runs the command line
    assert not {m: t for m, t in up.items() if t}
    kit = {m: sorted(t for t in targets if t.startswith("moe.testing")) for m, targets in graph.items()
           if m.startswith("moe.tools")}
    assert not {m: t for m, t in kit.items() if t}


def test_the_platform_layer_names_no_backend():
    graph = module_graph()
    assert not [t for t in graph["moe.platform"] if t.startswith(("moe.experts", "moe.prepare_finalize", "moe.registry"))]
