"""The suite's CPU-interpreter modules leave a GPU machine's Triton alone.

Several test modules run Triton kernels on the CPU and set ``TRITON_INTERPRET=1`` at import, before triton
decorates a kernel, where the machine has no ``nvidia-smi``. One that set it unconditionally made every kernel
decorated after its collection an interpreted one on a GPU machine too: ``pytest -m gpu tests`` on an H200 then
failed 711 tests with "Cannot call @triton.jit'd outside of the scope of a kernel" (session 40). Here the modules
that name the variable are imported in a fresh process whose PATH has an ``nvidia-smi``, as a GPU machine's does.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

IMPORT_ALL = """
import importlib, json, os, sys
sys.path.insert(0, {root!r})
for name in {modules!r}:
    try:
        importlib.import_module("tests." + name)
    except BaseException:  # a module-level pytest.skip, or an optional library missing: it ran up to there
        pass
print(json.dumps(os.environ.get("TRITON_INTERPRET")))
"""


def _interpreter_modules() -> list[str]:
    return sorted(path.stem for path in (ROOT / "tests").glob("test_*.py")
                  if path.name != Path(__file__).name and "TRITON_INTERPRET" in path.read_text())


def _triton_interpret_after_importing(modules: list[str], tmp_path: Path, with_nvidia_smi: bool) -> str | None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if with_nvidia_smi:
        fake = bin_dir / "nvidia-smi"
        fake.write_text("#!/bin/sh\nexit 0\n")
        fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    result = subprocess.run([sys.executable, "-c", IMPORT_ALL.format(root=str(ROOT), modules=modules)], env=env,
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_no_test_module_turns_the_interpreter_on_where_there_is_a_gpu(tmp_path):
    modules = _interpreter_modules()
    assert "test_routing_kernel" in modules and "test_triton_decode" in modules, modules
    assert _triton_interpret_after_importing(modules, tmp_path, with_nvidia_smi=True) is None


def test_without_a_gpu_the_same_modules_turn_it_on(tmp_path):
    """The control: the same imports on a machine with no nvidia-smi set it, so the check above can fail."""
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has an nvidia-smi on PATH")
    assert _triton_interpret_after_importing(_interpreter_modules(), tmp_path, with_nvidia_smi=False) == "1"
