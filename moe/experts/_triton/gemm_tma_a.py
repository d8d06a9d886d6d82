"""The TMA-A grouped GEMMs of the standard format's sorted path (``TileConfig.tma_a``).

The pointer kernel (gemm.py) gathers each A tile's rows by pointer loads; here the A rows are first
gathered into the `BlockLayout`'s sorted order, so that both GEMMs load A, like W, by TMA descriptor
(TMA gather of scattered rows is Blackwell-only)::

    gather   x_sorted[r] = x[slot[r] // k]        (r over the layout's slot rows; padding rows unwritten)
    gemm1    inter_sorted[r] = act(x_sorted[r] @ w13[e].T + b13[e])      (or, gemm2 not tma_a: inter[slot[r]])
    gemm2    y[slot[r]] = inter_sorted[r] @ w2[e].T + b2[e]              (rows that hold a slot)

Dense weights in the activations' dtype only (bf16/fp16; fp32 runs the same loop with IEEE products).
``x_sorted`` lives in the workspace's ``y`` rows (GEMM2 overwrites them after GEMM1 has read them) and
``inter_sorted`` in ``inter``'s; both buffers have room for the padding rows (`workspace_rows`). The
twin is `gemm.grouped_gemm_reference` on the routed rows. The Triton kernel is not warp-specialized (why, in
_gemm_tma_a.py's docstring); a ``ws`` tile runs the same flow with a Gluon kernel that is (gemm_ws.py).
"""

from __future__ import annotations

import dataclasses

import torch

from moe.activation import Activation
from moe.errors import MoEConfigError
from moe.experts._triton import cdiv, next_power_of_2
from moe.experts._triton.align import BlockLayout, experts_pad, padded_rows
from moe.experts._triton.config import BLOCK_MS, LaunchConfig, TileConfig
from moe.experts._triton.gemm import (Launch, SortedRows, activation_args, activation_code, bias_args,
                                      grouped_gemm)
from moe.experts._triton.gemm_ws import can_gather, ws_gemm_launch
from moe.experts._triton.weights import WeightOperand, check_tma_a_weights

_GATHER_BLOCK_K = 256  # columns per gather program
_MODULE = "gemm_tma_a"  # the `kernels` module of this file's kernels


def workspace_rows(num_slots: int, num_local: int) -> int:
    """Rows of the ``inter`` and ``y`` buffers for the TMA-A path: every slot and any layout's padding."""
    return padded_rows(num_slots, num_local, BLOCK_MS)


def gather_launch(src: torch.Tensor, layout: BlockLayout, a_row_div: int, dst: torch.Tensor,
                  scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> Launch:
    """The launch of ``dst[r] = src[slot[r] // a_row_div]`` for the layout's rows
    (`_gemm_tma_a.gather_rows_kernel`); ``dst`` has at least ``sorted_slots.numel()`` rows. ``scales``:
    ``(src_scale [rows, groups], dst_scale [groups, >= layout rows])``, gathered alike (transposed)."""
    k = src.shape[1]
    num_experts = layout.expert_counts.numel()
    if scales is None:
        scale_args, groups = (src, src, 0, 0, 0, 0), 1
    else:
        src_scale, dst_scale = scales
        groups = src_scale.shape[1]
        scale_args = (src_scale, dst_scale, src_scale.stride(0), src_scale.stride(1), dst_scale.stride(0), groups)
    args = (src, dst, layout.sorted_slots, layout.expert_ends, layout.expert_counts, num_experts, k,
            src.stride(0), src.stride(1), dst.stride(0), *scale_args)
    constexprs = dict(A_ROW_DIV=a_row_div, E_PAD=experts_pad(num_experts), BLOCK_M=layout.block_m,
                      BLOCK_K=_GATHER_BLOCK_K, HAS_SCALES=scales is not None, GROUPS_PAD=next_power_of_2(groups),
                      num_warps=4)
    return Launch((layout.max_blocks, cdiv(k, _GATHER_BLOCK_K)), args, constexprs,
                  kernel=(_MODULE, "gather_rows_kernel"))


def gather_sorted_rows(src: torch.Tensor, layout: BlockLayout, a_row_div: int, dst: torch.Tensor) -> torch.Tensor:
    """Runs `gather_launch`; returns ``dst``'s first ``sorted_slots.numel()`` rows."""
    dst = dst[:layout.sorted_slots.numel()]
    gather_launch(src, layout, a_row_div, dst).run()
    return dst


def _check_operands(a_sorted: torch.Tensor, w: WeightOperand) -> None:
    check_tma_a_weights(w, a_sorted.dtype)
    if a_sorted.stride(1) != 1 or (a_sorted.shape[1] * a_sorted.element_size()) % 16:
        raise MoEConfigError(f"tma_a=True tiles load A rows by TMA: they must be contiguous 16-byte multiples "
                             f"(got K = {a_sorted.shape[1]} in {a_sorted.dtype}); use tma_a=False for this shape")


def tma_a_gemm_launch(a_sorted: torch.Tensor, w: WeightOperand, out: torch.Tensor, layout: BlockLayout,
                      out_sorted: bool, activation: Activation | None, tile: TileConfig,
                      a_row_div: int | None = None) -> Launch:
    """The launch of ``out = act(a_sorted @ w[expert].T + bias)`` over the layout's blocks; ``a_sorted``
    holds the layout's rows in order; ``out_sorted``: output row r, else row ``slot[r]``. A ``ws`` tile
    launches the warp-specialized Gluon kernel instead (gemm_ws.py); a ``gather`` one reads row
    ``slot // a_row_div`` of the unsorted ``a_sorted`` for each slot."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    _check_operands(a_sorted, w)
    if tile.ws:
        return ws_gemm_launch(a_sorted, w, out, layout, out_sorted, activation, tile, a_row_div)
    block_m = layout.block_m
    gated = activation is not None and activation.is_gated
    n_out, k = out.shape[1], w.k
    a_desc = TensorDescriptor(a_sorted, list(a_sorted.shape), [a_sorted.stride(0), 1], [block_m, tile.block_k])
    num_experts = layout.expert_counts.numel()
    bias, bias_strides = bias_args(w)
    args = (a_desc, w.descriptor(tile.block_n, tile.block_k), bias, out,
            layout.sorted_slots, layout.expert_ends, layout.expert_counts,
            layout.max_blocks, num_experts, n_out, k, w.data.shape[1], *bias_strides,
            out.stride(0), out.stride(1), *activation_args(activation))
    constexprs = dict(
        GATED=gated, ACTIVATION=activation_code(activation), HAS_BIAS=w.bias is not None,
        OUT_SORTED=out_sorted, IEEE=a_sorted.dtype == torch.float32, E_PAD=experts_pad(num_experts),
        BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )
    grid = (layout.max_blocks * cdiv(n_out, tile.block_n),)
    return Launch(grid, args, constexprs, kernel=(_MODULE, "moe_gemm_tma_a_kernel"))


def gemm2_output(tile: TileConfig, y: torch.Tensor, rows: int, num_slots: int) -> tuple[torch.Tensor, bool]:
    """Where a GEMM2 with ``tile`` (TMA-A here, or `gemm_wgmma`'s fp8) writes, and whether its rows stay sorted:
    ``y``'s first ``rows`` (the layout's, padding included) in sorted order where the tile stores by TMA
    (``tma_store``: TMA cannot scatter rows to their slots), else ``y``'s first ``num_slots``, one per slot."""
    return (y[:rows], True) if tile.tma_store else (y[:num_slots], False)


def gemm1_operand(x: torch.Tensor, layout: BlockLayout, top_k: int, tile: TileConfig,
                  dst: torch.Tensor) -> tuple[TileConfig, torch.Tensor, int | None]:
    """GEMM1's tile, A operand and rows per token: ``x`` itself for a ``gather`` tile, whose loader copies each
    slot's row (gemm_ws.py); else ``x``'s rows gathered into ``dst`` in the layout's order (`gather_sorted_rows`).
    A gather tile on rows its loader cannot copy (a strided view: `gemm_ws.can_gather`) runs without its loader,
    on gathered rows."""
    if tile.gather and not can_gather(x, tile):
        tile = dataclasses.replace(tile, gather=False)
    if tile.gather:
        return tile, x, top_k
    return tile, gather_sorted_rows(x, layout, top_k, dst), None


def sorted_tma_a_gemms(x: torch.Tensor, w13: WeightOperand, w2: WeightOperand, layout: BlockLayout,
                       activation: Activation, config: LaunchConfig, workspace, num_slots: int,
                       top_k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Both GEMMs of a config whose ``gemm1.tma_a`` is set (gemm2's may be), in the workspace's ``y``; no
    allocation. Returns ``(y, slot_rows)``: ``y [num_slots, H]`` (the module docstring) and None, or, where GEMM2's
    tile stores by TMA (``tma_store``), ``y`` with the layout's rows in sorted order and the layout's ``slot_rows``
    (slot s's row of y), for the sum over k."""
    rows = layout.sorted_slots.numel()
    y = workspace["y"]
    gemm1, a, a_row_div = gemm1_operand(x, layout, top_k, config.gemm1, y)  # y: read by GEMM1 before GEMM2 writes
    if config.gemm2.tma_a:
        inter = workspace["inter"][:rows]
        tma_a_gemm_launch(a, w13, inter, layout, True, activation, gemm1, a_row_div).run()
        out, out_sorted = gemm2_output(config.gemm2, y, rows, num_slots)
        tma_a_gemm_launch(inter, w2, out, layout, out_sorted, None, config.gemm2).run()
        return out, layout.slot_rows if out_sorted else None
    else:
        inter = workspace["inter"][:num_slots]
        tma_a_gemm_launch(a, w13, inter, layout, False, activation, gemm1).run()
        grouped_gemm(inter, None, w2, y[:num_slots], SortedRows(layout, num_slots, 1), None,
                     config.block_m, config.gemm2)
    return y[:num_slots], None
