"""The bench and tune commands' CPU-side parts: traffic and FLOP counts, tables, files, search spaces."""

import argparse
import dataclasses
import json

import pytest
import torch

from moe.tools import bench, tune
from moe.presets import load_preset
from moe.router import TopK
from moe.weights import ExpertWeights


def _record(experts, tokens, us, vllm=None):
    return bench.Record("qwen3-30b-a3b", "bf16", tokens, experts, us, 1.0, 100.0, 10.0, 10.0 / us, True, vllm)


def test_traffic_counts_hit_experts_and_activations():
    p = load_preset("mixtral-8x7b").scaled(max_hidden=64, max_intermediate=32, max_experts=4).problem(quant="fp16")
    weights = ExpertWeights.from_dense(torch.randn(4, 64, 64), torch.randn(4, 64, 32), quant="fp16")
    topk = TopK(torch.tensor([[0, 1], [1, 0], [0, 1]], dtype=torch.int32), torch.rand(3, 2))
    nbytes, flops = bench.traffic(p, weights, [topk])
    per_expert = (64 * 64 + 64 * 32) * 2
    assert nbytes == 2 * per_expert + 2 * 3 * 64 * 2  # experts 0 and 1 hit; hidden in + out
    assert flops == 2 * 3 * 2 * 64 * (64 + 32)


def test_table_puts_backends_side_by_side():
    records = [_record("triton", 1, 30.0, 35.8), _record("torch_grouped", 1, 90.0, 35.8),
               _record("triton", 16, 200.0, 204.6)]
    table = bench.format_table(records)
    assert "### qwen3-30b-a3b bf16" in table
    assert "| 1 | 30.0 |" in table and table.count("| 35.8 |") == 1
    assert "| 16 | 200.0 |" in table and "- | - | - | -" in table  # torch_grouped missing at M=16


def test_targets_take_our_best_backend_against_the_better_peer():
    ceilings = bench.Ceilings("NVIDIA H200", 4.2e12, 7.7e14, 1.5e15)
    near_roofline = dataclasses.replace(_record("triton", 256, 199.0, 200.0), roofline_us=190.0)
    records = [_record("triton", 1, 30.0, 35.8), _record("flashinfer_cutlass", 1, 25.0, 35.8),
               _record("torch_grouped", 1, 90.0, 35.8),
               _record("triton", 16, 200.0, 204.6), _record("torch_grouped", 16, 150.0, 204.6),
               near_roofline]
    table = bench.format_targets(records, ceilings)
    # M=1: ours is FlashInfer's 25.0; the better peer is vLLM (35.8 < 90): need 35.8 / 1.1
    assert "| 1 | 25.0 (flashinfer_cutlass) | 35.8 (28%) | 90.0 | 32.5 | 1.43x |" in table
    assert table.split("\n")[5].endswith("| yes |")
    # M=16: the baseline (150) beats vLLM, so it sets the bar, and 200 misses it
    assert "| 16 | 200.0 (triton) | 204.6 (5%) | 150.0 | 136.4 | 0.75x |" in table
    assert table.split("\n")[6].endswith("| no |")
    # M=256: vLLM runs at 95% of the roofline: matching it is the goal
    assert "| 256 | 199.0 (triton) | 200.0 (95%) | - | 200.0 | 1.01x |" in table
    assert table.split("\n")[7].endswith("| yes (match) |")


def test_json_and_profile_files(tmp_path):
    ceilings = bench.Ceilings("NVIDIA H200", 4.2e12, 7.7e14, 1.5e15)
    records = [_record("triton", 1, 30.0, 35.8)]
    bench.write_json(tmp_path / "r.json", ceilings, records, "nvidia-h200")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["machine"] == "nvidia-h200" and data["records"][0]["us"] == 30.0
    bench.save_profile(tmp_path / "p.yaml", ceilings, records)
    from moe.oracle.profile import load_profile
    from moe.platform import Platform

    (entry,) = load_profile(tmp_path / "p.yaml").entries  # the oracle reads what the bench wrote
    assert (entry.backend, entry.tokens, entry.measured_us) == ("triton", 1, 30.0)
    assert entry.platform == Platform.detect().kind and entry.quant == "bf16"


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    bench.plot(tmp_path / "p.png", [_record("triton", 1, 30.0, 35.8), _record("triton", 16, 200.0, 204.6)])
    assert (tmp_path / "p.png").stat().st_size > 0


def test_command_line_arguments():
    parser = argparse.ArgumentParser()
    bench.add_bench_arguments(parser)
    args = parser.parse_args(["--preset", "qwen3-30b-a3b", "--tokens", "1,16", "--experts", "all"])
    assert args.preset == ["qwen3-30b-a3b"] and args.tokens == [1, 16] and args.quant == ["bf16"]
    parser = argparse.ArgumentParser()
    tune.add_tune_arguments(parser)
    assert parser.parse_args(["--preset", "mixtral-8x7b"]).quant == ["bf16"]


def test_bench_without_gpu_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    assert bench.main_bench(["--tokens", "1"]) == 2
    assert "CUDA" in capsys.readouterr().err


@pytest.mark.parametrize("scheme", ["bf16", "fp8_block", "mxfp4"])
@pytest.mark.parametrize("rows_per_expert", [0.1, 4, 20, 64, 300, 5000])
def test_tune_search_space_is_valid(scheme, rows_per_expert):
    for block_m in tune.candidate_block_ms(rows_per_expert):
        for wide in (False, True):
            tiles = tune.candidate_tiles(block_m, wide, scheme, rows_per_expert)
            assert tiles
            for t in tiles:
                if scheme == "fp8_block":
                    assert 128 % t.block_k == 0
                if scheme == "mxfp4":
                    assert t.block_k >= 64 and not t.tma  # no TMA descriptor over packed nibbles
                if t.tma:
                    assert t.block_k <= 128
