"""The bench and tune commands' CPU-side parts: traffic and FLOP counts, tables, files, search spaces."""

import argparse
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from moe.errors import MoEConfigError
from moe.oracle import cost
from moe.oracle.profile import ProfileEntry
from moe.platform import Platform
from moe.presets import load_preset
from moe.problem import MoEProblem
from moe.router import TopK
from moe.tools import bench, bench_report, tune
from moe.tools.cli import main

# the goal the committed benchmarks/peer_targets.yaml sets, with no peer times (the records carry them)
TARGETS = bench_report.Targets("vLLM", "bf16", {}, ("torch_grouped",), speedup=1.1, match_at=0.9)


def _record(experts, tokens, us, target=None):
    return bench_report.Record("qwen3-30b-a3b", "bf16", tokens, experts, us, 1.0, 100.0, 10.0, 10.0 / us, True, target)


def test_traffic_counts_hit_experts_and_activations():
    p = load_preset("mixtral-8x7b").scaled(max_hidden=64, max_intermediate=32, max_experts=4).problem(quant="fp16")
    topk = TopK(torch.tensor([[0, 1], [1, 0], [0, 1]], dtype=torch.int32), torch.rand(3, 2))
    roof = bench.traffic(p, Platform.preset("h200"), [topk])
    per_expert = (64 * 64 + 64 * 32) * 2
    assert roof.experts_hit == 2 and roof.weight_bytes == 2 * per_expert  # experts 0 and 1 hit
    # each of the 3 x 2 slots: its gathered row in, its intermediate out and back, its output row
    assert roof.activation_bytes == 3 * 2 * (64 * 2 + 2 * 32 * 2 + 64 * 2)
    assert roof.flops == 2 * 3 * 2 * 64 * (64 + 32)
    assert roof == cost.roofline(p, Platform.preset("h200"), 3, hits=2)  # the oracle's one roofline


def test_bench_fraction_is_the_oracles_efficiency():
    """Where the routing hits the expected experts (k = E: every token picks every expert), the bench's
    fraction of the roofline and the efficiency the oracle derives from the same time are one number."""
    p = MoEProblem.create(num_experts=4, top_k=4, hidden_size=64, intermediate_size=32, quant="bf16", max_tokens=3)
    h200, us = Platform.preset("h200"), 12.5
    topk = TopK(torch.tensor([[0, 1, 2, 3]] * 3, dtype=torch.int32), torch.rand(3, 4))
    fraction = bench.traffic(p, h200, [topk]).us / us
    point = ProfileEntry.measurement("triton", h200, p, 3, us)
    assert cost.efficiency_at((point,), h200, 3) == (fraction, 0.0)


def test_roofline_refuses_hits_outside_the_local_experts():
    p = MoEProblem.create(num_experts=4, top_k=2, hidden_size=64, intermediate_size=32)
    with pytest.raises(MoEConfigError, match=r"hits must be in \[0, local_num_experts=4\] \(got 5\)"):
        cost.roofline(p, Platform.preset("h200"), 3, hits=5)


def test_table_puts_backends_side_by_side():
    records = [_record("triton", 1, 30.0, 35.8), _record("torch_grouped", 1, 90.0, 35.8),
               _record("triton", 16, 200.0, 204.6)]
    table = bench_report.format_table(records)
    assert "### qwen3-30b-a3b bf16" in table
    assert "| 1 | 30.0 |" in table and table.count("| 35.8 |") == 1
    assert "| 16 | 200.0 |" in table and "- | - | - | -" in table  # torch_grouped missing at M=16


def test_targets_take_our_best_backend_against_the_better_peer():
    ceilings = bench_report.Ceilings("NVIDIA H200", 4.2e12, 7.7e14, 1.5e15)
    near_roofline = dataclasses.replace(_record("triton", 256, 199.0, 200.0), roofline_us=190.0)
    records = [_record("triton", 1, 30.0, 35.8), _record("flashinfer_cutlass", 1, 25.0, 35.8),
               _record("torch_grouped", 1, 90.0, 35.8),
               _record("triton", 16, 200.0, 204.6), _record("torch_grouped", 16, 150.0, 204.6),
               near_roofline]
    table = bench_report.format_targets(records, ceilings, TARGETS)
    # M=1: ours is FlashInfer's 25.0; the better peer is vLLM (35.8 < 90): need 35.8 / 1.1
    assert "| 1 | 25.0 (flashinfer_cutlass) | 35.8 (28%) | 90.0 (torch_grouped) | 32.5 | 1.43x |" in table
    assert table.split("\n")[5].endswith("| yes |")
    # M=16: the baseline (150) beats vLLM, so it sets the bar, and 200 misses it
    assert "| 16 | 200.0 (triton) | 204.6 (5%) | 150.0 (torch_grouped) | 136.4 | 0.75x |" in table
    assert table.split("\n")[6].endswith("| no |")
    # M=256: vLLM runs at 95% of the roofline: matching it is the goal
    assert "| 256 | 199.0 (triton) | 200.0 (95%) | - | 200.0 | 1.01x |" in table
    assert table.split("\n")[7].endswith("| yes (match) |")


def test_a_library_backend_named_a_baseline_is_a_peer_not_ours():
    """Issue 14 counts FlashInfer's CUTLASS MoE as a peer: named in ``baselines``, it sets the bar instead of
    standing for us."""
    ceilings = bench_report.Ceilings("NVIDIA H200", 4.2e12, 7.7e14, 1.5e15)
    targets = dataclasses.replace(TARGETS, baselines=("torch_grouped", "flashinfer_cutlass"))
    records = [_record("triton", 1, 30.0, 35.8), _record("flashinfer_cutlass", 1, 25.0, 35.8),
               _record("torch_grouped", 1, 90.0, 35.8)]
    table = bench_report.format_targets(records, ceilings, targets)
    # the better peer is FlashInfer's 25.0 (under vLLM's 35.8 and torch's 90.0): need 25.0 / 1.1
    assert "| 1 | 30.0 (triton) | 35.8 (28%) | 25.0 (flashinfer_cutlass) | 22.7 | 0.83x |" in table
    assert table.split("\n")[5].endswith("| no |")
    # where that better peer already runs at 90% of the roofline, matching it is the goal, as with vLLM's times
    near = [dataclasses.replace(r, roofline_us=23.0) for r in records]  # FlashInfer at 92%
    table = bench_report.format_targets(near, ceilings, targets)
    assert "| 1 | 30.0 (triton) | 35.8 (64%) | 25.0 (flashinfer_cutlass) | 25.0 | 0.83x |" in table
    near[0] = dataclasses.replace(near[0], us=24.5)
    assert bench_report.format_targets(near, ceilings, targets).split("\n")[5].endswith("| yes (match) |")


def test_quantized_schemes_against_bf16_take_each_schemes_fastest_backend():
    def rec(quant, experts, tokens, us):
        return dataclasses.replace(_record(experts, tokens, us), quant=quant)

    records = [rec("bf16", "triton", 1, 36.4), rec("bf16", "flashinfer_cutlass", 1, 50.6),
               rec("fp8_block", "triton", 1, 40.1),
               rec("bf16", "triton", 1024, 506.0), rec("fp8_block", "triton", 1024, 353.6),
               rec("fp8_block", "flashinfer_cutlass", 1024, 400.0),
               rec("fp8_block", "triton", 4096, 857.6)]  # no bf16 at 4096: no row
    table = bench_report.format_against_bf16(records)
    assert "### qwen3-30b-a3b: fp8_block against bf16" in table
    assert "| 1 | 40.1 (triton) | 36.4 (triton) | 0.91x | yes |" in table
    assert "| 1024 | 353.6 (triton) | 506.0 (triton) | 1.43x | no |" in table
    assert "| 4096 |" not in table
    assert bench_report.format_against_bf16([rec("bf16", "triton", 1, 36.4)]) == ""  # nothing to compare


def test_json_and_profile_files(tmp_path):
    ceilings = bench_report.Ceilings("NVIDIA H200", 4.2e12, 7.7e14, 1.5e15)
    records = [_record("triton", 1, 30.0, 35.8)]
    bench_report.write_json(tmp_path / "r.json", ceilings, records, "nvidia-h200")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["machine"] == "nvidia-h200" and data["records"][0]["us"] == 30.0
    bench_report.save_profile(tmp_path / "p.yaml", ceilings, records)
    from moe.oracle.profile import load_profile
    from moe.platform import Platform

    (entry,) = load_profile(tmp_path / "p.yaml").entries  # the oracle reads what the bench wrote
    assert (entry.backend, entry.tokens, entry.measured_us) == ("triton", 1, 30.0)
    assert entry.platform == Platform.detect().kind and entry.quant == "bf16"


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    bench_report.plot(tmp_path / "p.png", [_record("triton", 1, 30.0, 35.8), _record("triton", 16, 200.0, 204.6)])
    assert (tmp_path / "p.png").stat().st_size > 0


def test_command_line_arguments():
    parser = argparse.ArgumentParser()
    bench.add_bench_arguments(parser)
    args = parser.parse_args(["--preset", "qwen3-30b-a3b", "--tokens", "1,16", "--experts", "all"])
    assert args.preset == ["qwen3-30b-a3b"] and args.tokens == [1, 16] and args.quant == ["bf16"]
    parser = argparse.ArgumentParser()
    tune.add_tune_arguments(parser)
    assert parser.parse_args(["--preset", "mixtral-8x7b"]).quant == ["bf16"]


def test_backends_take_turns_in_each_round_and_keep_every_rounds_time():
    """``--rounds``: A, B, A, B, ... so that a drift of the clocks reaches both; each keeps its rounds' times."""
    order = []

    def timer(name, us):
        def timed():
            order.append(name)
            return us.pop(0)
        return timed

    times = bench.time_in_turns({"triton": timer("triton", [3.0, 1.0, 2.0]),
                                 "flashinfer_cutlass": timer("flashinfer_cutlass", [5.0, 4.0, 6.0])}, rounds=3)
    assert order == ["triton", "flashinfer_cutlass"] * 3
    assert times == {"triton": [3.0, 1.0, 2.0], "flashinfer_cutlass": [5.0, 4.0, 6.0]}
    assert bench.time_in_turns({}, rounds=3) == {}


def test_a_timer_warms_up_once_then_times_on_each_call():
    """`graph_timer` runs the calls once to warm up when it is made; each call of the timer times them again (here
    on the CPU's wall clock: no graphs), and `time_calls` is one such round."""
    runs = []
    timer = bench.graph_timer([lambda: runs.append("a"), lambda: runs.append("b")], graphs=False, budget_ms=1.0)
    assert runs == ["a", "b"]
    first = timer()
    after_one = len(runs)
    assert first > 0 and after_one > 2 and after_one % 2 == 0  # whole rotations through both calls
    assert timer() > 0 and len(runs) > after_one
    assert bench.time_calls([lambda: None], graphs=False, budget_ms=1.0) > 0


def test_rounds_argument_and_the_records_that_keep_them(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    bench.add_bench_arguments(parser)
    assert parser.parse_args([]).rounds == 1
    assert parser.parse_args(["--rounds", "3"]).rounds == 3
    with pytest.raises(SystemExit):
        parser.parse_args(["--rounds", "0"])
    assert "argument --rounds" in capsys.readouterr().err
    # a record with its rounds goes to --json and comes back as the scoreboard reads it (Record(**r))
    record = dataclasses.replace(_record("triton", 4096, 770.0), rounds_us=[771.9, 770.0, 765.2])
    ceilings = bench_report.Ceilings("NVIDIA H200", 4.2e12, 7.7e14, 1.5e15)
    bench_report.write_json(tmp_path / "r.json", ceilings, [record], "nvidia-h200")
    (back,) = [bench_report.Record(**r) for r in json.loads((tmp_path / "r.json").read_text())["records"]]
    assert back == record and back.rounds_us == [771.9, 770.0, 765.2]


def test_bench_without_gpu_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    assert main(["bench", "--tokens", "1"]) == 2
    assert "CUDA" in capsys.readouterr().err


@pytest.mark.parametrize("scheme", ["bf16", "fp8_block", "mxfp4", "mxfp4_a_mxfp8", "nvfp4", "mxfp8"])
@pytest.mark.parametrize("rows_per_expert", [0.1, 4, 20, 64, 300, 5000])
def test_tune_search_space_is_valid(scheme, rows_per_expert):
    for block_m in tune.candidate_block_ms(rows_per_expert):
        for wide in (False, True):
            tiles = tune.candidate_tiles(block_m, wide, scheme, rows_per_expert)
            assert tiles
            for t in tiles:
                if scheme == "fp8_block":
                    assert 128 % t.block_k == 0
                if scheme in ("mxfp4", "mxfp4_a_mxfp8", "nvfp4", "mxfp8"):  # scale words: no TMA descriptor
                    assert t.block_k >= 64 and t.block_k % 32 == 0 and not t.tma
                if t.tma:
                    assert t.block_k <= 128


@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp8", "mxfp4_a_mxfp8"])
def test_tune_times_weight_only_schemes_on_unquantized_activations(scheme):
    """The tuner builds what TritonExperts runs: a weight-only scheme's GEMMs read unquantized activations
    (the tuner used to quantize them to the scheme's format, for which their workspace has no buffer)."""
    from moe.experts._triton.gemm import QUANT_CODES
    from moe.quant import QuantScheme

    preset = load_preset("qwen3-30b-a3b").scaled(max_hidden=128, max_intermediate=64, max_experts=8)
    cpu = torch.device("cpu")
    case = tune.make_case(preset, scheme, 8, bench.build_weights(preset.problem(quant=scheme, max_tokens=8), cpu), cpu)
    assert case.weights.weight_only
    tiles = tune.candidate_tiles(16, False, scheme, 2.0)[:2]
    first, second, _ = tune.gemm_launches(case, 16, True, tiles, tiles, cpu)  # direct: no alignment launch
    launches = [launch for per_tile in (*first.values(), *second.values()) for launch in per_tile]
    assert len(launches) == 2 * 2 * 2  # 2 tiles x 2 input sets, each GEMM
    for launch in launches:
        assert launch.constexprs["QUANT"] == QUANT_CODES[QuantScheme.from_name(scheme).weight]
        assert launch.args[1] is launch.args[2]  # no activation scale: the weights stand in, never read


def test_the_peer_targets_are_data_under_benchmarks():
    targets = bench_report.load_targets(bench.CHECKOUT_TARGETS)
    assert bench.CHECKOUT_TARGETS.parent.name == "benchmarks"
    assert (targets.name, targets.baselines, targets.speedup, targets.match_at) == ("vLLM", ("torch_grouped", "flashinfer_cutlass"), 1.1, 0.9)
    assert targets.time("qwen3-30b-a3b", "bf16", 1) == 35.8 and targets.time("deepseek-v3-ep8-slice", "bf16", 16384) == 44330.9
    assert targets.time("qwen3-30b-a3b", "fp8_block", 1) is None  # the times are for bf16 only
    # the package holds none of them
    package = Path(bench.__file__).resolve().parents[1]
    assert not [p for p in package.rglob("*.py") if "44330.9" in p.read_text() or "VLLM_H200" in p.read_text()]


def test_a_malformed_targets_file_is_refused_by_name(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("name: x\nquant: bf16\nus: {qwen3-30b-a3b: {1: 35.8}}\n")  # no goal
    with pytest.raises(MoEConfigError, match=r"--targets .*t\.yaml: needs name, quant, us .* goal\.speedup"):
        bench_report.load_targets(path)
    path.write_text("name: x\nquant: bf16\nus: {}\ngoal: {speedup: 0.5, match_at: 0.9}\n")
    with pytest.raises(MoEConfigError, match=r"goal\.speedup must be >= 1 .*\(got 0\.5, 0\.9\)"):
        bench_report.load_targets(path)
    args = argparse.Namespace(targets=str(tmp_path / "missing.yaml"))
    with pytest.raises(MoEConfigError, match=r"--targets .*missing\.yaml: no such file"):
        bench._targets(args.targets)
