"""benchmarks/oracle_levels.py on the committed profiles: the evidence behind the order of `Profile.points`'
measured levels (a sibling's measurement of this shape before this platform's of other shapes)."""

from __future__ import annotations

import statistics

import pytest

from tests.helpers import benchmark_script


@pytest.mark.parametrize("target,source", [("h100", "h200"), ("h200", "h100")])
def test_the_siblings_same_shape_predicts_a_cell_better_than_other_shapes(target, source):
    rows = benchmark_script("oracle_levels").level_rows(target, source, {"triton", "flashinfer_cutlass"})
    assert len(rows) >= 80 and {r["backend"] for r in rows} == {"triton", "flashinfer_cutlass"}
    sibling = statistics.median(abs(r["sibling"] - 1) for r in rows)
    other_shapes = statistics.median(abs(r["other_shapes"] - 1) for r in rows)
    assert sibling < 0.08 and other_shapes > 1.5 * sibling


def test_prints_both_directions(capsys):
    assert benchmark_script("oracle_levels").main([]) == 0
    out = capsys.readouterr().out
    assert "h100, " in out and "h200 at this shape: median |error|" in out and "h100 at this shape" in out
