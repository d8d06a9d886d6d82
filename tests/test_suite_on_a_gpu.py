"""The suite on a GPU machine: its CPU-interpreter modules leave Triton alone, and its pytest workers run `gpu`
tests one at a time.

Several test modules run Triton kernels on the CPU and set ``TRITON_INTERPRET=1`` at import, before triton
decorates a kernel, where the machine has no ``nvidia-smi``. One that set it unconditionally made every kernel
decorated after its collection an interpreted one on a GPU machine too: ``pytest -m gpu tests`` on an H200 then
failed 711 tests with "Cannot call @triton.jit'd outside of the scope of a kernel" (session 40). Here the modules
that name the variable are imported in a fresh process whose PATH has an ``nvidia-smi``, as a GPU machine's does.

The same run's four workers shared the one GPU and 56 GPU tests failed for memory; ``tests/conftest.py`` now has
the workers take turns at the `gpu` tests (`OneGpuAtATime`). Here a small suite runs under that conftest's hooks
with CUDA reported present (no GPU needed) and records when each of its gpu tests ran, and where.
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


SMALL_SUITE = """
import os, time
import pytest

@pytest.mark.parametrize("i", range(4))
@pytest.mark.gpu
def test_on_the_gpu(i):
    start = time.time()
    time.sleep(0.8)  # each worker starts with two of these: long enough that, unlocked, they overlap
    with open(os.path.join({out!r}, f"gpu-{{i}}"), "w") as f:
        f.write(f"{{os.environ['PYTEST_XDIST_WORKER']}} {{start}} {{time.time()}}")

def test_on_the_cpu():
    pass
"""

SMALL_CONFTEST = """
import pytest
import torch
torch.cuda.is_available = lambda: True  # what a GPU machine reports; nothing here touches a device
{hooks}

def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU")
"""


def _gpu_tests_run(tmp_path: Path, hooks: str) -> list[tuple[str, float, float]]:
    """(worker, start, end) of each gpu test of `SMALL_SUITE` run on two workers under `SMALL_CONFTEST`."""
    suite, out = tmp_path / "suite", tmp_path / "out"
    suite.mkdir(parents=True)
    out.mkdir()
    (suite / "conftest.py").write_text(SMALL_CONFTEST.format(hooks=hooks))
    (suite / "test_small.py").write_text(SMALL_SUITE.format(out=str(out)))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MOE_GPU_TEST_LOCK": str(tmp_path / "gpu.lock")}
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:moe", "-n", "2",
               "--dist", "worksteal", "-q", str(suite)]
    result = subprocess.run(command, env=env, cwd=suite, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    runs = [path.read_text().split() for path in sorted(out.iterdir())]
    assert len(runs) == 4, runs
    return [(worker, float(start), float(end)) for worker, start, end in runs]


def _overlapping(runs: list[tuple[str, float, float]]) -> list[tuple[str, str]]:
    return [(a[0], b[0]) for i, a in enumerate(runs) for b in runs[i + 1:] if a[1] < b[2] and b[1] < a[2]]


def test_gpu_tests_take_turns_across_workers(tmp_path):
    """Under the suite's hooks the two workers each run gpu tests, never two at once; the control, the same suite
    without the hooks, runs them side by side (so the check can fail)."""
    runs = _gpu_tests_run(tmp_path / "locked", "from tests.conftest import pytest_runtest_setup, "
                                                 "pytest_runtest_teardown")
    assert {worker for worker, _, _ in runs} == {"gw0", "gw1"} and _overlapping(runs) == [], runs
    unlocked = _gpu_tests_run(tmp_path / "control", "")
    assert {worker for worker, _, _ in unlocked} == {"gw0", "gw1"} and _overlapping(unlocked), unlocked
