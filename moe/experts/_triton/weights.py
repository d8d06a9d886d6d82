"""`TritonWeights`: canonical `ExpertWeights` converted once, at load, for the Triton kernels.

Only MXFP4 changes layout: inside each group of 32 elements along K, byte j holds elements j (low
nibble) and j + 16 (high nibble), instead of the canonical 2j and 2j + 1. A K-tile then splits into
two half-tiles whose A columns are contiguous runs of 16, so the kernel needs no register shuffle
to interleave nibbles. Scales, biases and the other formats keep the canonical layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe.experts._triton.config import ConfigTable
from moe.quant import QuantFormat
from moe.weights import ExpertWeights

MX_GROUP = 32


@dataclass(frozen=True)
class WeightOperand:
    """One GEMM's weights as the kernel reads them."""

    data: torch.Tensor  # [E, N, K] (MXFP4: uint8 [E, N, K/2] in the half-split layout above)
    scale: torch.Tensor | None  # canonical scale layout of the format; None when dense
    bias: torch.Tensor | None  # fp32 [E, N]
    fmt: QuantFormat

    @property
    def k(self) -> int:
        return self.data.shape[-1] * (2 if self.fmt is QuantFormat.MXFP4 else 1)


@dataclass(frozen=True)
class TritonWeights:
    w13: WeightOperand  # N = 2I [gate; up] or I
    w2: WeightOperand  # N = H
    expert_map: torch.Tensor | None  # int32 [E] global -> local id (-1: elsewhere); None: identity
    configs: ConfigTable  # launch configs for this shape, scheme and device


def mxfp4_half_split(packed: torch.Tensor) -> torch.Tensor:
    """Canonical packed e2m1 ``[..., K/2]`` (even element low) -> the half-split layout."""
    low, high = packed & 0x0F, packed >> 4
    codes = torch.stack([low, high], dim=-1).flatten(-2)  # [..., K]
    groups = codes.unflatten(-1, (-1, MX_GROUP))
    split = groups[..., : MX_GROUP // 2] | (groups[..., MX_GROUP // 2 :] << 4)
    return split.flatten(-2).contiguous()


def to_operand(q, bias: torch.Tensor | None) -> WeightOperand:
    data = q.data
    if q.fmt is QuantFormat.MXFP4:
        data = mxfp4_half_split(data)
    scale = None if q.scale is None else q.scale.contiguous()
    bias = None if bias is None else bias.float().contiguous()
    return WeightOperand(data.contiguous(), scale, bias, q.fmt)


def prepare_triton_weights(
    weights: ExpertWeights, expert_map: list[int] | None, configs: ConfigTable
) -> TritonWeights:
    device = weights.device
    identity = expert_map is None or expert_map == list(range(len(expert_map)))
    map_tensor = None if identity else torch.tensor(expert_map, dtype=torch.int32, device=device)
    return TritonWeights(
        w13=to_operand(weights.w13, weights.b13),
        w2=to_operand(weights.w2, weights.b2),
        expert_map=map_tensor,
        configs=configs,
    )
