"""benchmarks/decode_tables_ab.py's sides on a CPU: each replaces the experts' fp8 decode choice while its block
runs and puts it back whatever the block does; an unknown side is refused, naming it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from moe.experts import triton as triton_experts  # noqa: E402
from moe.experts._triton import decode  # noqa: E402
from moe.experts._triton.config import ConfigTable  # noqa: E402
from tests.helpers import benchmark_script  # noqa: E402

TABLE = ConfigTable(None, (), ((4, "grouped"),))  # a table whose decode section sends M >= 4 to the grouped GEMMs


def test_each_side_decides_as_it_says_and_the_experts_get_their_own_back():
    side = benchmark_script("decode_tables_ab").side
    own = triton_experts.fp8_decode_config
    assert own(4, TABLE) is None and own(2, TABLE) == decode.fp8_decode_config(2)
    with side("table"):
        assert triton_experts.fp8_decode_config is own
    with side("shared"):
        assert triton_experts.fp8_decode_config(4, TABLE) == decode.fp8_decode_config(4) is not None
    with pytest.raises(RuntimeError):
        with side("grouped"):
            assert triton_experts.fp8_decode_config(2, TABLE) is None
            raise RuntimeError("a failing timing")
    assert triton_experts.fp8_decode_config is own


def test_an_unknown_side_is_refused_naming_it():
    with pytest.raises(ValueError, match="side must be one of table, shared, grouped .got 'fused'."):
        with benchmark_script("decode_tables_ab").side("fused"):
            pass
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "decode_tables_ab.py"
    done = subprocess.run([sys.executable, str(script), "qwen3-30b-a3b", "1", "table,fused"], capture_output=True,
                          text=True, timeout=300, cwd=script.parents[1], env={"PYTHONPATH": str(script.parents[1])})
    assert done.returncode != 0
    assert "side must be one of table, shared, grouped (got 'fused')" in done.stderr
