"""Imports in the transport half run one way: an AST pass over every ``import`` of ``moe/`` (inside
functions too) shows no transport importing a sibling transport, ``moe.quant`` importing nothing above
it, no function-level import of ``moe`` in the transports, the quantization or the sharding, and no
cycle through them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRANSPORTS = {f"moe.prepare_finalize.{name}" for name in ("local", "batched", "all_to_all", "flashinfer_a2a")}
ONE_WAY = ("moe.prepare_finalize", "moe.quant", "moe.sharding")  # the modules checked, by prefix


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in (ROOT / "moe").rglob("*.py")}


def _imports(path: Path, modules: dict[str, Path]) -> list[tuple[str, bool]]:
    """``(module, inside a function)`` for every import of a ``moe`` module in ``path``."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((alias.name, in_function) for alias in child.names if alias.name in modules)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module in modules:
                # ``from moe.package import submodule`` imports the submodule; other names, the module
                found.extend((f"{child.module}.{a.name}" if f"{child.module}.{a.name}" in modules else child.module,
                              in_function) for a in child.names)
            visit(child, nested)

    visit(ast.parse(path.read_text()), False)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, list[tuple[str, bool]]]:
    modules = _modules()
    return {name: _imports(path, modules) for name, path in modules.items()}


def _checked(name: str) -> bool:
    return name.startswith(ONE_WAY)


def test_no_transport_imports_a_sibling_transport(graph):
    edges = [(m, target) for m in TRANSPORTS for target, _ in graph[m] if target in TRANSPORTS - {m}]
    assert edges == []


def test_quant_imports_nothing_above_it(graph):
    above = [(m, target) for m in graph if m.startswith("moe.quant") for target, _ in graph[m]
             if not target.startswith("moe.quant") and target != "moe.errors"]
    assert above == []


def test_nothing_the_transports_import_imports_them_back(graph):
    """Every module the transports reach (the quantization, the sharding, problem, formats, ...) lies below
    them: none imports a ``moe.prepare_finalize`` module, at the top or inside a function."""
    below, stack = set(), [t for m in graph if m.startswith("moe.prepare_finalize") for t, _ in graph[m]]
    while stack:
        node = stack.pop()
        if node not in below and not node.startswith("moe.prepare_finalize"):
            below.add(node)
            stack += [t for t, _ in graph.get(node, [])]
    back = [(m, target) for m in sorted(below) for target, _ in graph[m] if target.startswith("moe.prepare_finalize")]
    # the registry reads the base class of a class that registers, which has imported that base already
    assert "moe.quant.tensor" in below and back == [("moe.registry", "moe.prepare_finalize.base")]


def test_no_function_level_import_of_moe(graph):
    late = [(m, target) for m in graph if _checked(m) for target, in_function in graph[m] if in_function]
    assert late == []


def test_the_expert_parallel_module_is_gone_and_nothing_imports_it(graph):
    assert "moe.parallel" not in graph
    assert not any(target == "moe.parallel" for edges in graph.values() for target, _ in edges)


def test_no_cycle_runs_through_the_transports_the_quantization_or_the_sharding(graph):
    def reaches(start: str, goal: str) -> bool:
        seen, stack = set(), [t for t, _ in graph[start]]
        while stack:
            node = stack.pop()
            if node == goal:
                return True
            if node not in seen:
                seen.add(node)
                stack += [t for t, _ in graph.get(node, [])]
        return False

    cycles = [m for m in graph if _checked(m) and reaches(m, m)]
    assert cycles == []
