"""benchmarks/issue14_scoreboard.py: each goal of issue 14 read from bench and layer records (no GPU)."""

import json

import pytest

from tests.helpers import benchmark_script

board = benchmark_script("issue14_scoreboard")
CEILINGS = {"device": "NVIDIA H200", "bandwidth": 4.0e12, "bf16_flops": 7.5e14, "fp8_flops": 1.3e15}


def _record(preset, quant, tokens, experts, us, fraction=0.5, tflops=1.0, target=None):
    """A record as `moe bench --json` writes it (``target``: the peer's time the bench took from its targets)."""
    return {"preset": preset, "quant": quant, "tokens": tokens, "experts": experts, "us": us, "tflops": tflops,
            "gbps": 1.0, "roofline_us": fraction * us, "roofline_fraction": fraction, "graphs": True,
            "target_us": target}


def _bench(tmp_path, records, name="b.json", machine="nvidia-h200"):
    path = tmp_path / name
    path.write_text(json.dumps({"machine": machine, "ceilings": CEILINGS, "records": records}))
    return str(path)


def test_mxfp4_decode_goals_compare_ours_with_flashinfer(tmp_path):
    records = [_record("gpt-oss-120b", "mxfp4", 1, "triton", 30.0),
               _record("gpt-oss-120b", "mxfp4", 1, "flashinfer_cutlass", 75.0),
               _record("gpt-oss-120b", "mxfp4", 16, "triton", 300.0, fraction=0.55),
               _record("gpt-oss-120b", "mxfp4", 16, "flashinfer_cutlass", 360.0)]
    rows = {r.cell: r for r in board.mxfp4_decode(board.load_bench([_bench(tmp_path, records)])[1])}
    against = rows["M = 1: against FlashInfer"]
    assert against.met and against.measured == "30.0 / 75.0 us = 2.50x"
    assert rows["M = 1: time"].met  # 30 <= 35
    assert not rows["M = 16: against FlashInfer"].met  # 1.2x < 1.3x
    assert not rows["M = 16: roofline"].met  # 55% < 60%
    assert "M = 64: roofline" not in rows  # not measured, not claimed


def test_weight_only_and_fp8_goals_take_each_schemes_fastest_backend(tmp_path):
    records = [_record("qwen3-30b-a3b", "bf16", 1, "triton", 30.0),
               _record("qwen3-30b-a3b", "bf16", 1, "torch_grouped", 90.0),
               _record("qwen3-30b-a3b", "mxfp4", 1, "triton", 17.9),
               _record("qwen3-30b-a3b", "nvfp4", 1, "triton", 18.3),
               _record("qwen3-30b-a3b", "nvfp4", 32, "triton", 1.0),  # M > 16: outside the goal
               _record("qwen3-30b-a3b", "bf16", 32, "triton", 100.0),
               _record("qwen3-30b-a3b", "fp8_block", 1, "triton", 25.0, fraction=0.5),
               _record("qwen3-30b-a3b", "fp8_block", 1024, "triton", 250.0, fraction=0.67),
               _record("qwen3-30b-a3b", "bf16", 1024, "triton", 240.0)]
    _, recs = board.load_bench([_bench(tmp_path, records)])
    wo = {r.cell: r.met for r in board.weight_only(recs)}
    assert wo == {"qwen3-30b-a3b mxfp4 M = 1": True, "qwen3-30b-a3b nvfp4 M = 1": False}  # 0.597 and 0.61 of 30.0
    fp8 = {r.cell: r.met for r in board.fp8_block(recs)}
    assert fp8 == {"qwen3-30b-a3b M = 1: roofline": False, "qwen3-30b-a3b M = 1: against bf16": True,
                   "qwen3-30b-a3b M = 1024: roofline": True, "qwen3-30b-a3b M = 1024: against bf16": False}


def test_layer_goal_and_the_whole_board(tmp_path):
    cells = [{"preset": "qwen3-30b-a3b", "scheme": "nvfp4", "backend": "triton", "tokens": 1, "experts_us": 18.0,
              "layer_us": 21.0, "ratio": 21.0 / 18.0, "error": ""},
             {"preset": "qwen3-30b-a3b", "scheme": "bf16", "backend": "triton", "tokens": 2, "experts_us": 50.0,
              "layer_us": 52.0, "ratio": 1.04, "error": ""},
             {"preset": "qwen3-30b-a3b", "scheme": "bf16", "backend": "triton", "tokens": 4, "error": "no capture"}]
    assert [r.met for r in board.layer(cells)] == [False, True]
    layer_path = tmp_path / "l.json"
    layer_path.write_text(json.dumps({"cells": cells}))
    records = [_record("qwen3-30b-a3b", "bf16", 4096, "triton", 859.0, tflops=360.0, target=923.4),
               _record("qwen3-30b-a3b", "bf16", 4096, "flashinfer_cutlass", 800.0, target=923.4)]
    text = board.scoreboard([_bench(tmp_path, records)], [str(layer_path)])
    assert "## bf16 at large M (Qwen3-30B-A3B): 0 of 1 met" in text  # 360 of 750 TFLOP/s
    # FlashInfer is a peer: it sets the bar at 800 / 1.1, and triton's 859 misses it
    assert "| 4096 | 859.0 (triton) | 923.4 (" in text and "800.0 (flashinfer_cutlass)" in text
    assert "against the peers (vLLM's table; flashinfer_cutlass timed in the run): 0 of 1 met" in text
    assert "\ntorch_grouped: not timed in these files, so no bar here counts them.\n" in text
    assert "## The whole layer at decode, layer over experts stage: 1 of 2 met" in text
    assert "## MXFP4 W4A16 decode (GPT-OSS-120B)\n\nnot measured in these files" in text


def test_the_bf16_goal_names_only_the_baselines_the_files_timed(tmp_path):
    """A run without FlashInfer (or torch_grouped) is judged against vLLM's table alone, and the board says so rather
    than name the baselines as timed."""
    records = [_record("qwen3-30b-a3b", "bf16", 1, "triton", 29.0, target=35.8)]
    text = board.scoreboard([_bench(tmp_path, records)])
    assert "## bf16 against the peers (vLLM's table; no baseline timed in the run): 1 of 1 met" in text
    assert "\ntorch_grouped, flashinfer_cutlass: not timed in these files, so no bar here counts them.\n" in text


def test_runs_of_two_machines_are_refused_by_name(tmp_path):
    a = _bench(tmp_path, [], "a.json")
    b = _bench(tmp_path, [], "b.json", machine="nvidia-h100")
    with pytest.raises(ValueError, match="b.json: machine 'nvidia-h100'"):
        board.load_bench([a, b])
