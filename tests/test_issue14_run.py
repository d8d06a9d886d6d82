"""benchmarks/issue14_run.sh (the scoreboard's GPU measurements, step by step) and the other device scripts: every
benchmarks/*.sh parses, and a step the script does not know is refused, naming the steps, before anything runs."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script", sorted((ROOT / "benchmarks").glob("*.sh")), ids=lambda p: p.name)
def test_the_device_scripts_parse(script):
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_issue14_run_refuses_an_unknown_step_naming_the_steps(tmp_path):
    done = subprocess.run(["bash", "benchmarks/issue14_run.sh", "bf17"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "OUT": str(tmp_path)})
    assert done.returncode == 2
    assert "unknown step bf17 (bf16, fp8, weight_only, layer)" in done.stdout
    assert not list((tmp_path / "work").iterdir())  # nothing measured, nothing packed
