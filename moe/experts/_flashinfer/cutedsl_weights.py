"""Canonical ``ExpertWeights`` -> what FlashInfer's CuTe-DSL MoE kernels take, once at load.

    kernel                                 first GEMM rows                          block scales
    CuteDslMoEWrapper (NVFP4, SM100)       [up; gate] interleaved by 64 rows        128x4 swizzle, 6-D MMA view
    CuteDslBf16MoEWrapper (BF16, SM90)     [up; gate] interleaved by 32 rows        -
    masked grouped GEMM (NVFP4, batched)   [gate; up] as is (silu_and_mul reads     128x4 swizzle, 6-D MMA view
                                           the first half as the gate)

Non-gated (relu2) first-GEMM rows are never interleaved.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from moe.experts._flashinfer import layouts
from moe.problem import MoEProblem
from moe.weights import ExpertWeights


@dataclass(frozen=True)
class CuteDslWeights:
    """Kernel-ready CuTe-DSL tensors (and, for the wrappers, the wrapper built for this device)."""

    w13: torch.Tensor  # NVFP4: uint8 [E, R, H/2]; BF16: [E, R, H]
    w2: torch.Tensor  # NVFP4: uint8 [E, H, I/2]; BF16: [E, H, I]
    w13_scale: torch.Tensor | None = None  # 6-D MMA view (32, 4, R/128, 4, H/64, E) of e4m3 bytes
    w2_scale: torch.Tensor | None = None
    per_expert: dict[str, torch.Tensor] = field(default_factory=dict)  # NVFP4 global dequant scales [E]
    wrapper: Any = None  # the FlashInfer wrapper object, built once for this problem and device


def interleaved_first_gemm(t: torch.Tensor, problem: MoEProblem, group: int) -> torch.Tensor:
    """``[gate; up]`` -> ``[up; gate]`` interleaved by ``group`` rows (gated); as is otherwise."""
    if not problem.activation.is_gated:
        return t.contiguous()
    return layouts.interleave_row_groups(layouts.up_gate_rows(t), group)


def nvfp4_scales(scale: torch.Tensor) -> torch.Tensor:
    """e4m3 ``[E, rows, K/16]`` -> the 6-D MMA view of its 128x4 swizzle, typed e4m3."""
    return layouts.mma_scale_view(layouts.swizzle_block_scales(scale)).view(torch.float8_e4m3fn)


def prepare_nvfp4(weights: ExpertWeights, problem: MoEProblem, *, interleave_group: int | None) -> CuteDslWeights:
    """NVFP4 weights; ``interleave_group`` None keeps ``[gate; up]`` (the masked/batched pipeline)."""
    if interleave_group is None:
        w13, s13 = weights.w13.data.contiguous(), weights.w13.scale
    else:
        w13 = interleaved_first_gemm(weights.w13.data, problem, interleave_group)
        s13 = interleaved_first_gemm(layouts.as_bytes(weights.w13.scale), problem, interleave_group)
    per_expert = {"w13_global": weights.w13.global_scale.float(), "w2_global": weights.w2.global_scale.float()}
    return CuteDslWeights(
        w13, weights.w2.data.contiguous(), nvfp4_scales(s13), nvfp4_scales(weights.w2.scale), per_expert
    )


def prepare_bf16(weights: ExpertWeights, problem: MoEProblem) -> CuteDslWeights:
    return CuteDslWeights(interleaved_first_gemm(weights.w13.data, problem, 32), weights.w2.data.contiguous())
