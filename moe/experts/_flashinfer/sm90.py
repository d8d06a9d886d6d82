"""Pure-torch twins of the SM90 mixed-input (W4A16 MXFP4) layouts of FlashInfer's CUTLASS MoE.

The Hopper mixed-input GEMM converts e2m1 to bf16 with a lookup that wants each 32-bit word of four
weight bytes re-ordered, and reads the e8m0 scales of a 64-row x 128-column tile as one 16-byte row
per 16 output rows. FlashInfer does the weight step with a CUDA kernel
(``interleave_moe_weights_for_sm90_mixed_gemm``) and the scale step in torch
(``interleave_moe_scales_for_sm90_mixed_gemm``); these twins do both on any device, so weights can be
prepared (and tested) on a CPU. The GPU test checks the weight twin bit-exactly against the CUDA kernel;
the CPU test checks the scale twin against FlashInfer's torch function.
"""

from __future__ import annotations

import torch

# Weight step. Per expert, rows come in pairs (r, r + 8) within each 16-row block, and columns in
# partitions of 64 values (32 bytes). Within a partition, byte column c = 8 * m + 4 * q + l
# (m = 0..3, q = 0..1, l = 0..3). One word gathers four source bytes:
#     byte 0 = row r, column c(q=0)    byte 1 = row r + 8, column c(q=0)
#     byte 2 = row r, column c(q=1)    byte 3 = row r + 8, column c(q=1)
# its 32 bits are permuted with the table below (source bit -> destination bit: each e2m1 nibble's
# sign bit is split from its 3 magnitude bits), and the four result bytes land in row r + 8 * (m % 2),
# byte columns 16 * (m // 2) + 4 * l + 0..3 of the same partition.
FP4_WORD_BIT_DESTINATION = (
    6, 7, 8, 15,  # nibble 0 (byte 0 low): magnitude bits 0-2, sign
    22, 23, 24, 31,  # nibble 1
    3, 4, 5, 12,  # nibble 2 (byte 1 low)
    19, 20, 21, 28,  # nibble 3
    0, 1, 2, 9,  # nibble 4 (byte 2 low)
    16, 17, 18, 25,  # nibble 5
    13, 10, 11, 14,  # nibble 6 (byte 3 low)
    29, 26, 27, 30,  # nibble 7
)


def _permute_word_bits(words: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(words)
    for source, destination in enumerate(FP4_WORD_BIT_DESTINATION):
        out |= ((words >> source) & 1) << destination
    return out


def interleave_mxfp4_weights(weight: torch.Tensor) -> torch.Tensor:
    """``uint8 [E, N, K/2]`` packed e2m1 -> the same shape in the SM90 mixed-GEMM layout.

    Needs N % 16 == 0 and K % 64 == 0. A bijection on nibble bits: it only moves bits.
    """
    if weight.dtype != torch.uint8 or weight.dim() != 3:
        raise ValueError(f"weight must be uint8 [E, N, K/2] (got {weight.dtype} {tuple(weight.shape)})")
    experts, rows, packed_cols = weight.shape
    if rows % 16 or (2 * packed_cols) % 64:
        raise ValueError(f"the SM90 interleave needs N % 16 == 0 and K % 64 == 0 (got N={rows}, K={2 * packed_cols})")
    parts = packed_cols // 32
    # [E, block16, half (r / r+8), r8, partition, m, q, l]
    src = weight.reshape(experts, rows // 16, 2, 8, parts, 4, 2, 4).to(torch.int64)
    words = src[:, :, 0, :, :, :, 0] | src[:, :, 1, :, :, :, 0] << 8
    words = words | src[:, :, 0, :, :, :, 1] << 16 | src[:, :, 1, :, :, :, 1] << 24  # [E, b, r8, p, m, l]
    words = _permute_word_bits(words)
    shifts = torch.arange(0, 32, 8, device=weight.device)
    out_bytes = (words.unsqueeze(-1) >> shifts) & 0xFF  # [E, b, r8, p, m, l, byte]
    out_bytes = out_bytes.reshape(experts, rows // 16, 8, parts, 2, 2, 4, 4)  # m -> (m // 2, m % 2)
    # destination [E, b, m % 2 (row half), r8, p, m // 2, l, byte]
    out = out_bytes.permute(0, 1, 5, 2, 3, 4, 6, 7)
    return out.reshape(experts, rows, packed_cols).to(torch.uint8).contiguous()


def interleave_mxfp4_scales(scales: torch.Tensor) -> torch.Tensor:
    """``uint8 [E, N, K/32]`` e8m0 scales -> ``[E, N/64, K/128, 16, 16]`` for the SM90 mixed GEMM.

    Within one 64-row x 4-scale tile, scale ``(row, g)`` goes to ``[row % 16][4 * (row // 16) + g]``:
    each 16-byte output row holds the 4 scales of 4 rows 16 apart. Needs N % 64 == 0 and K % 128 == 0.
    """
    if scales.dim() != 3 or scales.dtype.itemsize != 1:
        raise ValueError(f"scales must be one-byte [E, N, K/32] (got {scales.dtype} {tuple(scales.shape)})")
    experts, rows, groups = scales.shape
    if rows % 64 or groups % 4:
        raise ValueError(f"the SM90 scale interleave needs N % 64 == 0 and K % 128 == 0 "
                         f"(got N={rows}, K={32 * groups})")
    tiles = scales.reshape(experts, rows // 64, 4, 16, groups // 4, 4)  # row = 16 * slice + r16
    return tiles.permute(0, 1, 4, 3, 2, 5).reshape(experts, rows // 64, groups // 4, 16, 16).contiguous()
