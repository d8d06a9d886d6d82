"""ws=True tiles (gemm_ws.py: the warp-specialized, persistent Gluon GEMM) on an SM90 GPU in bfloat16 at the
presets' shapes: equal to the pointer path and to the float32 reference, at ragged small M too (1, 3, 33 tokens:
most experts hit zero or one time, so most of a persistent program's tiles lie past the rows the routing
filled), a CUDA graph replays them equal to eager without a host sync, and a layout with fewer tiles than SMs
and one with many tiles per program both finish."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe.errors import MoEConfigError
from moe.experts._triton.config import LaunchConfig, TileConfig
from tests.gpu.test_triton_gpu import assert_poisoned_run_equals_run, assert_replay_equals_eager_without_sync, run
from tests.gpu.test_triton_tma_a_gpu import only, tma_a_tiles
from tests.gpu.test_triton_wgmma_gpu import (check_against_pointer_and_reference, dispatched_for,
                                             h200_table_ws_configs, run_qwen3_under, sm90_layer)

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

# Qwen3 (128 experts, gated N = 768), Mixtral (8 experts, K = 14336 in GEMM2), GPT-OSS-120B (biases,
# swiglu_oai, N = 2880: a last n block of 64 columns), the DeepSeek-V3 slice (32 experts, K = 7168)
PRESETS = ("qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-120b", "deepseek-v3-ep8-slice")


def ws_tiles(block_m=128, num_warps=8, gemm1_n=128, gemm2_n=256, stages=4, block_k=64, stores=(False, False),
             stages2=None, gather=False) -> LaunchConfig:
    """``stores``: (GEMM1's, GEMM2's) ``tma_store``; ``stages2``: GEMM2's ring when not ``stages``; ``gather``:
    GEMM1's loader copies x's rows itself."""
    return LaunchConfig(block_m, TileConfig(gemm1_n, block_k, 8, num_warps, stages, tma=True, tma_a=True, ws=True,
                                            tma_store=stores[0], gather=gather),
                        TileConfig(gemm2_n, block_k, 8, num_warps, stages2 or stages, tma=True, tma_a=True, ws=True,
                                   tma_store=stores[1]))


@pytest.fixture(scope="module", params=PRESETS)
def layer(request):
    return sm90_layer(request.param, "bf16", "ws")


def plain(config: LaunchConfig) -> LaunchConfig:
    """The same tiles on the pointer path (A gathered by pointer loads, W by TMA)."""
    return LaunchConfig(config.block_m, *(dataclasses.replace(t, tma_a=False, ws=False, tma_store=False, gather=False)
                                          for t in (config.gemm1, config.gemm2)))


CONFIGS = [ws_tiles(), ws_tiles(128, 8, 64, 128, 6), ws_tiles(64, 4, 128, 128, 4), ws_tiles(64, 8, 64, 256, 5),
           # the TMA store epilogue: GEMM2's rows stay sorted and the sum over k gathers them by slot
           ws_tiles(stores=(True, True), stages2=3), ws_tiles(stores=(False, True), stages2=3),
           ws_tiles(64, 4, 128, 256, 4, stores=(True, True)),
           # GEMM1's loader copying x's rows by cp.async (no gather kernel)
           ws_tiles(stores=(True, True), stages2=3, gather=True), ws_tiles(64, 4, 128, 128, 4, gather=True)]


@pytest.mark.parametrize("tokens", [1, 3, 33, 256, 1024])
@pytest.mark.parametrize("config", CONFIGS, ids=["128-w8", "128-w8-n64-s6", "64-w4", "64-w8-n64-s5",
                                                 "128-w8-tma-both", "128-w8-tma-gemm2", "64-w4-tma-both",
                                                 "128-w8-gather-tma-both", "64-w4-gather"])
def test_ws_equals_pointer_path_and_reference(layer, tokens, config):
    # the same products; only the wgmma schedule and bf16 rounding of the intermediate differ
    check_against_pointer_and_reference(layer, tokens, config, plain(config), 2e-2)


@pytest.mark.parametrize("tokens", [33, 256, 1024])
def test_every_ws_config_the_h200_table_ships_equals_the_pointer_path(layer, tokens):
    """The packaged H200 table of each preset, whatever M bucket a ws config sits in: the exact combinations the
    layer launches on that machine (ring depths, stores, group sizes, the gathering loader) at this GPU's shapes."""
    for config in h200_table_ws_configs(layer[2]):
        check_against_pointer_and_reference(layer, tokens, config, plain(config), 2e-2)


@pytest.mark.parametrize("tokens", [3, 256])
@pytest.mark.parametrize("config", [ws_tiles(), ws_tiles(stores=(True, True), stages2=3),
                                    ws_tiles(64, 4, 128, 128, 4, gather=True), tma_a_tiles()],
                         ids=["128-w8", "128-w8-tma-both", "64-w4-gather", "tma_a"])
def test_sorted_bf16_paths_read_no_unwritten_workspace_row(layer, tokens, config):
    # the gather leaves padding rows as they were (NaN here): GEMM outputs of those rows must never be read
    assert_poisoned_run_equals_run(layer, tokens, only(layer[2], config, tokens))


@pytest.mark.parametrize("stores, gather", [((False, False), False), ((True, True), False), ((True, True), True)],
                         ids=["register-stores", "tma-stores", "gather-tma-stores"])
def test_ws_cuda_graph_replay_equals_eager(layer, stores, gather):
    p, experts, prepared, _ = layer
    config = ws_tiles(stores=stores, stages2=3 if stores[1] else None, gather=gather)
    assert_replay_equals_eager_without_sync(experts, only(prepared, config, 256), p, 256)


def test_ws_gather_tile_on_rows_its_loader_cannot_copy_gathers_them_first(layer):
    """x as a view whose rows are not 16-byte multiples apart: the layer runs the gather kernel and the same tile
    without its gathering loader, the output equal to a contiguous x's bit for bit, not an error."""
    p, experts, prepared, _ = layer
    x, topk, dispatched = dispatched_for(p, 256)
    wide = torch.zeros(x.shape[0], x.shape[1] + 4, device=x.device, dtype=x.dtype)
    strided = wide[:, :x.shape[1]]
    strided.copy_(x)
    config = only(prepared, ws_tiles(stores=(True, True), stages2=3, gather=True), 256)
    want = run(experts, dispatched, config).float()
    got = run(experts, dataclasses.replace(dispatched, x=dataclasses.replace(dispatched.x, data=strided)),
              config).float()
    assert torch.equal(got, want)


@pytest.mark.parametrize("tokens", [33, 1024])
def test_ws_gather_loader_equals_the_gather_kernel_bit_for_bit(layer, tokens):
    """GEMM1's loader copying x's rows itself (cp.async) feeds the wgmmas the same rows the gather kernel writes:
    the layer's output is the same bit for bit."""
    p, experts, prepared, _ = layer
    x, topk, dispatched = dispatched_for(p, tokens)
    want = run(experts, dispatched, only(prepared, ws_tiles(stores=(True, True), stages2=3), tokens)).float()
    got = run(experts, dispatched, only(prepared, ws_tiles(stores=(True, True), stages2=3, gather=True),
                                        tokens)).float()
    assert torch.equal(got, want)


def test_ws_tma_store_leaves_gemm2_rows_sorted_and_the_sum_gathers_them(layer):
    """With GEMM2 storing by TMA, the workspace's y holds the layout's rows in sorted order (slot s at
    slot_rows[s]), and the layer's output equals the register-store tiles' bit for bit: the same products, only
    where they are stored differs."""
    p, experts, prepared, _ = layer
    x, topk, dispatched = dispatched_for(p, 256)
    want = run(experts, dispatched, only(prepared, ws_tiles(), 256)).float()
    got = run(experts, dispatched, only(prepared, ws_tiles(stores=(True, True), stages2=3), 256)).float()
    assert torch.equal(got, want)


def test_ws_gemm1_only_feeds_the_pointer_gemm2(layer):
    """gemm2 without tma_a: GEMM1 writes the intermediate at the slots' rows (OUT_SORTED off)."""
    p, experts, prepared, _ = layer
    config = ws_tiles()
    config = LaunchConfig(config.block_m, config.gemm1,
                          dataclasses.replace(config.gemm2, tma_a=False, ws=False, block_n=128))
    x, topk, dispatched = dispatched_for(p, 256)
    got = run(experts, dispatched, only(prepared, config, 256)).float()
    pointer = run(experts, dispatched, only(prepared, plain(config), 256)).float()
    torch.testing.assert_close(got, pointer, atol=2e-2 * pointer.abs().max().item(), rtol=2e-2)


def test_ws_config_rejects_quantized_problems():
    """A ws tile on an fp8 problem is a clear error naming the constraint, not a wrong result."""
    with pytest.raises(MoEConfigError, match="tma_a=True tiles need dense weights"):
        run_qwen3_under("fp8_block", ws_tiles())


def test_ungated_relu2_experts_get_their_activation_in_the_ws_epilogue():
    """Nemotron-H's relu2 experts (w13 has I = 1856 rows, no up half) under the bf16 ws GEMMs: the epilogue applies
    relu(x)^2 to an ungated tile too (it once applied activations to gated tiles only), equal to the pointer path
    and the reference."""
    layer = sm90_layer("nemotron-h", "bf16", "ws")
    for tokens in (3, 256):
        check_against_pointer_and_reference(layer, tokens, ws_tiles(), plain(ws_tiles()), 2e-2)
