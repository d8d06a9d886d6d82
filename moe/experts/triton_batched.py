"""``triton_batched``: the Triton MoE GEMMs for the batched format (``[E_local, T, H]`` buffers).

Each expert's rows are already contiguous, so there is no alignment step: program (m block, n
block, expert) computes rows ``m < tokens_per_expert[expert]`` and returns at once past them. The
output is per slot, ``[E_local, T, H]``; finalize applies the router weights and sums over k.
Activations arrive quantized by the prepare stage (the batched prepare quantizes real tokens only);
the intermediate is quantized here with the same format.
"""

from __future__ import annotations

from moe.experts._triton.config import ConfigTable
from moe.experts._triton.gemm import BatchedRows, grouped_gemm
from moe.experts._triton.rows import RowValidity
from moe.experts._triton.support import (
    COMMON_CAPABILITIES,
    MODES,
    check_input,
    config_key,
    extra_reasons,
    platform_reasons,
    flat_rows,
    quant_buffers,
    quantize_activation,
)
from moe.experts._triton.weights import TritonWeights, prepare_triton_weights
from moe.experts.triton import triton_sizes
from moe.experts.base import Capabilities, Experts
from moe.formats import ActivationFormat, Dispatched, DispatchShape, ExpertsOutput, OutputKind
from moe.platform import Platform
from moe.problem import MoEProblem
from moe.quant import QuantFormat
from moe.registry import register_experts
from moe.weights import ExpertWeights
from moe.workspace import Workspace, WorkspaceShapes


@register_experts
class TritonBatchedExperts(Experts):
    name = "triton_batched"
    prepared_type = TritonWeights
    capabilities = Capabilities(
        formats=frozenset({ActivationFormat.BATCHED}),
        output=OutputKind.PER_SLOT,
        quantizes_input=False,  # the batched prepare quantizes rows as it scatters them
        modes=MODES,
        **COMMON_CAPABILITIES,
    )

    @classmethod
    def extra_checks(cls, problem: MoEProblem, platform: Platform | None) -> list[str]:
        return extra_reasons(problem, platform)

    @classmethod
    def _platform_reasons(cls, platform: Platform) -> list[str]:
        return super()._platform_reasons(platform) + platform_reasons(platform)

    def prepare_weights(self, weights: ExpertWeights) -> TritonWeights:
        weights.validate(self.problem)
        # the batched buffers are already local: no expert map needed inside the kernels. Without a
        # batched table, the standard format's tiles (same shapes per expert) are the best guess.
        table = ConfigTable.load(config_key(self.problem, "batched", weights.device))
        if not table.tuned:
            table = ConfigTable.load(config_key(self.problem, "standard", weights.device))
        return prepare_triton_weights(weights, None, table)

    def prepared_sizes(self, weights: TritonWeights) -> tuple[int, int, int]:
        return triton_sizes(weights)

    @classmethod
    def declared_workspace(cls, problem: MoEProblem, dispatch: DispatchShape) -> WorkspaceShapes:
        p = problem
        rows = p.local_num_experts * dispatch.max_rows
        return WorkspaceShapes.of(
            out=((rows, p.hidden_size), p.dtype),
            inter=((rows, p.intermediate_size), p.dtype),
            **quant_buffers(p.quant.activation, "inter", rows, p.intermediate_size),
            **quant_buffers(p.quant.activation, "x", rows, p.hidden_size),
        )

    def apply(self, dispatched: Dispatched, weights: TritonWeights, workspace: Workspace) -> ExpertsOutput:
        p = self.problem
        check_input(dispatched.x, p)
        experts, per_expert, hidden = dispatched.x.data.shape
        rows = experts * per_expert
        out = workspace["out"][:rows]
        if rows == 0:
            return ExpertsOutput(OutputKind.PER_SLOT, out.view(experts, per_expert, hidden))
        config = weights.configs.lookup(max(1, dispatched.topk.num_tokens))
        batched = BatchedRows(dispatched.tokens_per_expert, per_expert)
        valid = RowValidity(counts=dispatched.tokens_per_expert, rows_per_expert=per_expert)
        x, x_scale = flat_rows(dispatched.x.data), flat_rows(dispatched.x.scale)
        if dispatched.x.fmt is QuantFormat.NONE:
            x, x_scale = quantize_activation(x, p.quant.activation, "x", workspace, valid)
        inter = workspace["inter"][:rows]
        # (config.direct, one program per slot, has no meaning here: rows are per expert already)
        grouped_gemm(x, x_scale, weights.w13, inter, batched, p.activation, config.block_m, config.gemm1)
        a2, a2_scale = quantize_activation(inter, p.quant.activation, "inter", workspace, valid)
        grouped_gemm(a2, a2_scale, weights.w2, out, batched, None, config.block_m, config.gemm2)
        return ExpertsOutput(OutputKind.PER_SLOT, out.view(experts, per_expert, hidden))
