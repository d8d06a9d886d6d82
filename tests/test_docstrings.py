"""What the docstrings and comments of moe/ cite exists: every backticked ``moe.x.y`` name imports, every
path into this repository (``moe/quant/tensor.py``, ``_triton/gemm.py``, ``oracle/profiles/*.yaml``) is
there, and every module a package's docstring lists (its layout table) is a module of that package.
The pages under docs/ and README.md are checked the same way by tests/test_docs.py.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

from tests.test_docs import NOT_SYMBOLS, resolve

ROOT = Path(__file__).resolve().parents[1]
MOE = ROOT / "moe"
_TICKED = re.compile(r"``([^`\n]+)``|(?<!`)`([^`\n]+)`(?!`)")
_DOTTED = re.compile(r"\bmoe(?:\.[A-Za-z_]\w*)+")
_PATH = re.compile(r"(?<![\w./*-])((?:[\w.*-]+/)+[\w.*-]+\.(?:py|yaml|json|md|sh|toml))\b")
_MODULE = re.compile(r"(?<![\w./-])(\w+\.py)\b")
# folders of this repository a cited path may start with; a path starting elsewhere is another
# project's (``flashinfer/tllm_enums.py``, transformers' ``models/mixtral/modeling_mixtral.py``)
OURS = {"moe", "tests", "docs", "benchmarks", "examples"} | {p.name for p in MOE.rglob("*") if p.is_dir()}
# stale citations in files another change owns, each to be fixed there: the test fails when one is
# fixed (so the entry goes) as well as when a new one appears
KNOWN_STALE: set[str] = set()  # citations known to be stale, each with its reason; none today


def comments_and_docstrings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every docstring (module, class, function) and every comment of ``path``."""
    source = path.read_text()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                found.append((node.body[0].lineno, doc))
    found += [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
              if tok.type == tokenize.COMMENT]
    return found


def cited_names(text: str) -> set[str]:
    return {m.group(0) for ticked in _TICKED.finditer(text) for m in _DOTTED.finditer(ticked.group(1) or ticked.group(2))}


def cited_paths(text: str) -> set[str]:
    return {p for p in _PATH.findall(text) if p.split("/")[0] in OURS}


def _exists(path: str, folder: Path) -> bool:
    """``path`` relative to the repository, to moe/, or to the citing file's folder or one above it."""
    bases = [ROOT, MOE, folder, *folder.parents]
    return any(any(base.glob(path)) if "*" in path else (base / path).exists() for base in bases)


def stale_citations(path: Path) -> list[str]:
    """``"<file>: <what> <citation> (line N)"`` for each citation of ``path`` that does not exist."""
    rel = path.relative_to(ROOT).as_posix()
    stale = []
    for line, text in comments_and_docstrings(path):
        for name in sorted(cited_names(text) - NOT_SYMBOLS):
            try:
                resolve(name)
            except (ImportError, AttributeError):
                stale.append((f"{rel}: name {name}", line))
        stale += [(f"{rel}: path {p}", line) for p in sorted(cited_paths(text)) if not _exists(p, path.parent)]
        if path.name == "__init__.py" and line == 1:  # a package's docstring: its layout listing
            stale += [(f"{rel}: module {m}", line) for m in sorted(set(_MODULE.findall(text)))
                      if not (path.parent / m).exists()]
    return [f"{what} (line {line})" for what, line in stale]


def test_every_citation_in_moe_exists():
    found = [entry for path in sorted(MOE.rglob("*.py")) for entry in stale_citations(path)]
    unexpected = [entry for entry in found if entry.rsplit(" (line", 1)[0] not in KNOWN_STALE]
    assert not unexpected, "docstrings or comments cite what does not exist:\n" + "\n".join(unexpected)
    fixed = KNOWN_STALE - {entry.rsplit(" (line", 1)[0] for entry in found}
    assert not fixed, f"fixed, so remove from KNOWN_STALE: {sorted(fixed)}"


@pytest.mark.parametrize("text,kind", [
    ('"""Calls `moe.registry.register_backend` first."""', "name moe.registry.register_backend"),
    ("# the table lives in ``moe/oracle/profiles/bench.yaml``", "path moe/oracle/profiles/bench.yaml"),
    ('"""See _triton/gemm_v2.py."""', "path _triton/gemm_v2.py"),
])
def test_the_checker_catches_a_stale_citation(tmp_path, monkeypatch, text, kind):
    """A renamed symbol, a missing repository path and a package-relative one, each in a file of moe/."""
    monkeypatch.setattr("tests.test_docstrings.ROOT", tmp_path)
    module = tmp_path / "moe" / "experts" / "probe.py"
    module.parent.mkdir(parents=True)
    module.write_text(text + "\n")
    assert [entry.rsplit(" (line", 1)[0] for entry in stale_citations(module)] == [f"moe/experts/probe.py: {kind}"]


def test_a_package_docstring_lists_only_its_modules(tmp_path, monkeypatch):
    monkeypatch.setattr("tests.test_docstrings.ROOT", tmp_path)
    package = tmp_path / "moe" / "pkg"
    package.mkdir(parents=True)
    (package / "there.py").write_text("")
    (package / "__init__.py").write_text('"""Layout::\n\n    there.py   x\n    gone.py    y\n"""\n')
    assert [e.rsplit(" (line", 1)[0] for e in stale_citations(package / "__init__.py")] == ["moe/pkg/__init__.py: module gone.py"]


def test_external_and_example_paths_are_not_ours():
    assert cited_paths("see flashinfer/tllm_enums.py and models/mixtral/modeling_mixtral.py") == set()
    assert cited_paths("in `_triton/gemm.py` and moe/oracle/profiles/*.yaml") == {"_triton/gemm.py",
                                                                                 "moe/oracle/profiles/*.yaml"}
