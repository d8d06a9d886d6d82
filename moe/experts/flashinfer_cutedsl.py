"""FlashInfer's CuTe-DSL MoE kernels (need nvidia-cutlass-dsl, the ``cutlass`` module).

``flashinfer_cutedsl`` (standard format, output ``reduced``), one wrapper per scheme (``CUTEDSL_MODES``;
the code of each: ``_flashinfer/cutedsl_modes.py``):

    nvfp4   SM100/SM103   ``CuteDslMoEWrapper`` (W4A4): NVFP4 activations from prepare, the
                          intermediate quantized in-kernel with the static ``intermediate_scale``
    bf16    SM90 only     ``CuteDslBf16MoEWrapper``: output written into the workspace

``flashinfer_cutedsl_batched`` (batched format, output ``per_slot``): NVFP4 weights on SM100/SM103, the
DeepGEMM-style masked pipeline fed by the batched prepare/finalize -- ``scaled_fp4_grouped_quantize``
of the ``[E, T, H]`` bf16 buffers (so it quantizes its own input), ``grouped_gemm_nt_masked`` for w13,
``silu_and_mul_scaled_nvfp4_experts_quantize``, ``grouped_gemm_nt_masked`` for w2; both GEMM outputs
live in the workspace. SiLU only (the fused activation-quantize kernel computes ``silu(gate) * up``).

The SM100 paths cannot run on the lent SM90 machines, nor can the SM90 BF16 path run there without
nvidia-cutlass-dsl: all three are tested up to the kernel call (layouts, argument contracts against the
installed FlashInfer's sources, capability checks).
"""

from __future__ import annotations

import dataclasses

import torch

from moe.activation import ActivationKind as A
from moe.experts._flashinfer import cutedsl_modes as modes
from moe.experts._flashinfer.base import (
    SM90_ONLY,
    SM100_FAMILY,
    FlashInferExperts,
    flashinfer_mode,
    nvfp4_activation_scale,
)
from moe.experts._flashinfer.cutedsl_modes import CuteDslWeights, prepare_nvfp4
from moe.experts._flashinfer.layouts import Geometry
from moe.experts._flashinfer.library import activation_type, flashinfer_module
from moe.experts.base import Capabilities, ExpertLayout
from moe.experts.mode import round_up
from moe.formats import ActivationFormat, Dispatched, DispatchShape, ExpertsOutput, OutputKind
from moe.problem import MoEProblem
from moe.registry import register_experts
from moe.weights import ExpertWeights
from moe.workspace import Workspace, WorkspaceShapes

_GATED_OR_RELU2 = frozenset({A.SILU, A.SWIGLU_OAI, A.RELU2})
_MASKED = ("grouped_gemm_nt_masked", "scaled_fp4_grouped_quantize", "silu_and_mul_scaled_nvfp4_experts_quantize")

CUTEDSL_MODES = {
    "nvfp4": flashinfer_mode("CuteDslMoEWrapper (nvfp4)", SM100_FAMILY, _GATED_OR_RELU2, h_align=128, i_align=64,
                             i_align_nongated=128, pads=False, features=("cute_dsl_moe_wrapper",),
                             strategy=modes.Nvfp4Wrapper()),
    "unquantized": flashinfer_mode("CuteDslBf16MoEWrapper (bf16)", SM90_ONLY, _GATED_OR_RELU2, h_align=8, i_align=32,
                                   i_align_nongated=8, pads=False, features=("cute_dsl_bf16_moe_wrapper",),
                                   strategy=modes.Bf16Wrapper()),
}
BATCHED_MODES = {
    "nvfp4": flashinfer_mode("grouped_gemm_nt_masked (nvfp4)", SM100_FAMILY, {A.SILU}, h_align=128, i_align=64,
                             pads=False, features=_MASKED),
}
_COMMON = dict(devices=frozenset({"cuda"}), libraries=("flashinfer", "cutlass"), expert_layout=ExpertLayout.BLOCK,
               cuda_graph_safe=True)


def _swiglu_floats(problem: MoEProblem) -> dict[str, float]:
    act = problem.activation
    if act.kind is not A.SWIGLU_OAI:
        return {}
    return {"swiglu_alpha": act.alpha, "swiglu_beta": act.beta, "swiglu_limit": act.limit}


@register_experts
class FlashInferCuteDslExperts(FlashInferExperts):
    name = "flashinfer_cutedsl"
    prepared_type = CuteDslWeights
    capabilities = Capabilities(
        formats=frozenset({ActivationFormat.STANDARD}), modes=CUTEDSL_MODES, output=OutputKind.REDUCED,
        deterministic=False, **_COMMON,
    )

    def prepare_weights(self, weights: ExpertWeights) -> CuteDslWeights:
        weights.validate(self.problem)
        prepared = self.strategy.prepare(self, weights)
        if weights.device.type == "cuda":
            prepared = dataclasses.replace(prepared, wrapper=self._wrapper(weights.device))
        return prepared

    def _wrapper(self, device: torch.device):
        """The FlashInfer wrapper for this problem (static configuration only; built once at load)."""
        p, (first, count) = self.problem, self.local_experts
        cute_dsl = flashinfer_module("flashinfer.fused_moe.cute_dsl")
        common = dict(num_experts=p.num_experts, top_k=p.top_k, hidden_size=p.hidden_size,
                      intermediate_size=p.intermediate_size, num_local_experts=count, local_expert_offset=first,
                      output_dtype=p.dtype, activation_type=activation_type(p.activation), **_swiglu_floats(p))
        return getattr(cute_dsl, self.strategy.wrapper)(**common, **self.strategy.wrapper_options(device))

    @classmethod
    def base_buffers(cls, problem: MoEProblem, g: Geometry, rows: int) -> dict:
        return {"out": ((rows, problem.hidden_size), problem.dtype)}

    @classmethod
    def scratch_bytes(cls, problem: MoEProblem, g: Geometry, rows: int) -> int:
        # the wrappers allocate their sort buffers and GEMM1 output themselves; accounted for here
        p = problem
        slots = rows * p.top_k + 128 * p.local_num_experts
        return slots * (2 * p.w13_rows + 2 * p.hidden_size + 16)

    def apply(self, dispatched: Dispatched, weights: CuteDslWeights, workspace: Workspace) -> ExpertsOutput:
        out = workspace["out"][: dispatched.num_rows]
        if dispatched.num_rows:
            self.strategy.run(self, dispatched, weights, workspace, out)
        return ExpertsOutput(OutputKind.REDUCED, out)


@register_experts
class FlashInferCuteDslBatchedExperts(FlashInferExperts):
    name = "flashinfer_cutedsl_batched"
    prepared_type = CuteDslWeights
    capabilities = Capabilities(
        formats=frozenset({ActivationFormat.BATCHED}), modes=BATCHED_MODES, output=OutputKind.PER_SLOT,
        quantizes_input=True, **_COMMON,
    )

    def prepare_weights(self, weights: ExpertWeights) -> CuteDslWeights:
        weights.validate(self.problem)
        prepared = prepare_nvfp4(weights, self.problem, interleave_group=None)
        a2_quant = torch.full((weights.num_experts,), 1.0 / self.intermediate_scale, device=weights.device)
        return dataclasses.replace(prepared, per_expert={**prepared.per_expert, "a2_global": a2_quant})

    @classmethod
    def declared_workspace(cls, problem: MoEProblem, dispatch: DispatchShape) -> WorkspaceShapes:
        p, rows = problem, dispatch.max_rows
        e = p.local_num_experts
        return WorkspaceShapes.of(
            out=((e, rows, p.hidden_size), p.dtype),
            h=((e, rows, p.w13_rows), p.dtype),
            a1_global=((e,), torch.float32),
            w1_alpha=((e,), torch.float32),
            w2_alpha=((e,), torch.float32),
            # the two NVFP4 quantizers allocate payload + swizzled scales themselves; accounted for here
            library=((e * round_up(rows, 128) * (p.hidden_size + p.intermediate_size) * 5 // 8,), torch.uint8),
        )

    def apply(self, dispatched: Dispatched, weights: CuteDslWeights, workspace: Workspace) -> ExpertsOutput:
        w, fi = weights, flashinfer_module("flashinfer")
        gemm = flashinfer_module("flashinfer.gemm").grouped_gemm_nt_masked
        x, counts = dispatched.x.data, dispatched.tokens_per_expert
        rows = x.shape[1]
        out, h = _leading(workspace["out"], rows), _leading(workspace["h"], rows)
        # activation global scale per call (FlashInfer's quant multiplier), the same for every expert
        a1 = nvfp4_activation_scale(x, workspace["a1_global"])
        w1_alpha = torch.div(w.per_expert["w13_global"], a1, out=workspace["w1_alpha"])
        w2_alpha = torch.mul(w.per_expert["w2_global"], self.intermediate_scale, out=workspace["w2_alpha"])
        options = dict(ab_dtype="float4_e2m1fn", sf_dtype="float8_e4m3fn", c_dtype="bfloat16", sf_vec_size=16,
                       alpha_dtype="float32")
        x_q, x_sf = fi.scaled_fp4_grouped_quantize(x, counts, a1)
        gemm((x_q, x_sf), (w.w13.permute(1, 2, 0), w.w13_scale), h.permute(1, 2, 0), counts,
             alpha=w1_alpha.view(1, 1, -1), **options)
        a_q, a_sf = fi.silu_and_mul_scaled_nvfp4_experts_quantize(h, counts, w.per_expert["a2_global"])
        gemm((a_q, a_sf), (w.w2.permute(1, 2, 0), w.w2_scale), out.permute(1, 2, 0), counts,
             alpha=w2_alpha.view(1, 1, -1), **options)
        return ExpertsOutput(OutputKind.PER_SLOT, out)


def _leading(buffer: torch.Tensor, rows: int) -> torch.Tensor:
    """The first ``E * rows`` rows of an ``[E, T, N]`` buffer as a contiguous ``[E, rows, N]`` view."""
    experts, _, cols = buffer.shape
    return buffer.view(-1)[: experts * rows * cols].view(experts, rows, cols)
