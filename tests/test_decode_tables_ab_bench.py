"""benchmarks/decode_tables_ab.py on a CPU (Triton's interpreter): each side replaces the experts' decode choices (fp8's
and the weight-only formats') while its block runs and puts it back whatever the block does; `time_sides` runs every side on `moe bench`'s calls,
alternating, and compares each output with the table's; an unknown side is refused, naming it."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

if not shutil.which("nvidia-smi"):  # a CPU machine: the interpreter, before triton decorates any kernel
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from moe.experts import triton as triton_experts  # noqa: E402
from moe.experts._triton import decode  # noqa: E402
from moe.experts._triton.config import ConfigTable  # noqa: E402
from moe.experts.triton import TritonExperts  # noqa: E402
from moe.tools.bench import backend_calls  # noqa: E402
from tests.helpers import benchmark_script  # noqa: E402
from tests.test_triton import make_problem, make_topk, make_weights  # noqa: E402

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


def test_the_sides_decide_for_the_weight_only_formats_too():
    """The weight-only lookup (by rows per expert, then the table) is swapped with fp8's: ``shared`` reads the bucket
    whatever the table says, ``grouped`` runs no decode kernels, and the experts get their own back."""
    from moe.experts._triton.config import ConfigKey

    side = benchmark_script("decode_tables_ab").side
    own = triton_experts.decode_config
    entry = dataclasses.asdict(decode.mma_tile(16, 1, 4, finish=True))
    table = ConfigTable.from_json(ConfigKey(128, 8, 2048, 768, "silu", "nvfp4", "standard", "NVIDIA H200"),
                                  {"configs": {}, "decode": {"1": {"gemm1": entry, "gemm2": entry}}})
    assert own(0.0625, 1, table).gemm1 == decode.mma_tile(16, 1, 4, finish=True)
    with side("shared"):
        assert triton_experts.decode_config(0.0625, 1, table) == decode.decode_config(0.0625)
    with side("grouped"):
        assert triton_experts.decode_config(0.0625, 1, table) is None
    with side("per_expert"):  # the table's tiles, finishing nowhere: their programs group by expert
        config = triton_experts.decode_config(0.0625, 1, table)
        assert config.gemm1 == decode.mma_tile(16, 1, 4) == config.gemm2 and not config.per_slot
        assert config.fallback == decode.decode_config(0.0625).fallback  # FMA tiles keep theirs
    with side("unpredicated"):  # the table's tiles, their weight loads with no predicate
        config = triton_experts.decode_config(0.0625, 1, table)
        assert config.gemm1 == dataclasses.replace(decode.mma_tile(16, 1, 4, finish=True), unpredicated=True)
        assert config.fallback == decode.decode_config(0.0625).fallback
    with side("predicated"):
        assert triton_experts.decode_config(0.0625, 1, table) == own(0.0625, 1, table)
    assert own(0.0625, 1, table).per_slot
    assert triton_experts.decode_config is own


def test_the_load_sides_switch_the_mma_tiles_only():
    """``unpredicated`` sets `DecodeTile.unpredicated` on MMA tiles (the only ones it applies to) and ``predicated``
    clears it; other tiles, and a config of None (grouped), pass through."""
    loads = benchmark_script("decode_tables_ab").loads
    mma = decode.mma_tile(32, 2, 4, finish=True)
    dot = decode.DecodeTile(64, 128, 2, 16, dot=True)
    on = loads(decode.DecodeConfig(mma, dot), True)
    assert on.gemm1 == dataclasses.replace(mma, unpredicated=True) and on.gemm2 == dot
    assert loads(on, False) == decode.DecodeConfig(mma, dot)
    assert loads(None, True) is None


def test_the_per_expert_side_keeps_fma_tiles_finishing():
    """FMA tiles take one row per program at any M, so ``per_expert`` leaves their ``finish`` as it is."""
    fma = decode.DecodeTile(32, 128, 4, 1, dot=False, finish=True)
    dot = decode.DecodeTile(64, 128, 2, 16, dot=True, finish=True)
    config = benchmark_script("decode_tables_ab").per_expert(decode.DecodeConfig(fma, dot))
    assert config.gemm1 == fma and config.gemm2 == dataclasses.replace(dot, finish=False)
    assert benchmark_script("decode_tables_ab").per_expert(None) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run is the CPU's check")
def test_time_sides_runs_each_side_on_the_bench_calls_and_compares_it_with_the_table():
    """A table without a decode section picks the shared config, so that side's output has the table's bits; the
    grouped GEMMs differ by their roundings only. Each side's calls run under the side (the timer sees which)."""
    p = make_problem("fp8_block", "silu", E=8, k=2, H=256, I=128, max_tokens=8)
    experts = TritonExperts(p)
    weights = make_weights(p)
    prepared = experts.prepare_weights(weights)
    assert not prepared.configs.decode
    inputs = [(torch.randn(2, p.hidden_size).half(), make_topk(2, p)) for _ in range(2)]
    calls = backend_calls(TritonExperts, p, weights, inputs, torch.device("cpu"), experts=experts, prepared=prepared)
    seen = []

    def timer(timed_calls, graphs):
        assert timed_calls is calls and graphs is False
        seen.append(triton_experts.fp8_decode_config(2, prepared.configs))
        return 7.0

    row = benchmark_script("decode_tables_ab").time_sides(calls, ["table", "shared", "grouped"], 2, timer, False)
    shared = decode.fp8_decode_config(2)
    assert seen == [shared, shared, None] * 2  # the rounds alternate the sides
    assert row["table"] == row["shared"] == row["grouped"] == [7.0, 7.0]
    assert row["vs_table"]["table"] == 0.0 and row["vs_table"]["shared"] == 0.0
    assert 0.0 < row["vs_table"]["grouped"] < 0.05


def test_an_unknown_side_is_refused_naming_it():
    sides = "table, shared, per_expert, predicated, unpredicated, grouped"
    with pytest.raises(ValueError, match=f"side must be one of {sides} .got 'fused'."):
        with benchmark_script("decode_tables_ab").side("fused"):
            pass
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "decode_tables_ab.py"
    done = subprocess.run([sys.executable, str(script), "qwen3-30b-a3b", "1", "table,fused"], capture_output=True,
                          text=True, timeout=300, cwd=script.parents[1], env={"PYTHONPATH": str(script.parents[1])})
    assert done.returncode != 0
    assert f"side must be one of {sides} (got 'fused')" in done.stderr
