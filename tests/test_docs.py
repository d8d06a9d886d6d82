"""The docs stay true: the generated support table is current, and every symbol, import and path the
backend-author page names exists."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# each page, with a symbol and a path it names (proof that the parsers see the page's content)
PAGES = {
    ROOT / "docs" / "writing-a-backend.md": ("moe.testing.check_experts", "examples/plugin_backend/"),
    ROOT / "docs" / "architecture.md": ("moe.compose.composition_problems", "examples/plugin_backend/"),
    ROOT / "README.md": ("moe.SlowPathWarning", "moe/presets/*.yaml"),
    ROOT / "benchmarks" / "README.md": ("moe.tools.bench_report.format_targets", "moe/tools/bench.py"),
}
# backticked dotted names that are not Python symbols: the entry-point group
NOT_SYMBOLS = {"moe.backends"}
_INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
_DOTTED = re.compile(r"\bmoe(?:\.[A-Za-z_]\w*)+")
_FENCE = re.compile(r"```python\n(.*?)```", re.S)
_IMPORT = re.compile(r"^\s*from (moe[\w.]*) import ([^#\n]+)", re.M)
_PATH = re.compile(r"^(?:examples|docs|tests|moe|benchmarks)/[\w./*-]*$")
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def resolve(dotted: str) -> object:
    """Imports the longest importable module prefix of ``dotted`` and walks the rest as attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def named_symbols(text: str) -> set[str]:
    names = {m.group(0) for span in _INLINE.findall(text) for m in _DOTTED.finditer(span)}
    for block in _FENCE.findall(text):
        for module, imported in _IMPORT.findall(block):
            names |= {f"{module}.{name.strip()}" for name in imported.split(",")}
    return names - NOT_SYMBOLS


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_named_symbol_imports(page):
    names = named_symbols(page.read_text())
    assert PAGES[page][0] in names  # the parser sees the page's central symbol
    missing = []
    for name in sorted(names):
        try:
            resolve(name)
        except (ImportError, AttributeError) as error:
            missing.append(f"{name}: {error}")
    assert not missing, f"{page.name} names symbols that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_named_path_exists(page):
    text = page.read_text()
    paths = {span for span in _INLINE.findall(text) if _PATH.match(span)}
    paths |= {link for link in _LINK.findall(text) if not link.startswith(("http://", "https://", "#"))}
    assert PAGES[page][1] in paths
    assert not [p for p in sorted(paths) if not _exists(page.parent, p)]


def _exists(folder: Path, path: str) -> bool:
    """A path relative to the repository root or to the page's folder (a markdown link); globs allowed."""
    return any(any(base.glob(path)) if "*" in path else (base / path).exists() for base in (ROOT, folder))


def test_support_table_is_generated_from_the_declarations():
    """Run like a user would, in a clean process (the Triton interpreter flag changes declarations)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "moe.tools.docs", "--check"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr + done.stdout


def test_stale_table_is_detected_and_rewritten(tmp_path):
    from moe.tools import docs

    page = tmp_path / "page.md"
    page.write_text(f"intro\n{docs.BEGIN}\n| old | table |\n{docs.END}\nend\n")
    assert docs.main(["--check", "--page", str(page)]) == 1
    assert docs.main(["--page", str(page)]) == 0
    text = page.read_text()
    assert "| old | table |" not in text and "| reference |" in text and text.endswith(f"{docs.END}\nend\n")
    assert docs.main(["--check", "--page", str(page)]) == 0


def test_the_checker_catches_a_renamed_symbol():
    assert named_symbols("see `moe.testing.check_experts_v2(cls)` and `pip install x`") == {"moe.testing.check_experts_v2"}
    with pytest.raises(AttributeError):
        resolve("moe.testing.check_experts_v2")
