"""FlashInfer's CuTe-DSL MoE kernels (need nvidia-cutlass-dsl, the ``cutlass`` module).

``flashinfer_cutedsl`` (standard format, output ``reduced``), one wrapper per format pair:

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
from moe.experts._flashinfer.cutedsl_weights import CuteDslWeights, prepare_bf16, prepare_nvfp4
from moe.experts._flashinfer.library import activation_type, flashinfer_module
from moe.experts._flashinfer.modes import (
    SM90_ONLY,
    SM100_FAMILY,
    ModeSpec,
    expert_map_reasons,
    mode_reasons,
    round_up,
)
from moe.experts.base import Capabilities, Experts
from moe.formats import ActivationFormat, Dispatched, DispatchShape, ExpertsOutput, OutputKind
from moe.platform import Platform
from moe.problem import MoEProblem
from moe.quant import QuantFormat
from moe.registry import register_experts
from moe.weights import ExpertWeights
from moe.workspace import Workspace, WorkspaceShapes

F = QuantFormat
_GATED_OR_RELU2 = frozenset({A.SILU, A.SWIGLU_OAI, A.RELU2})
_NVFP4_GLOBAL_RANGE = 448.0 * 6.0
_MASKED = ("grouped_gemm_nt_masked", "scaled_fp4_grouped_quantize", "silu_and_mul_scaled_nvfp4_experts_quantize")

CUTEDSL_MODES = {
    (F.NVFP4, F.NVFP4): ModeSpec("CuteDslMoEWrapper (nvfp4)", SM100_FAMILY, _GATED_OR_RELU2, h_align=128,
                                 i_align=64, i_align_nongated=128, features=("cute_dsl_moe_wrapper",)),
    (F.NONE, F.NONE): ModeSpec("CuteDslBf16MoEWrapper (bf16)", SM90_ONLY, _GATED_OR_RELU2, h_align=8, i_align=32,
                               i_align_nongated=8, features=("cute_dsl_bf16_moe_wrapper",)),
}
BATCHED_MODES = {
    (F.NVFP4, F.NVFP4): ModeSpec("grouped_gemm_nt_masked (nvfp4)", SM100_FAMILY, frozenset({A.SILU}),
                                 h_align=128, i_align=64, features=_MASKED),
}


def _swiglu_floats(problem: MoEProblem) -> dict[str, float]:
    act = problem.activation
    if act.kind is not A.SWIGLU_OAI:
        return {}
    return {"swiglu_alpha": act.alpha, "swiglu_beta": act.beta, "swiglu_limit": act.limit}


@register_experts
class FlashInferCuteDslExperts(Experts):
    name = "flashinfer_cutedsl"
    prepared_type = CuteDslWeights
    capabilities = Capabilities(
        formats=frozenset({ActivationFormat.STANDARD}),
        quant=frozenset(CUTEDSL_MODES),
        activations=_GATED_OR_RELU2,
        output=OutputKind.REDUCED,
        dtypes=frozenset({torch.bfloat16}),
        devices=frozenset({"cuda"}),
        min_capability=(9, 0),
        max_capability=(10, 3),
        libraries=("flashinfer", "cutlass"),
        bias=False,
        cuda_graph_safe=True,
        deterministic=False,
    )

    def __init__(self, problem: MoEProblem, *, intermediate_scale: float = 1.0):
        super().__init__(problem)
        self.pair = (problem.quant.weight, problem.quant.activation)
        self.intermediate_scale = float(intermediate_scale)
        first = problem.parallel.global_to_local(problem.num_experts).index(0)
        self.local_experts = (first, problem.local_num_experts)

    @classmethod
    def extra_checks(cls, problem: MoEProblem, platform: Platform | None) -> list[str]:
        return mode_reasons(CUTEDSL_MODES, problem, platform) + expert_map_reasons(problem)

    def prepare_weights(self, weights: ExpertWeights) -> CuteDslWeights:
        weights.validate(self.problem)
        if self.pair == (F.NONE, F.NONE):
            prepared = prepare_bf16(weights, self.problem)
        else:
            prepared = prepare_nvfp4(weights, self.problem, interleave_group=64)
            quant = torch.full((1,), 1.0 / self.intermediate_scale, device=weights.device)
            prepared = dataclasses.replace(prepared, per_expert={**prepared.per_expert, "fc2_input_scale": quant})
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
        if self.pair == (F.NONE, F.NONE):
            return cute_dsl.CuteDslBf16MoEWrapper(**common)
        return cute_dsl.CuteDslMoEWrapper(**common, use_cuda_graph=True, device=str(device), quant_mode="w4a4")

    @classmethod
    def declared_workspace(cls, problem: MoEProblem, dispatch: DispatchShape) -> WorkspaceShapes:
        rows, p = dispatch.max_rows, problem
        buffers = {"out": ((rows, p.hidden_size), p.dtype)}
        if (problem.quant.weight, problem.quant.activation) == (F.NVFP4, F.NVFP4):
            buffers["w1_alpha"] = ((p.local_num_experts,), torch.float32)
            buffers["w2_alpha"] = ((p.local_num_experts,), torch.float32)
        # the wrappers allocate their sort buffers and GEMM1 output themselves; accounted for here
        slots = rows * p.top_k + 128 * p.local_num_experts
        buffers["library"] = ((slots * (2 * p.w13_rows + 2 * p.hidden_size + 16),), torch.uint8)
        return WorkspaceShapes.of(**buffers)

    def apply(self, dispatched: Dispatched, weights: CuteDslWeights, workspace: Workspace) -> ExpertsOutput:
        rows = dispatched.num_rows
        out = workspace["out"][:rows]
        if not rows:
            return ExpertsOutput(OutputKind.REDUCED, out)
        ids, topk_weights = dispatched.topk.ids.contiguous(), dispatched.topk.weights.contiguous()
        w, x = weights, dispatched.x
        if self.pair == (F.NONE, F.NONE):
            w.wrapper.run(x.data, ids, topk_weights, w.w13, w.w2, moe_output=out)
            return ExpertsOutput(OutputKind.REDUCED, out)
        a2 = self.intermediate_scale
        w1_alpha = torch.mul(w.per_expert["w13_global"], x.global_scale, out=workspace["w1_alpha"])
        w2_alpha = torch.mul(w.per_expert["w2_global"], a2, out=workspace["w2_alpha"])
        result = w.wrapper.run(
            x=x.data, x_sf=x.scale, token_selected_experts=ids, token_final_scales=topk_weights,
            w1_weight=w.w13, w1_weight_sf=w.w13_scale, w1_alpha=w1_alpha,
            fc2_input_scale=w.per_expert["fc2_input_scale"],
            w2_weight=w.w2, w2_weight_sf=w.w2_scale, w2_alpha=w2_alpha,
        )
        return ExpertsOutput(OutputKind.REDUCED, out.copy_(result))  # run() allocates its own output


@register_experts
class FlashInferCuteDslBatchedExperts(Experts):
    name = "flashinfer_cutedsl_batched"
    prepared_type = CuteDslWeights
    capabilities = Capabilities(
        formats=frozenset({ActivationFormat.BATCHED}),
        quant=frozenset(BATCHED_MODES),
        activations=frozenset({A.SILU}),
        output=OutputKind.PER_SLOT,
        dtypes=frozenset({torch.bfloat16}),
        devices=frozenset({"cuda"}),
        min_capability=(10, 0),
        max_capability=(10, 3),
        libraries=("flashinfer", "cutlass"),
        bias=False,
        cuda_graph_safe=True,
        quantizes_input=True,
    )

    def __init__(self, problem: MoEProblem, *, intermediate_scale: float = 1.0):
        super().__init__(problem)
        self.intermediate_scale = float(intermediate_scale)

    @classmethod
    def extra_checks(cls, problem: MoEProblem, platform: Platform | None) -> list[str]:
        return mode_reasons(BATCHED_MODES, problem, platform) + expert_map_reasons(problem)

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
        p, w = self.problem, weights
        fi = flashinfer_module("flashinfer")
        gemm = flashinfer_module("flashinfer.gemm").grouped_gemm_nt_masked
        x, counts = dispatched.x.data, dispatched.tokens_per_expert
        rows = x.shape[1]
        out, h = _leading(workspace["out"], rows), _leading(workspace["h"], rows)
        # activation global scale per call (FlashInfer's quant multiplier), the same for every expert
        amax = x.abs().amax().float().clamp(min=1e-12)
        a1 = workspace["a1_global"].copy_((_NVFP4_GLOBAL_RANGE / amax).expand(p.local_num_experts))
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
