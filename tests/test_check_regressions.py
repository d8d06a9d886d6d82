"""benchmarks/check_regressions.py: a bench file against the shipped measured profile of its machine, on the
committed results: session 8's run of the fp8 grouped GEMM before its row-mask fix (1.5x slower than after it),
and session 42's timing of the H100 tables, the newest source of measured-h100.yaml's triton fp8_block and bf16 cells
at M >= 1024 (session 43's decode run holds M <= 256)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from moe.errors import MoEConfigError
from tests.helpers import benchmark_script

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BEFORE = RESULTS / "fp8_vs_bf16_qwen3_before_mask_fix_nvidia-h100.json"
AFTER = RESULTS / "fp8_vs_bf16_qwen3-30b-a3b_mask_fix_nvidia-h100.json"
NEWEST = RESULTS / "h100_tables_s42_nvidia-h100.json"  # four presets' triton bf16 / fp8_block at M = 128-16384


@pytest.fixture(scope="module")
def check():
    return benchmark_script("check_regressions")


def records(path: Path) -> list[dict]:
    return json.loads(path.read_text())["records"]


def newest_us(preset: str, quant: str, tokens: int) -> float:
    return next(r["us"] for r in records(NEWEST) if (r["preset"], r["quant"], r["tokens"]) == (preset, quant, tokens))


def test_flags_the_fp8_slowdown_before_the_fix(check):
    cells = check.compare(records(BEFORE), "nvidia-h100")
    slow = check.regressions(cells, 0.15)
    assert {(c.quant, c.tokens) for c in slow} == {("fp8_block", 4096), ("fp8_block", 16384)}
    for c in slow:  # against the newest measurement of the cell, session 42's
        assert "h100_tables_s42" in c.source
        assert c.ratio == pytest.approx(c.new_us / newest_us(c.preset, c.quant, c.tokens)) and c.ratio > 1.5
    # every cell compared: the fp8 decode ones (M = 1, 4, 16; the older H100 records of them predate the fp8 decode
    # tiles and are superseded in make_measured_profile.py) against session 43's run of the decode tiles
    assert len(cells) == 12 and all(c.profile_us is not None for c in cells)
    decode = [c for c in cells if c.quant == "fp8_block" and c.tokens <= 16]
    assert sorted(c.tokens for c in decode) == [1, 4, 16] and all("decode_s43" in c.source for c in decode)


def test_the_newest_run_is_the_profile_itself(check):
    """Session 42's run is the profile at each of its cells but one: the slice's fp8_block at M = 256, which session
    43's decode run timed again (641.3 against 647.6 us) and which the profile takes from it."""
    cells = check.compare(records(NEWEST), "nvidia-h100")
    again = [c for c in cells if "decode_s43" in c.source]
    assert [(c.preset, c.quant, c.tokens) for c in again] == [("deepseek-v3-ep8-slice", "fp8_block", 256)]
    assert again[0].ratio == pytest.approx(647.6 / 641.3, abs=1e-3)
    assert len(cells) == 27 and all(c.ratio == pytest.approx(1.0) for c in cells if c not in again)
    assert check.regressions(cells, 0.0) == again


def test_the_row_mask_fix_run_is_now_slower_than_the_current_tiles(check):
    """Session 8's fixed pointer kernel, against a profile that holds session 42's timing of the warp-specialized
    tiles: its fp8 cells from M = 4096 are the regression the check exists to catch, had those tiles been lost."""
    slow = check.regressions(check.compare(records(AFTER), "nvidia-h100"), 0.15)
    assert {(c.quant, c.tokens) for c in slow} == {("fp8_block", 4096), ("fp8_block", 16384)}


def test_main_exit_status_and_table(check, capsys):
    assert check.main([str(BEFORE), "--machine", "nvidia-h100"]) == 1
    out = capsys.readouterr().out
    assert out.count("REGRESSED") == 2 and "2 of 12 cells slower than measured-h100.yaml by more than 15%" in out
    assert out.splitlines()[2].startswith("| qwen3-30b-a3b | fp8_block | 4096 |")  # regressions first
    assert check.main([str(NEWEST), "--machine", "nvidia-h100"]) == 0
    # a looser tolerance lets the 2.06x and 2.22x (against session 42's run) through
    assert check.main([str(BEFORE), "--machine", "nvidia-h100", "--tolerance", "1.25"]) == 0
    assert check.main([str(BEFORE), "--machine", "nvidia-h100", "--tolerance", "1.2"]) == 1


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
