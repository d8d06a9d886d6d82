"""How FlashInfer's CuTe-DSL MoE kernels serve each scheme: the weights they take, and one strategy
per mode of ``flashinfer_cutedsl`` (the wrapper class, its weights, buffers and ``run`` call).

Canonical ``ExpertWeights`` -> what the kernels take, once at load:

    kernel                                 first GEMM rows                          block scales
    CuteDslMoEWrapper (NVFP4, SM100)       [up; gate] interleaved by 64 rows        128x4 swizzle, 6-D MMA view
    CuteDslBf16MoEWrapper (BF16, SM90)     [up; gate] interleaved by 32 rows        -
    masked grouped GEMM (NVFP4, batched)   [gate; up] as is (silu_and_mul reads     128x4 swizzle, 6-D MMA view
                                           the first half as the gate)

Non-gated (relu2) first-GEMM rows are never interleaved.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from moe.experts._flashinfer import layouts
from moe.experts._flashinfer.base import FlashInferExperts
from moe.experts._flashinfer.layouts import Geometry
from moe.formats import Dispatched
from moe.problem import MoEProblem
from moe.weights import ExpertWeights
from moe.workspace import Workspace


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


class CuteDslScheme:
    """One scheme of the CuTe-DSL wrappers: ``wrapper`` names the FlashInfer class
    (``flashinfer.fused_moe.cute_dsl``), built once per problem and device at load."""

    wrapper: str

    def prepare(self, experts: FlashInferExperts, weights: ExpertWeights) -> CuteDslWeights:
        raise NotImplementedError

    def wrapper_options(self, device: torch.device) -> dict[str, Any]:
        """The wrapper's constructor arguments beyond the problem's sizes and activation."""
        return {}

    def buffers(self, problem: MoEProblem, geo: Geometry, rows: int) -> dict:
        """The workspace ``run`` writes beyond the output (declared from the problem alone)."""
        return {}

    def run(self, experts: FlashInferExperts, dispatched: Dispatched, w: CuteDslWeights, ws: Workspace,
            out: torch.Tensor) -> torch.Tensor:
        """Runs the wrapper on ``dispatched`` (at least one row) into ``out``; returns ``out``."""
        raise NotImplementedError


class Nvfp4Wrapper(CuteDslScheme):
    """W4A4: NVFP4 activations from prepare, the intermediate quantized in-kernel with the static
    ``intermediate_scale`` (its inverse made once here)."""

    wrapper = "CuteDslMoEWrapper"

    def prepare(self, experts, weights):
        prepared = prepare_nvfp4(weights, experts.problem, interleave_group=64)
        quant = torch.full((1,), 1.0 / experts.intermediate_scale, device=weights.device)
        return replace(prepared, per_expert={**prepared.per_expert, "fc2_input_scale": quant})

    def wrapper_options(self, device):
        return {"use_cuda_graph": True, "device": str(device), "quant_mode": "w4a4"}

    def buffers(self, problem, geo, rows):
        local = problem.local_num_experts
        return {"w1_alpha": ((local,), torch.float32), "w2_alpha": ((local,), torch.float32)}

    def run(self, experts, dispatched, w, ws, out):
        x = dispatched.x
        w1_alpha = torch.mul(w.per_expert["w13_global"], x.global_scale, out=ws["w1_alpha"])
        w2_alpha = torch.mul(w.per_expert["w2_global"], experts.intermediate_scale, out=ws["w2_alpha"])
        result = w.wrapper.run(
            x=x.data, x_sf=x.scale, token_selected_experts=dispatched.topk.ids.contiguous(),
            token_final_scales=dispatched.topk.weights.contiguous(),
            w1_weight=w.w13, w1_weight_sf=w.w13_scale, w1_alpha=w1_alpha,
            fc2_input_scale=w.per_expert["fc2_input_scale"],
            w2_weight=w.w2, w2_weight_sf=w.w2_scale, w2_alpha=w2_alpha,
        )
        return out.copy_(result)  # run() allocates its own output


class Bf16Wrapper(CuteDslScheme):
    """BF16 on SM90: the output written into the workspace."""

    wrapper = "CuteDslBf16MoEWrapper"

    def prepare(self, experts, weights):
        return prepare_bf16(weights, experts.problem)

    def run(self, experts, dispatched, w, ws, out):
        topk = dispatched.topk
        w.wrapper.run(dispatched.x.data, topk.ids.contiguous(), topk.weights.contiguous(), w.w13, w.w2, moe_output=out)
        return out
