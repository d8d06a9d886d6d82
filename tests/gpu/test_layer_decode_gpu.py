"""benchmarks/layer_decode.py on a CUDA GPU: the whole layer and its experts stage each capture in one
CUDA graph per M and replay, and the two paths it times compute one thing, at scaled-down Qwen3 and
GPT-OSS layers in bf16 and nvfp4 (weight-only on SM80/SM90) on the Triton experts."""

from __future__ import annotations

import math

import pytest

from tests.test_layer_decode_bench import _script

pytestmark = pytest.mark.gpu


def test_the_layer_and_its_experts_stage_replay_as_graphs_and_agree():
    bench = _script()
    cells = bench.main(["--preset", "qwen3-30b-a3b,gpt-oss-120b", "--quant", "bf16,nvfp4", "--experts", "triton",
                        "--tokens", "1,3,16", "--scale", "8", "--budget-ms", "20"])
    assert len(cells) == 2 * 2 * 3
    assert all(c.error == "" for c in cells), [c.error for c in cells if c.error]
    for c in cells:
        assert c.graphs and c.experts == "triton"
        assert math.isfinite(c.experts_us) and math.isfinite(c.layer_us) and c.experts_us > 0 and c.layer_us > 0
        # one kernel on one routing: equal up to the order of float additions (split-K partial sums)
        assert c.err <= 1e-2, c
        assert math.isfinite(c.vs_base) and c.vs_base > 0
