"""ws=True tiles (gemm_ws.py) on a CUDA GPU (SM90: TMA, warp specialization) in bfloat16 at real model
shapes: equal to the pointer path and to the reference, and a CUDA graph replays them equal to eager."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe.experts._triton.config import ConfigTable, LaunchConfig, TileConfig
from moe.experts.triton import TritonExperts
from moe.formats import ActivationFormat, Dispatched
from moe.presets import load_preset
from moe.quant import QuantizedTensor
from moe.testing.tolerance import assert_close_moe, regime_for
from moe.tools.bench import build_weights
from tests.gpu.test_triton_gpu import assert_replay_equals_eager_without_sync, reference, run, topk_for

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

PRESETS = ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3-ep8-slice")


def ws_tiles(block_m=128, block_n=128, gemm2_ws=True, persistent=False) -> LaunchConfig:
    """4 warps: Triton 3.6 warp-specializes a loop of one wgmma warpgroup (8 warps: not specialized)."""
    first = TileConfig(block_n, 64, 8, 4, 4 if block_n == 128 else 3, tma=True, ws=True, persistent=persistent)
    second = dataclasses.replace(first, ws=gemm2_ws, persistent=persistent and gemm2_ws)
    return LaunchConfig(block_m, first, second)


def plain(config: LaunchConfig) -> LaunchConfig:
    """The same tiles on the pointer path (A gathered by pointer loads, W by TMA)."""
    return LaunchConfig(config.block_m, dataclasses.replace(config.gemm1, ws=False),
                        dataclasses.replace(config.gemm2, ws=False))


def only(prepared, config: LaunchConfig, tokens: int):
    return dataclasses.replace(prepared, configs=ConfigTable(prepared.configs.key, ((tokens, config),)))


@pytest.fixture(scope="module", params=PRESETS)
def layer(request):
    """(problem, experts, prepared weights, canonical weights) of a preset in bfloat16, up to 1024 tokens."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("ws tiles load by TMA: SM90+")
    p = load_preset(request.param).problem(quant="bf16", max_tokens=1024)
    weights = build_weights(p, torch.device("cuda"))
    experts = TritonExperts(p)
    return p, experts, experts.prepare_weights(weights), weights


@pytest.mark.parametrize("tokens", [256, 1024])
@pytest.mark.parametrize("config", [ws_tiles(), ws_tiles(64, 128), ws_tiles(128, 256, gemm2_ws=False),
                                    ws_tiles(persistent=True)],
                         ids=["128x128", "64x128", "128x256-gemm1-only", "128x128-persistent"])
def test_ws_equals_pointer_path_and_reference(layer, tokens, config):
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


@pytest.mark.parametrize("persistent", [False, True])
def test_ws_cuda_graph_replay_equals_eager(layer, persistent):
    p, experts, prepared, _ = layer
    assert_replay_equals_eager_without_sync(experts, only(prepared, ws_tiles(persistent=persistent), 256), p, 256)
