"""benchmarks/check_regressions.py: a bench file against the shipped measured profile of its machine, on the
committed session-8 results (the fp8 grouped GEMM's 1.5x slowdown before the row-mask fix, and after it)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from moe.errors import MoEConfigError

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BEFORE = RESULTS / "fp8_vs_bf16_qwen3_before_mask_fix_nvidia-h100.json"
AFTER = RESULTS / "fp8_vs_bf16_qwen3-30b-a3b_mask_fix_nvidia-h100.json"


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("check_regressions", ROOT / "benchmarks" / "check_regressions.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up while being defined
    spec.loader.exec_module(module)
    return module


def records(path: Path) -> list[dict]:
    return json.loads(path.read_text())["records"]


def test_flags_the_fp8_slowdown_before_the_fix(check):
    cells = check.compare(records(BEFORE), "nvidia-h100")
    slow = check.regressions(cells, 0.15)
    assert {(c.quant, c.tokens) for c in slow} == {("fp8_block", 4096), ("fp8_block", 16384)}
    assert all(1.45 < c.ratio < 1.55 and "mask_fix" in c.source for c in slow)
    assert len(cells) == 12 and all(c.profile_us is not None for c in cells)  # every cell compared


def test_the_fixed_run_is_the_profile_itself(check):
    cells = check.compare(records(AFTER), "nvidia-h100")
    assert cells and all(c.ratio == pytest.approx(1.0) for c in cells)
    assert check.regressions(cells, 0.0) == []


def test_main_exit_status_and_table(check, capsys):
    assert check.main([str(BEFORE), "--machine", "nvidia-h100"]) == 1
    out = capsys.readouterr().out
    assert out.count("REGRESSED") == 2 and "2 of 12 cells slower than measured-h100.yaml by more than 15%" in out
    assert out.splitlines()[2].startswith("| qwen3-30b-a3b | fp8_block | 4096 |")  # regressions first
    assert check.main([str(AFTER), "--machine", "nvidia-h100"]) == 0
    # a looser tolerance lets the 1.5x through
    assert check.main([str(BEFORE), "--machine", "nvidia-h100", "--tolerance", "0.6"]) == 0


def test_a_cell_without_a_measurement_is_new(check, tmp_path):
    record = dict(records(AFTER)[0], tokens=3)  # the profile has no M = 3
    cell, = check.compare([record], "nvidia-h100")
    assert cell.profile_us is None and cell.ratio is None and check.regressions([cell], 0.15) == []
    assert "| new |" in check.table([cell], 0.15)


def test_bad_input_is_named(check, tmp_path):
    with pytest.raises(MoEConfigError, match=r"--machine must be one of .*nvidia-h100.*got 'a100'"):
        check.compare(records(AFTER), "a100")
    with pytest.raises(MoEConfigError, match=r"tolerance must be in \[0, 10\).*got -0.1"):
        check.regressions([], -0.1)
    with pytest.raises(MoEConfigError, match="bench_json .*missing.json' is not a file"):
        check.main([str(tmp_path / "missing.json"), "--machine", "nvidia-h100"])
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"records": []}))
    with pytest.raises(MoEConfigError, match="holds no 'records'"):
        check.main([str(empty), "--machine", "nvidia-h100"])


def test_runs_as_a_script(tmp_path):
    import subprocess  # noqa: PLC0415

    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "check_regressions.py"), str(BEFORE),
                          "--machine", "nvidia-h100"], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 1 and "REGRESSED" in run.stdout, run.stderr
