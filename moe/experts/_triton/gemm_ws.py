"""The warp-specialized, persistent grouped GEMMs (``TileConfig.ws``; SM90, Gluon): dense and fp8 128-block.

A ``ws`` tile is a ``tma_a`` tile (gemm_tma_a.py: the same row gather, the same sorted intermediate, the
same outputs) whose GEMM is `_gemm_ws.moe_gemm_ws_kernel` instead of the Triton descriptor loop: a
one-warp loader partition keeps a ring of ``num_stages`` TMA buffers ahead of the wgmma warps, and one
program per SM walks the tiles, so the loads of a tile's first K steps run under the previous tile's
last wgmmas and epilogue. Why a Gluon kernel: Triton 3.6 failed to compile, or hung, the TMA-A loop with
``warp_specialize=True`` (benchmarks/results/tma_a_nvidia-h100.md); Gluon states the partitions, their
barriers and their registers itself.

An fp8_block tile with ``wgmma`` and ``ws`` set is the same for the wgmma tiles (gemm_wgmma.py: the same
gathered e4m3 rows and group-major scales, the same sorted intermediate): `gemm_wgmma.wgmma_gemm_launch`
launches `_gemm_ws.moe_gemm_fp8_ws_kernel` for them through `persistent_launch`, the wgmma kernel's
scaled K steps fed by the same loader partition.
"""

from __future__ import annotations

import functools

import torch

from moe.activation import Activation
from moe.errors import MoEConfigError
from moe.experts._triton import cdiv
from moe.experts._triton.align import BlockLayout, experts_pad
from moe.experts._triton.config import TileConfig
from moe.experts._triton.gemm import Launch, activation_args, activation_code, bias_args
from moe.experts._triton.support import require_sm90
from moe.experts._triton.weights import WeightOperand

_MODULE = "gemm_ws"
LOADER_REGS = 32  # the loader warp's registers (scalar work: the tile walk and its TMA issues)
GATHER_LOADER_REGS = 40  # a gather tile's four loader warps hold the block's row pointers too (32 spilled 8 bytes)
_REGISTER_FILE = 65536  # 32-bit registers per SM (SM90)
_SHARED_PER_SM = 228 * 1024  # bytes of shared memory per SM (SM90)
_RESERVED_PER_PROGRAM = 1024 + 256  # the driver's 1 KiB per resident program, and the ring's mbarriers


def max_registers(num_warps: int, programs_per_sm: int = 1) -> int:
    """``maxnreg`` of a launch: the register file shared by the ``num_warps`` wgmma warps and the loader's
    warpgroup (registers are allotted per warpgroup of 4 warps) of each of ``programs_per_sm`` programs, a
    multiple of 8. The loader gives all but `LOADER_REGS` back to the wgmma warps, whose accumulators need
    them."""
    return min(232, _REGISTER_FILE // (programs_per_sm * 32 * (num_warps + 4)) // 8 * 8)


def fp8_programs_per_sm(tile: TileConfig, block_m: int, width: int, staged: int = 0) -> int:
    """Programs per SM of an fp8_block ``ws`` tile whose wgmma is ``width`` columns wide: two for one
    warpgroup (4 warps) where two rings (``num_stages`` 128-column K steps of A and W) fit in shared memory,
    each with its output tile where that leaves by TMA (``staged`` bytes beside the ring), else one. Two one-warpgroup
    programs run their K loops, waits and epilogues independently, where the two warpgroups of one 128-row
    program meet at a barrier every K step (the one Gluon puts before a buffer goes back to the loader). Under
    the halved ``maxnreg`` a wgmma of at most 128 columns (`check_wgmma_operands`) still compiles; a dense
    256-column one does not. Dense bf16 tiles keep one program per SM: their one-warpgroup tiles whose rings fit
    twice ran slower than the tables' tiles that way (session 17).
    H200 timings: benchmarks/results/fp8_block_ws_nvidia-h200.md, bf16_ws_nvidia-h200.md."""
    ring = ring_bytes(tile, block_m, width, 1)  # e4m3 operands, 128-column K steps
    return 2 if tile.num_warps == 4 and 2 * (ring + staged + _RESERVED_PER_PROGRAM) <= _SHARED_PER_SM else 1


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def check_ws(a_sorted: torch.Tensor) -> None:
    """What the dense kernel needs beyond a tma_a tile's (`gemm_tma_a._check_operands`: dense weights in the
    activations' dtype, A rows TMA can load; `LaunchConfig`: 64-row blocks): an SM90 GPU (wgmma, Gluon's warp
    specialization) and 16-bit activations."""
    require_sm90(a_sorted.device, "ws")
    if a_sorted.dtype not in (torch.bfloat16, torch.float16):
        raise MoEConfigError(f"ws=True tiles run bf16 or fp16 activations and weights (got {a_sorted.dtype}); "
                             f"use ws=False")


def persistent_launch(kernel: str, a_sorted: torch.Tensor, layout: BlockLayout, n_out: int, tile: TileConfig,
                      args: tuple, constexprs: dict, programs_per_sm: int = 1) -> Launch:
    """The launch of ``kernel`` (this module's dense or fp8 ws kernel) for a ``ws`` tile: the loader's register
    split, and ``programs_per_sm`` programs per SM, or one per tile where the most tiles any M of this layout can
    have are fewer (the kernel stops at those the routing filled)."""
    tiles = layout.max_blocks * cdiv(n_out, tile.block_n)
    index = a_sorted.device.index if a_sorted.device.index is not None else torch.cuda.current_device()
    constexprs = dict(constexprs, LOADER_REGS=GATHER_LOADER_REGS if tile.gather else LOADER_REGS,
                      num_warps=tile.num_warps,
                      maxnreg=max_registers(tile.num_warps, programs_per_sm))
    programs = programs_per_sm * _sm_count(index)
    return Launch((max(1, min(tiles, programs)),), args, constexprs, kernel=(_MODULE, kernel))


def store_descriptor(out: torch.Tensor, block_m: int, block_n: int):
    """A TMA descriptor of the sorted output ``out [rows, N]`` by ``[block_m, block_n]`` blocks, for a ws tile's
    epilogue to store through; None where TMA cannot address it (rows or a block's row less than 16 bytes apart,
    or a base not 16-byte aligned): the epilogue then stores from registers."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    size = out.element_size()
    if out.stride(1) != 1 or (out.stride(0) * size) % 16 or out.data_ptr() % 16 or block_n * size < 16:
        return None
    element = gl.bfloat16 if out.dtype == torch.bfloat16 else gl.float16
    return TensorDescriptor(out, list(out.shape), [out.stride(0), 1], [block_m, block_n],
                            gl.NVMMASharedLayout.get_default_for([block_m, block_n], element))


def staged_output(out: torch.Tensor, out_sorted: bool, tile: TileConfig, block_m: int):
    """The output descriptor a ws tile's epilogue stores through by TMA: where the tile asks for it (``tma_store``),
    its output is sorted (TMA cannot scatter rows to slots) and TMA can address it (`store_descriptor`); else None,
    and the epilogue stores from registers."""
    return store_descriptor(out, block_m, tile.block_n) if tile.ws and tile.tma_store and out_sorted else None


def ring_bytes(tile: TileConfig, block_m: int, width: int, element_size: int) -> int:
    """Shared memory of a ws program's ring: ``num_stages`` K steps of ``block_m`` A rows and ``width`` W rows."""
    return tile.num_stages * (block_m + width) * tile.block_k * element_size


def _shared_parts(tile: TileConfig, block_m: int, gated: bool, element_size: int,
                  out_size: int | None) -> tuple[int, int, int]:
    """(W rows per K step, ring bytes, staged output bytes) of a ws tile."""
    width = (2 if gated else 1) * tile.block_n
    staged = block_m * tile.block_n * (out_size or element_size) if tile.tma_store else 0
    return width, ring_bytes(tile, block_m, width, element_size), staged


def fits_shared_memory(tile: TileConfig, block_m: int, gated: bool, element_size: int,
                       out_size: int | None = None) -> bool:
    """Whether a ws tile's ring (``element_size`` bytes an operand) and, with ``tma_store``, its staged output tile
    (``out_size`` bytes an element; the operands' by default) fit beside the driver's share."""
    _, ring, staged = _shared_parts(tile, block_m, gated, element_size, out_size)
    return ring + staged + _RESERVED_PER_PROGRAM <= _SHARED_PER_SM


def check_shared_memory(tile: TileConfig, block_m: int, gated: bool, element_size: int,
                        out_size: int | None = None) -> None:
    """A ws tile's ring (``num_stages`` K steps of A and W) and, with ``tma_store``, its staged output tile must
    fit in an SM's shared memory (`fits_shared_memory`): a clear error before a launch that would fail with "out of
    resources"."""
    if fits_shared_memory(tile, block_m, gated, element_size, out_size):
        return
    width, ring, staged = _shared_parts(tile, block_m, gated, element_size, out_size)
    raise MoEConfigError(
        f"a ws tile's ring ({tile.num_stages} stages of {block_m} + {width} rows x {tile.block_k}: {ring} bytes)"
        f"{f' and its staged output tile ({staged} bytes)' if staged else ''} must fit in "
        f"{_SHARED_PER_SM - _RESERVED_PER_PROGRAM} bytes of shared memory (got {tile}, block_m {block_m}); use "
        f"fewer num_stages{' or tma_store=False' if staged else ''}")


def can_gather(a: torch.Tensor, tile: TileConfig) -> bool:
    """Whether a ``gather`` tile's loader can copy ``a``'s rows: 16-byte pieces of whole K steps
    (`TileConfig.gather`)."""
    return (a.shape[1] % tile.block_k == 0 and a.stride(1) == 1 and (a.stride(0) * a.element_size()) % 16 == 0
            and a.data_ptr() % 16 == 0)


def check_gather(a: torch.Tensor, tile: TileConfig, a_row_div: int | None) -> None:
    """`can_gather`, and the rows per token that turn a slot into its row of ``a``: a clear error otherwise."""
    if a_row_div is None:
        raise MoEConfigError(f"a gather=True tile reads the unsorted activations: it runs as GEMM1 of "
                             f"gemm_tma_a.sorted_tma_a_gemms, given the rows per token (got {tile})")
    if not can_gather(a, tile):
        raise MoEConfigError(f"a gather=True tile copies whole block_k steps of 16-byte-aligned rows: K must be a "
                             f"multiple of block_k and the rows 16-byte multiples apart (got K = {a.shape[1]}, "
                             f"row stride {a.stride(0)}, {tile}); use gather=False")


def ws_gemm_launch(a_sorted: torch.Tensor, w: WeightOperand, out: torch.Tensor, layout: BlockLayout,
                   out_sorted: bool, activation: Activation | None, tile: TileConfig,
                   a_row_div: int | None = None) -> Launch:
    """The launch of ``out = act(a_sorted @ w[expert].T + bias[expert])`` over the layout's blocks, as
    `gemm_tma_a.tma_a_gemm_launch` (which calls this for ``ws`` tiles): one program per SM, or fewer. A ``gather``
    tile reads row ``slot // a_row_div`` of the unsorted ``a_sorted`` for each slot instead."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    check_ws(a_sorted)
    if tile.gather:
        check_gather(a_sorted, tile, a_row_div)
    block_m = layout.block_m
    gated = activation is not None and activation.is_gated
    n_out, k = out.shape[1], w.k
    element = gl.bfloat16 if a_sorted.dtype == torch.bfloat16 else gl.float16
    a_desc = TensorDescriptor(a_sorted, list(a_sorted.shape), [a_sorted.stride(0), 1], [block_m, tile.block_k],
                              gl.NVMMASharedLayout.get_default_for([block_m, tile.block_k], element))
    num_experts = layout.expert_counts.numel()
    bias, bias_strides = bias_args(w)
    check_shared_memory(tile, block_m, gated, a_sorted.element_size())
    out_desc = staged_output(out, out_sorted, tile, block_m)
    args = (a_desc, w.descriptor(tile.block_n, tile.block_k, gluon=True), out_desc or a_desc, a_sorted, bias, out,
            layout.sorted_slots, layout.expert_ends, layout.expert_counts,
            num_experts, n_out, k, w.data.shape[1], a_sorted.stride(0), *bias_strides, out.stride(0), out.stride(1),
            *activation_args(activation))
    constexprs = dict(
        GATED=gated, ACTIVATION=activation_code(activation), HAS_BIAS=w.bias is not None,
        OUT_SORTED=out_sorted, TMA_STORE=out_desc is not None, E_PAD=experts_pad(num_experts),
        BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
        STAGES=tile.num_stages, GATHER=tile.gather, A_ROW_DIV=a_row_div if tile.gather else 1,
    )
    return persistent_launch("moe_gemm_ws_kernel", a_sorted, layout, n_out, tile, args, constexprs)

