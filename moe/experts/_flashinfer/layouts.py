"""Pure-torch weight layout transforms for the FlashInfer kernels (CPU and GPU, no flashinfer needed).

Every function is a pure function of its inputs, tested on its own (tests/test_flashinfer_layouts.py):
bit-exact against FlashInfer's CPU-capable helper where one exists, against a hand-worked example
otherwise. Conventions: expert tensors are ``[E, rows, cols]``; "rows" are output channels (N), "cols"
the reduction dimension (K, halved for packed fp4).

Worked example of the gated row orders, I = 2 (rows named by half and index)::

    canonical (moe)                    [g0, g1, u0, u1]      [gate; up]
    up_gate_rows      (CUTLASS, trtllm) [u0, u1, g0, g1]      [up; gate]
    gated_interleave_rows (trtllm-gen)  [u0, g0, u1, g1]      row r of each half, alternating
    interleave_row_groups(group=1)      [u0, g0, u1, g1]      (CuTe-DSL uses group 32 or 64)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe.problem import MoEProblem

EPILOGUE_TILE_M = 128  # trtllm-gen's epilogue tile; its row shuffle works on 32-row blocks then
E4M3_ONE = 0x38  # the e4m3 byte of 1.0: fill for padded NVFP4 scales
E8M0_ONE = 127  # the e8m0 byte of 1.0: fill for padded MX scales
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)  # padded through their bytes (fill is then a byte)


# --- gate/up order and padding ------------------------------------------------------------------


@dataclass(frozen=True)
class Geometry:
    """Sizes as the model has them and as the kernel sees them (padded to its mode's alignment)."""

    hidden: int
    inter: int
    hidden_padded: int
    inter_padded: int
    gated: bool

    @classmethod
    def of(cls, problem: MoEProblem, padded: tuple[int, int]) -> "Geometry":
        return cls(problem.hidden_size, problem.intermediate_size, padded[0], padded[1], problem.activation.is_gated)


def up_gate_rows(t: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """``[gate; up]`` -> ``[up; gate]`` along ``dim`` (weights, row scales and biases alike)."""
    gate, up = t.chunk(2, dim=dim)
    return torch.cat([up, gate], dim=dim)


def pad_dim(t: torch.Tensor, dim: int, size: int, fill: float | int = 0) -> torch.Tensor:
    """``t`` with dimension ``dim`` zero-padded (or ``fill``-padded) at the end to ``size``."""
    dim = dim % t.dim()
    if t.dtype in _FP8:
        return pad_dim(t.view(torch.uint8), dim, size, fill).view(t.dtype)
    extra = size - t.shape[dim]
    if extra < 0:
        raise ValueError(f"cannot pad dimension {dim} of size {t.shape[dim]} down to {size}")
    if extra == 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t, torch.full(shape, fill, dtype=t.dtype, device=t.device)], dim=dim)


def pad_row_halves(t: torch.Tensor, half: int, dim: int = 1, fill: float | int = 0) -> torch.Tensor:
    """Pads each half of a gated ``[a; b]`` along ``dim`` to ``half`` rows: ``[a, 0; b, 0]``."""
    first, second = t.chunk(2, dim=dim)
    return torch.cat([pad_dim(first, dim, half, fill), pad_dim(second, dim, half, fill)], dim=dim)


def pad_2d(t: torch.Tensor, rows: int, cols: int, fill: float | int = 0) -> torch.Tensor:
    """``[E, r, c]`` padded at the end to ``[E, rows, cols]``."""
    return pad_dim(pad_dim(t, 1, rows, fill), 2, cols, fill)


def first_gemm_rows(t: torch.Tensor, geo: Geometry, fill: int | float = 0) -> torch.Tensor:
    """Rows of a first-GEMM tensor ``[E, R, ...]`` (weights, row scales, biases): halves padded to I',
    then ``[up; gate]`` if gated."""
    if not geo.gated:
        return pad_dim(t, 1, geo.inter_padded, fill)
    return up_gate_rows(pad_row_halves(t, geo.inter_padded, fill=fill))


def pad_into(dst: torch.Tensor, src: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
    """Copies ``src [rows, c]`` into ``dst[:rows, :c]``, fills ``dst[:rows, c:]``; returns ``dst[:rows]``.

    The hot-path twin of ``pad_dim`` for activations: writes into a workspace view, allocates nothing.
    """
    if dst.dtype in _FP8:
        return pad_into(dst.view(torch.uint8), src.view(torch.uint8), fill).view(dst.dtype)
    rows, cols = src.shape
    out = dst[:rows]
    out[:, :cols].copy_(src)
    if cols < dst.shape[1]:
        out[:, cols:].fill_(fill)
    return out


# --- trtllm-gen row orders ----------------------------------------------------------------------


def gated_interleave_rows(rows: int) -> torch.Tensor:
    """Row indices (new row -> old row) that alternate the two halves: ``[0, R/2, 1, R/2+1, ...]``.

    trtllm-gen's fused gated activation reads row ``2r`` and ``2r + 1`` as the pair of channel ``r``.
    """
    if rows % 2:
        raise ValueError(f"a gated weight needs an even number of rows (got {rows})")
    half = rows // 2
    return torch.stack([torch.arange(half), torch.arange(half, rows)], dim=1).flatten()


def epilogue_shuffle_rows(rows: int, epilogue_tile_m: int = EPILOGUE_TILE_M) -> torch.Tensor:
    """Row indices (new row -> old row) of trtllm-gen's ``shuffleMatrixA`` for ``rows`` rows.

    Rows move within blocks of 32 (16 when the epilogue tile is not a multiple of 128): with
    ``g = block / 8``, old row ``r`` of a block lands at ``(r % g) * 8 + r // g``. For a 32-row block:
    old rows 0, 1, 2, 3, 4 go to 0, 8, 16, 24, 1.
    """
    block = 32 if epilogue_tile_m % 128 == 0 else 16
    if rows % block:
        raise ValueError(f"the trtllm-gen row shuffle needs rows to be a multiple of {block} (got {rows})")
    groups = block // 8
    old = torch.arange(rows)
    within = old % block
    new = old - within + (within % groups) * 8 + within // groups
    indices = torch.empty(rows, dtype=torch.long)
    indices[new] = old
    return indices


def trtllm_rows(rows: int, gated: bool) -> torch.Tensor:
    """The full trtllm-gen row order of a first-GEMM weight (``[up; gate]`` input): the gated
    interleave when gated, then the epilogue shuffle. Second-GEMM weights take only the shuffle."""
    shuffle = epilogue_shuffle_rows(rows)
    if not gated:
        return shuffle
    return gated_interleave_rows(rows)[shuffle]


def take_rows(t: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``t[:, indices]`` for ``[E, rows, ...]`` weights, scales and biases, contiguous."""
    if t.dtype in _FP8:
        return take_rows(t.view(torch.uint8), indices).view(t.dtype)
    return t.index_select(1, indices.to(t.device)).contiguous()


def block_major_k(t: torch.Tensor, block_k: int) -> torch.Tensor:
    """``[E, N, K] -> [E, K / block_k, N, block_k]``: trtllm-gen's BlockMajorK layout.

    The BF16 trtllm-gen kernels block the *bytes* of each row: pass the weight viewed as uint8 with
    ``block_k = 128`` (64 bf16 values per block).
    """
    experts, rows, cols = t.shape
    if cols % block_k:
        raise ValueError(f"block_major_k needs K (got {cols}) to be a multiple of block_k={block_k}")
    return t.view(experts, rows, cols // block_k, block_k).permute(0, 2, 1, 3).contiguous()


# --- block scales ---------------------------------------------------------------------------------


def swizzle_block_scales(scales: torch.Tensor) -> torch.Tensor:
    """CUTLASS/trtllm 128x4 scale swizzle: ``[E, M, S] -> [E, M'/128, S'/4, 32, 4, 4]`` bytes.

    M is padded to a multiple of 128 and S (scales per row) to a multiple of 4 with zeros. Within one
    128 x 4 tile, scale ``(m, s)`` sits at ``[m % 32][m // 32][s]``: the 4 rows 32 apart that one
    warp reads together are adjacent. The flat form of the result is FlashInfer's
    ``block_scale_interleave`` output.
    """
    experts, rows, cols = scales.shape
    raw = scales.view(torch.uint8) if scales.dtype.itemsize == 1 else scales
    raw = pad_dim(pad_dim(raw, 1, -(-rows // 128) * 128), 2, -(-cols // 4) * 4)
    m_tiles, s_tiles = raw.shape[1] // 128, raw.shape[2] // 4
    tiled = raw.reshape(experts, m_tiles, 4, 32, s_tiles, 4)  # m = tile*128 + quarter*32 + lane
    return tiled.permute(0, 1, 4, 3, 2, 5).contiguous()


def mma_scale_view(swizzled: torch.Tensor) -> torch.Tensor:
    """The 6-D view CuTe-DSL grouped GEMMs take: ``[E, Mt, St, 32, 4, 4] -> (32, 4, Mt, 4, St, E)``."""
    return swizzled.permute(3, 4, 1, 5, 2, 0)


def interleave_row_groups(t: torch.Tensor, group: int) -> torch.Tensor:
    """``[a; b]`` rows (``[E, 2n, ...]``) -> ``[a_0:g, b_0:g, a_g:2g, b_g:2g, ...]`` in groups of ``group``.

    CuTe-DSL's gated GEMM1 reads ``[up; gate]`` interleaved this way (group 64 for NVFP4 on SM100,
    32 for BF16 on SM90).
    """
    experts, rows = t.shape[:2]
    if rows % (2 * group):
        raise ValueError(f"interleaving in groups of {group} needs rows (got {rows}) to be a multiple of {2 * group}")
    rest = t.shape[2:]
    halves = t.reshape(experts, 2, rows // (2 * group), group, *rest)
    return halves.transpose(1, 2).reshape(t.shape).contiguous()


# --- routing ----------------------------------------------------------------------------------------


def pack_topk(ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """trtllm-gen's packed routing: ``(expert_id << 16) | bf16_bits(weight)`` as int32 ``[M, k]``.

    Example: expert 3 with weight 1.0 (bf16 0x3F80) packs to 0x00033F80.
    """
    bits = weights.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    packed = (ids.to(torch.int32) << 16) | bits
    if out is None:
        return packed
    return out.copy_(packed)


def unpad_view(out: torch.Tensor, cols: int) -> torch.Tensor:
    """``out[:, :cols]`` (a view; finalize copies out of it)."""
    return out if out.shape[-1] == cols else out[..., :cols]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A one-byte tensor (uint8 / e8m0 / e4m3) as its uint8 bytes."""
    if t.dtype.itemsize != 1:
        raise ValueError(f"expected one-byte elements (got {t.dtype})")
    return t.view(torch.uint8)
