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
PAGES = [ROOT / "docs" / "writing-a-backend.md"]
# backticked dotted names that are not Python symbols: the entry-point group
NOT_SYMBOLS = {"moe.backends"}
_INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
_DOTTED = re.compile(r"\bmoe(?:\.[A-Za-z_]\w*)+")
_FENCE = re.compile(r"```python\n(.*?)```", re.S)
_IMPORT = re.compile(r"^\s*from (moe[\w.]*) import ([^#\n]+)", re.M)
_PATH = re.compile(r"^(?:examples|docs|tests|moe)/[\w./-]*$")


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
    assert "moe.testing.check_experts" in names  # the parser sees the page's central symbol
    missing = []
    for name in sorted(names):
        try:
            resolve(name)
        except (ImportError, AttributeError) as error:
            missing.append(f"{name}: {error}")
    assert not missing, f"{page.name} names symbols that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_named_path_exists(page):
    paths = {span for span in _INLINE.findall(page.read_text()) if _PATH.match(span)}
    assert "examples/plugin_backend/" in paths
    assert not [p for p in sorted(paths) if not (ROOT / p).exists()]


def test_support_table_is_generated_from_the_declarations():
    """Run like a user would, in a clean process (the Triton interpreter flag changes declarations)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "moe.testing.docs", "--check"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr + done.stdout


def test_stale_table_is_detected_and_rewritten(tmp_path):
    from moe.testing import docs

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
