"""tma_a=True tiles (gemm_tma_a.py) on a CUDA GPU (SM90: TMA) in bfloat16 at real model shapes: equal
to the pointer path and to the reference, a CUDA graph replays them equal to eager, and the tuner
compiles and times its TMA-A candidates."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe.experts._triton.config import ConfigTable, LaunchConfig, TileConfig
from moe.experts._triton.gemm import precompile
from moe.experts.triton import TritonExperts
from moe.formats import ActivationFormat, Dispatched
from moe.presets import load_preset
from moe.quant import QuantizedTensor
from moe.testing.tolerance import assert_close_moe, regime_for
from moe.tools import tune
from moe.tools.bench import build_weights
from tests.gpu.test_triton_gpu import assert_replay_equals_eager_without_sync, reference, run, topk_for

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

PRESETS = ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3-ep8-slice")


def tma_a_tiles(block_m=128, block_n=128, gemm2_tma_a=True, num_warps=8) -> LaunchConfig:
    """The H100 sweep's best tile (benchmarks/results/tma_a_nvidia-h100.md) by default."""
    first = TileConfig(block_n, 64, 8, num_warps, 3, tma=True, tma_a=True)
    second = dataclasses.replace(first, tma_a=gemm2_tma_a)
    return LaunchConfig(block_m, first, second)


def plain(config: LaunchConfig) -> LaunchConfig:
    """The same tiles on the pointer path (A gathered by pointer loads, W by TMA)."""
    return LaunchConfig(config.block_m, dataclasses.replace(config.gemm1, tma_a=False),
                        dataclasses.replace(config.gemm2, tma_a=False))


def only(prepared, config: LaunchConfig, tokens: int):
    return dataclasses.replace(prepared, configs=ConfigTable(prepared.configs.key, ((tokens, config),)))


@pytest.fixture(scope="module", params=PRESETS)
def layer(request):
    """(problem, experts, prepared weights, canonical weights) of a preset in bfloat16, up to 1024 tokens."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("tma_a tiles load by TMA: SM90+")
    p = load_preset(request.param).problem(quant="bf16", max_tokens=1024)
    weights = build_weights(p, torch.device("cuda"))
    experts = TritonExperts(p)
    return p, experts, experts.prepare_weights(weights), weights


@pytest.mark.parametrize("tokens", [256, 1024])
@pytest.mark.parametrize("config", [tma_a_tiles(), tma_a_tiles(64, 128, num_warps=4),
                                    tma_a_tiles(128, 64, gemm2_tma_a=False)],
                         ids=["128x128-w8", "64x128-w4", "128x64-gemm1-only"])
def test_tma_a_equals_pointer_path_and_reference(layer, tokens, config):
    p, experts, prepared, weights = layer
    x = torch.randn(tokens, p.hidden_size, device="cuda", dtype=p.dtype)
    topk = topk_for(p, tokens)
    dispatched = Dispatched(ActivationFormat.STANDARD, QuantizedTensor(data=x, scale=None, fmt="none"), topk)
    got = run(experts, dispatched, only(prepared, config, tokens)).float()
    pointer = run(experts, dispatched, only(prepared, plain(config), tokens)).float()
    assert torch.isfinite(got).all()
    # the same products summed in the same K order; only the wgmma schedule and bf16 rounding differ
    torch.testing.assert_close(got, pointer, atol=2e-2 * pointer.abs().max().item(), rtol=2e-2)
    if tokens == 256:  # the float32 reference of a whole layer: once per preset
        assert_close_moe(got, reference(p, x, topk, weights), regime_for(p), context=f"{config}")


@pytest.mark.parametrize("gemm2_tma_a", [True, False])
def test_tma_a_cuda_graph_replay_equals_eager(layer, gemm2_tma_a):
    p, experts, prepared, _ = layer
    config = tma_a_tiles(gemm2_tma_a=gemm2_tma_a)
    assert_replay_equals_eager_without_sync(experts, only(prepared, config, 256), p, 256)


def test_tune_compiles_and_times_tma_a_tiles(layer):
    """The tuner's TMA-A candidates at BLOCK_M 128 (8 warps, the H100's winners): their kernels (row
    gather, TMA-A GEMM) precompile, and every tile's launches run and get a finite time."""
    p, experts, prepared, _ = layer
    x = torch.randn(256, p.hidden_size, device="cuda", dtype=p.dtype)
    case = tune.TuneCase(p, experts, prepared, [(x, topk_for(p, 256))])
    rows_per_expert = 256 * p.top_k / p.local_num_experts

    def tiles(wide):
        return [t for t in tune.candidate_tiles(128, wide, "bf16", rows_per_expert)
                if t.tma_a and t.num_warps == 8 and t.block_n == 128 and t.block_k == 64]

    first, second, _ = tune.gemm_launches(case, 128, False, tiles(not p.activation.is_gated), tiles(True),
                                          torch.device("cuda"))
    assert first and second
    for spec in tune.distinct_kernels([first, second]):
        assert precompile(spec) is None, spec[3]
    times = {**tune.tile_times(first, None), **tune.tile_times(second, None)}
    assert all(0 < us < float("inf") for us in times.values()), times
