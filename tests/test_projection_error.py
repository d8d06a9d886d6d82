"""benchmarks/projection_error.py on the committed profiles: a machine's measurements carried onto itself come back
exact (so the ratios measure the carrying, nothing else), and the H100 -> H200 rows are the cells both measured."""

from __future__ import annotations

import pytest

from moe.oracle.profile import PROFILE_DIR, load_profile
from tests.helpers import benchmark_script


def test_a_machine_carried_onto_itself_is_exact():
    rows = benchmark_script("projection_error").projection_rows("h200", "h200", {"triton", "flashinfer_cutlass"})
    assert rows and all(r["ratio"] == pytest.approx(1.0, rel=1e-6) for r in rows)


def test_h100_to_h200_rows_are_the_cells_both_measured():
    rows = benchmark_script("projection_error").projection_rows("h100", "h200", {"flashinfer_cutlass"})
    h200 = load_profile(PROFILE_DIR / "measured-h200.yaml")
    assert rows
    for r in rows:
        mine = [e for e in h200.entries if e.measured and (e.backend, e.quant, e.tokens) == (r["backend"], r["quant"],
                r["tokens"]) and e.shape.preset == r["shape"] and e.shape.ep_size == 1]
        assert [e.measured_us for e in mine] == [r["measured_us"]]
        assert r["ratio"] == pytest.approx(r["projected_us"] / r["measured_us"])


def test_no_shared_cell_is_a_clear_error(capsys):
    assert benchmark_script("projection_error").main(["--backends", "no_such_backend"]) == 1
    assert "no cell is measured on both h100 and h200" in capsys.readouterr().err
