"""wgmma=True tiles (gemm_wgmma.py, a Gluon kernel) on an SM90 GPU for fp8_block at the presets' shapes, and their
warp-specialized persistent twins (ws=True, gemm_ws.py): equal to the pointer path and to the float32 reference,
at ragged small M too (1, 3, 33 tokens: experts hit zero or a few times; most of a persistent program's tiles lie
past the rows the routing filled), and a CUDA graph replays them equal to eager without a host sync."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe.experts._triton.config import CONFIG_DIR, ConfigTable, LaunchConfig, TileConfig
from moe.experts.triton import TritonExperts
from moe.formats import ActivationFormat, Dispatched
from moe.presets import load_preset
from moe.quant import QuantizedTensor
from moe.testing.tolerance import assert_close_moe, regime_for
from moe.tools.bench import build_weights
from tests.gpu.test_triton_gpu import (
    assert_poisoned_run_equals_run,
    assert_replay_equals_eager_without_sync,
    reference,
    run,
    topk_for,
)
from tests.gpu.test_triton_tma_a_gpu import only

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

# Qwen3 (128 experts, K = 2048 / 768), the DeepSeek-V3 slice (32 experts, K = 7168 / 2048), GPT-OSS-120B
# (biases, swiglu_oai, K = 2880: a last scale group of 64 columns)
PRESETS = ("qwen3-30b-a3b", "deepseek-v3-ep8-slice", "gpt-oss-120b")


def wgmma_tiles(block_m=64, num_warps=4, gemm1_n=64, gemm2_n=128, stages=4, ws=(False, False),
                stores=(False, False)) -> LaunchConfig:
    """``ws``: which GEMMs run the warp-specialized persistent kernel (gemm_ws.py); ``stores``: which of those
    store by TMA (``tma_store``; GEMM2's rows then stay sorted)."""
    return LaunchConfig(block_m, TileConfig(gemm1_n, 128, 8, num_warps, stages, tma=True, wgmma=True, ws=ws[0],
                                            tma_store=stores[0]),
                        TileConfig(gemm2_n, 128, 8, num_warps, stages, tma=True, wgmma=True, ws=ws[1],
                                   tma_store=stores[1]))


def pointer_tiles(block_m=64) -> LaunchConfig:
    tile = TileConfig(64, 128, 8, 4, 3, tma=True)
    return LaunchConfig(block_m, tile, tile)


def h200_table_ws_configs(prepared) -> list[LaunchConfig]:
    """The distinct ws configs of the packaged H200 table for ``prepared``'s shapes and scheme, whatever M bucket
    each sits in: the exact combinations the layer launches on that machine."""
    key = dataclasses.replace(prepared.configs.key, device="NVIDIA H200")
    configs = [c for _, c in ConfigTable.load(key, CONFIG_DIR).configs if c.gemm1.ws or c.gemm2.ws]
    assert configs, f"the H200 table of {key} holds no ws config"
    return list(dict.fromkeys(configs))


def sm90_layer(preset: str, quant: str, kind: str):
    """(problem, experts, prepared weights, canonical weights) of a preset up to 1024 tokens, on an SM90 GPU."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"{kind} tiles: SM90 (Hopper) only")
    p = load_preset(preset).problem(quant=quant, max_tokens=1024)
    weights = build_weights(p, torch.device("cuda"))
    experts = TritonExperts(p)
    return p, experts, experts.prepare_weights(weights), weights


@pytest.fixture(scope="module", params=PRESETS)
def layer(request):
    return sm90_layer(request.param, "fp8_block", "wgmma")


def dispatched_for(p, tokens):
    x = torch.randn(tokens, p.hidden_size, device="cuda", dtype=p.dtype)
    topk = topk_for(p, tokens)
    return x, topk, Dispatched(ActivationFormat.STANDARD, QuantizedTensor(data=x, scale=None, fmt="none"), topk)


def check_against_pointer_and_reference(layer, tokens: int, config: LaunchConfig, pointer: LaunchConfig, rel: float):
    """``config``'s output equals ``pointer``'s (the same products; only the schedule and roundings differ) within
    ``rel`` of its largest value, and, at 3 and 256 tokens, the float32 reference of the whole layer."""
    p, experts, prepared, weights = layer
    x, topk, dispatched = dispatched_for(p, tokens)
    got = run(experts, dispatched, only(prepared, config, tokens)).float()
    expected = run(experts, dispatched, only(prepared, pointer, tokens)).float()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, atol=rel * expected.abs().max().item(), rtol=rel)
    if tokens in (3, 256):
        assert_close_moe(got, reference(p, x, topk, weights), regime_for(p), context=f"{config}")


BOTH = (True, True)


@pytest.mark.parametrize("tokens", [1, 3, 33, 256, 1024])
@pytest.mark.parametrize("config", [
    wgmma_tiles(), wgmma_tiles(128, 8), wgmma_tiles(64, 8, gemm2_n=256), wgmma_tiles(64, 4, gemm1_n=32, stages=6),
    wgmma_tiles(128, 8, ws=BOTH), wgmma_tiles(64, 4, ws=BOTH), wgmma_tiles(128, 8, gemm1_n=32, stages=6, ws=BOTH),
    wgmma_tiles(128, 8, ws=(True, False)), wgmma_tiles(128, 8, ws=(False, True)),
    wgmma_tiles(128, 8, ws=BOTH, stores=BOTH), wgmma_tiles(64, 4, ws=BOTH, stores=(False, True)),
], ids=["64-w4", "128-w8", "64-w8-n256", "64-w4-n32-s6", "ws-128-w8", "ws-64-w4", "ws-128-w8-n32-s6",
        "ws-gemm1-only", "ws-gemm2-only", "ws-128-w8-tma-both", "ws-64-w4-tma-gemm2"])
def test_wgmma_equals_pointer_path_and_reference(layer, tokens, config):
    # the same products summed in the same K order (128-column steps); only the schedule differs
    check_against_pointer_and_reference(layer, tokens, config, pointer_tiles(config.block_m), 1e-2)


@pytest.mark.parametrize("tokens", [33, 256, 1024])
def test_every_ws_config_the_h200_fp8_table_ships_equals_the_pointer_path(layer, tokens):
    for config in h200_table_ws_configs(layer[2]):
        check_against_pointer_and_reference(layer, tokens, config, pointer_tiles(config.block_m), 1e-2)


@pytest.mark.parametrize("config", [wgmma_tiles(), wgmma_tiles(128, 8, ws=BOTH),
                                    wgmma_tiles(64, 4, ws=BOTH, stores=BOTH)], ids=["wgmma", "ws", "ws-tma-stores"])
def test_wgmma_cuda_graph_replay_equals_eager(layer, config):
    p, experts, prepared, _ = layer
    assert_replay_equals_eager_without_sync(experts, only(prepared, config, 256), p, 256)


@pytest.mark.parametrize("tokens", [3, 256])
@pytest.mark.parametrize("config", [wgmma_tiles(), wgmma_tiles(64, 4, ws=BOTH, stores=BOTH)], ids=["wgmma", "ws-tma"])
def test_fp8_sorted_paths_read_no_unwritten_workspace_row(layer, tokens, config):
    # the gather leaves padding rows and their scales as they were (NaN here), the intermediate's quantization too
    assert_poisoned_run_equals_run(layer, tokens, only(layer[2], config, tokens))


def test_fp8_ws_tma_store_equals_register_stores_bit_for_bit(layer):
    """GEMM2 storing its sorted tile by TMA (the sum over k gathering through slot_rows) gives the layer's output of
    the register-store tiles exactly: the same products, stored elsewhere."""
    p, experts, prepared, _ = layer
    x, topk, dispatched = dispatched_for(p, 256)
    want = run(experts, dispatched, only(prepared, wgmma_tiles(64, 4, ws=BOTH), 256)).float()
    got = run(experts, dispatched, only(prepared, wgmma_tiles(64, 4, ws=BOTH, stores=(False, True)), 256)).float()
    assert torch.equal(got, want)


def test_fp8_ws_tile_too_wide_for_its_registers_is_refused():
    """A 256-column wgmma (gated block_n 128) would spill three accumulator tiles: a clear error, not a slow or
    wrong result."""
    with pytest.raises(ValueError, match="at most 128 columns wide"):
        run_qwen3_under("fp8_block", wgmma_tiles(128, 8, gemm1_n=128, ws=BOTH))


def run_qwen3_under(quant: str, config: LaunchConfig) -> torch.Tensor:
    """Qwen3-30B-A3B's experts on 64 tokens under ``config`` alone, on an SM90 GPU."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("SM90 only")
    p = load_preset("qwen3-30b-a3b").problem(quant=quant, max_tokens=64)
    experts = TritonExperts(p)
    prepared = experts.prepare_weights(build_weights(p, torch.device("cuda")))
    _, _, dispatched = dispatched_for(p, 64)
    return run(experts, dispatched, only(prepared, config, 64))


def test_wgmma_config_rejects_unquantized_problems():
    """A wgmma tile on a bf16 problem is a clear error, not a wrong result."""
    with pytest.raises(ValueError, match="wgmma=True configs run fp8_block"):
        run_qwen3_under("bf16", wgmma_tiles())


@pytest.mark.parametrize("config", [wgmma_tiles(64, 4, gemm1_n=128), wgmma_tiles(64, 4, gemm1_n=128, ws=BOTH)],
                         ids=["wgmma", "ws"])
def test_ungated_relu2_experts_get_their_activation_in_the_gluon_epilogues(config):
    """Nemotron-H's relu2 experts (w13 has I = 1856 rows, no up half) under the Gluon GEMMs: the epilogue applies
    relu(x)^2 to an ungated tile too (it once applied activations to gated tiles only), equal to the pointer
    path and the reference."""
    layer = sm90_layer("nemotron-h", "fp8_block", "wgmma")  # skips off SM90
    for tokens in (3, 256):
        check_against_pointer_and_reference(layer, tokens, config, pointer_tiles(config.block_m), 1e-2)
