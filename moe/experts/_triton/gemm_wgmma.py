"""The fp8 128-block grouped GEMMs with a pipelined wgmma (``TileConfig.wgmma``; SM90, Gluon).

The data flow is the TMA-A path's (gemm_tma_a.py) with fp8 operands; every row index is a row of
the `BlockLayout`, padding included, until the second GEMM scatters to slots::

    gather     x_sorted[r] = x_q[slot[r] // k];  x_scale_sorted[g, r] = x_scale[slot[r] // k, g]
    gemm1      inter_sorted[r] = act(dequant(x_sorted[r]) @ dequant(w13[e]).T)      (bf16/fp16)
    quantize   inter_sorted -> e4m3 rows and their scales per 128 columns, as [groups, rows]
    gemm2      y[slot[r]] = dequant(inter_q[r]) @ dequant(w2[e]).T                 (rows holding a slot)

The scales are stored group-major (``[groups, rows]``) so that a K step reads its BLOCK_M row scales
contiguously. Both GEMMs are `_gemm_wgmma.moe_gemm_fp8_wgmma_kernel`: why Gluon, in its docstring. A tile
with ``ws`` set too runs its warp-specialized, persistent twin (gemm_ws.py) on the same operands.
The twin is `gemm.grouped_gemm_reference` on the dequantized rows; the pointer path
(``wgmma=False``) computes the same products.
"""

from __future__ import annotations

import torch

from moe.activation import Activation
from moe.errors import MoEConfigError
from moe.experts._triton import cdiv
from moe.experts._triton.align import BlockLayout, experts_pad
from moe.experts._triton.config import LaunchConfig, TileConfig
from moe.experts._triton.gemm import Launch, activation_args, activation_code, bias_args
from moe.experts._triton.gemm_tma_a import gather_launch, gemm2_output
from moe.experts._triton.gemm_ws import check_shared_memory, fp8_programs_per_sm, persistent_launch, staged_output
from moe.experts._triton.rows import GROUP, quantize_fp8_rows
from moe.experts._triton.support import require_sm90
from moe.experts._triton.weights import WeightOperand
from moe.quant import QuantFormat

_MODULE = "gemm_wgmma"


def check_wgmma_operands(w: WeightOperand, tile: TileConfig, gated: bool, block_m: int) -> None:
    """What the kernel assumes of the weights and the tile: e4m3 128x128-block weights, and each weight
    scale serving whole column halves of the tile (`WeightOperand.descriptor` checks the TMA rows). A ``ws``
    tile's consumer holds three accumulator tiles per thread (the sum, the tile being scaled in and the one
    in flight) in the registers its warps get beside the loader: one warpgroup per 64 rows, and wgmmas at
    most 128 columns wide."""
    if w.fmt is not QuantFormat.FP8_BLOCK or w.data.dtype != torch.float8_e4m3fn:
        raise MoEConfigError(f"wgmma=True tiles run fp8_block weights in e4m3 (got {w.fmt.value} in {w.data.dtype}); "
                             f"use wgmma=False")
    n = w.data.shape[1] // 2 if gated else w.data.shape[1]
    if gated and (128 % tile.block_n or n % tile.block_n):
        raise MoEConfigError(f"a gated wgmma=True tile's block_n must divide 128 and the intermediate size "
                             f"{n}, so that each half of the tile has one weight scale (got {tile.block_n})")
    if not gated and tile.block_n not in (16, 32, 64, 128, 256):
        raise MoEConfigError(f"wgmma=True tiles need block_n in (16, 32, 64, 128, 256) (got {tile.block_n})")
    width = 2 * tile.block_n if gated else tile.block_n
    if tile.ws and (width > 128 or tile.num_warps * 16 != block_m):
        raise MoEConfigError(f"an fp8_block ws=True tile needs num_warps = block_m / 16 (one warpgroup per 64 rows) "
                             f"and a wgmma at most 128 columns wide (block_n <= 64 gated, <= 128 otherwise): three "
                             f"accumulator tiles per thread must fit in registers (got block_m {block_m}, "
                             f"num_warps {tile.num_warps}, block_n {tile.block_n}, gated {gated})")


def wgmma_gemm_launch(a_sorted: torch.Tensor, a_scale: torch.Tensor, w: WeightOperand, out: torch.Tensor,
                      layout: BlockLayout, out_sorted: bool, activation: Activation | None,
                      tile: TileConfig) -> Launch:
    """The launch of ``out = act(dequant(a_sorted) @ dequant(w[expert]).T + bias[expert])`` over the blocks:
    ``a_sorted [rows, K]`` e4m3 in the layout's order, ``a_scale [groups, rows]`` its scales; output row
    r (``out_sorted``) or ``slot[r]``."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    gated = activation is not None and activation.is_gated
    block_m = layout.block_m
    check_wgmma_operands(w, tile, gated, block_m)
    n_out, k = out.shape[1], w.k
    # A's rows are this call's workspace view; W's descriptor is made once and kept with the weights
    a_desc = TensorDescriptor(a_sorted, list(a_sorted.shape), [a_sorted.stride(0), 1], [block_m, GROUP],
                              gl.NVMMASharedLayout.get_default_for([block_m, GROUP], gl.float8e4nv))
    w_desc = w.descriptor(tile.block_n, GROUP, gluon=True)
    num_experts = layout.expert_counts.numel()
    bias, bias_strides = bias_args(w)
    operands = (a_desc, w_desc, a_scale, w.scale, bias, out, layout.sorted_slots, layout.expert_ends,
                layout.expert_counts)
    out_desc = staged_output(out, out_sorted, tile, block_m)
    shape = (num_experts, n_out, k, w.data.shape[1], a_scale.stride(0), *w.scale.stride(), *bias_strides,
             out.stride(0), out.stride(1), *activation_args(activation))
    constexprs = dict(
        GATED=gated, ACTIVATION=activation_code(activation), HAS_BIAS=w.bias is not None,
        OUT_SORTED=out_sorted,
        E_PAD=experts_pad(num_experts), BLOCK_M=block_m, BLOCK_N=tile.block_n, GROUP_M=tile.group_m,
        STAGES=tile.num_stages,
    )
    if tile.ws:  # the persistent kernel walks the blocks the routing filled: no block count
        require_sm90(a_sorted.device, "ws")
        width = 2 * tile.block_n if gated else tile.block_n
        check_shared_memory(tile, block_m, gated, 1, out.element_size())
        staged = block_m * tile.block_n * out.element_size() if out_desc is not None else 0
        operands = operands[:2] + (out_desc or a_desc,) + operands[2:]
        return persistent_launch("moe_gemm_fp8_ws_kernel", a_sorted, layout, n_out, tile, operands + shape,
                                 dict(constexprs, TMA_STORE=out_desc is not None),
                                 fp8_programs_per_sm(tile, block_m, width, staged))
    grid = (layout.max_blocks * cdiv(n_out, tile.block_n),)
    return Launch(grid, operands + (layout.max_blocks,) + shape, dict(constexprs, num_warps=tile.num_warps),
                  kernel=(_MODULE, "moe_gemm_fp8_wgmma_kernel"))


def sorted_wgmma_gemms(x_q: torch.Tensor, x_scale: torch.Tensor, w13: WeightOperand, w2: WeightOperand,
                       layout: BlockLayout, activation: Activation, config: LaunchConfig, workspace,
                       num_slots: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Both GEMMs of a ``wgmma`` config (the module docstring), in the workspace's ``y``, from ``x_q [M, H]`` e4m3
    and ``x_scale [M, H / 128]``; no allocation. Returns ``(y, slot_rows)`` as `gemm_tma_a.sorted_tma_a_gemms`:
    ``y [num_slots, H]`` and None, or, where GEMM2's ws tile stores by TMA, the sorted rows and the layout's
    ``slot_rows``."""
    require_sm90(x_q.device, "wgmma")
    rows = layout.sorted_slots.numel()
    hidden, inter_size = x_q.shape[1], w2.k
    y = workspace["y"]
    # x_sorted lives in y's bytes: GEMM1 reads it before GEMM2 writes y
    x_sorted = y.view(torch.uint8)[:rows, :hidden].view(torch.float8_e4m3fn)
    x_scale_sorted = workspace["x_sorted_scale"][:cdiv(hidden, GROUP) * rows].view(-1, rows)
    gather_launch(x_q.view(torch.uint8), layout, top_k, x_sorted.view(torch.uint8),
                  (x_scale, x_scale_sorted)).run()
    inter = workspace["inter"][:rows]
    wgmma_gemm_launch(x_sorted, x_scale_sorted, w13, inter, layout, True, activation, config.gemm1).run()
    inter_q = workspace["inter_q"][:rows]
    inter_scale = workspace["inter_scale"].view(-1)[:cdiv(inter_size, GROUP) * rows].view(-1, rows)
    quantize_fp8_rows(inter, QuantFormat.FP8_BLOCK, inter_q, inter_scale.t(), workspace["inter_amax"])
    out, out_sorted = gemm2_output(config.gemm2, y, rows, num_slots)
    wgmma_gemm_launch(inter_q, inter_scale, w2, out, layout, out_sorted, None, config.gemm2).run()
    return out, layout.slot_rows if out_sorted else None
