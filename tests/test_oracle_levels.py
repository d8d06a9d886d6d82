"""benchmarks/oracle_levels.py on the committed profiles: the evidence behind the order of `Profile.points'
measured levels (a sibling's measurement of this shape before this platform's of other shapes), and the cells where
the sibling's projection (its efficiency against this platform's ceilings) is known to be off."""

from __future__ import annotations

import statistics

import pytest

from tests.helpers import benchmark_script

DIRECTIONS = [("h100", "h200"), ("h200", "h100")]


def fp4_decode(row: dict) -> bool:
    """Our MXFP4 / NVFP4 decode kernels (M <= 64): issue-bound (ncu, session 37), so an H100 runs them about as fast
    as an H200 rather than at its bandwidth's share."""
    return row["backend"] == "triton" and row["quant"] in ("mxfp4", "nvfp4") and row["tokens"] <= 64


def median_error(rows: list[dict], key: str) -> float:
    return statistics.median(abs(r[key] - 1) for r in rows)


@pytest.mark.parametrize("target,source", DIRECTIONS)
def test_the_siblings_same_shape_predicts_a_cell_better_than_other_shapes(target, source):
    rows = benchmark_script("oracle_levels").level_rows(target, source, {"triton", "flashinfer_cutlass"})
    assert len(rows) >= 80 and {r["backend"] for r in rows} == {"triton", "flashinfer_cutlass"}
    assert median_error(rows, "sibling") < median_error(rows, "other_shapes")  # every cell: the level order holds
    rest = [r for r in rows if not fp4_decode(r)]  # where the time scales with the ceilings
    assert len(rest) >= 80
    sibling, other_shapes = median_error(rest, "sibling"), median_error(rest, "other_shapes")
    assert sibling < 0.08 and other_shapes > 1.5 * sibling


@pytest.mark.parametrize("target,source", DIRECTIONS)
def test_the_fp4_decode_cells_do_not_scale_with_the_bandwidth(target, source):
    """The sibling level's known miss: projected by the bandwidths' ratio (4.2 against 3.0 TB/s), our fp4 decode
    cells come out about 28% slow on the H100 and as much fast on the H200 (session 43's H100 runs of them against the
    H200's). A projection that kept their time not spent on bytes would close this."""
    rows = [r for r in benchmark_script("oracle_levels").level_rows(target, source, {"triton"}) if fp4_decode(r)]
    assert len(rows) >= 30
    ratio = statistics.median(r["sibling"] for r in rows)
    assert ratio > 1.2 if target == "h100" else ratio < 1 / 1.2


def test_prints_both_directions(capsys):
    assert benchmark_script("oracle_levels").main([]) == 0
    out = capsys.readouterr().out
    assert "h100, " in out and "h200 at this shape: median |error|" in out and "h100 at this shape" in out
