"""The reference experts: dequantize, then compute everything in float32. The oracle of truth.

Every other backend is tested against this one. It serves every scheme, activation and format, biases
and expert maps, on any device -- slowly. It mimics the one rounding step real kernels share: when the
scheme quantizes activations, the intermediate activation (the second GEMM's input) is quantized and
dequantized with the same format before ``w2``. Its twin `WeightOnlyReferenceExperts` is the truth of
weight-only modes (`Mode.weight_only`), which keep the activations unquantized; `reference_for` picks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from moe.experts.base import Capabilities, Experts, Mode
from moe.formats import ActivationFormat, Dispatched, DispatchShape, ExpertsOutput, OutputKind
from moe.platform import Platform
from moe.problem import MoEProblem
from moe.quant import QuantFormat, QuantizedTensor, dequantize, quantize
from moe.quant.scheme import SCHEME_PAIRS
from moe.registry import register_experts
from moe.weights import ExpertWeights
from moe.workspace import Workspace, WorkspaceShapes


@dataclass(frozen=True)
class DenseWeights:
    """Float32 weights in the canonical layout, dequantized once at load, and the expert map."""

    w13: torch.Tensor  # [E_local, R, H]
    w2: torch.Tensor  # [E_local, H, I]
    b13: torch.Tensor | None  # [E_local, R]
    b2: torch.Tensor | None  # [E_local, H]
    expert_map: torch.Tensor  # int32 [E] on the weights' device: global id -> local id, -1 elsewhere


def dense_weights(weights: ExpertWeights, problem: MoEProblem) -> DenseWeights:
    w13, w2 = weights.dequantize(torch.float32)
    as_f32 = lambda b: None if b is None else b.float()  # noqa: E731
    expert_map = problem.parallel.global_to_local_tensor(problem.num_experts, weights.device)
    return DenseWeights(w13, w2, as_f32(weights.b13), as_f32(weights.b2), expert_map)


def fake_quantize(x: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """``x`` rounded through the activation format ``fmt`` and back (identity for NONE)."""
    if fmt is QuantFormat.NONE or x.shape[0] == 0:
        return x
    return dequantize(quantize(x, fmt, role="activation"), torch.float32)


def dequantize_rows(x: QuantizedTensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Activations of any format as float32 ``[n, H]``: the given rows of the flattened buffer, or all.

    Batched buffers hold stale data past each expert's count, so only valid rows are dequantized.
    """
    flat = lambda t: t if t is None or t.dim() == 0 else t.reshape(-1, t.shape[-1])  # noqa: E731
    pick = lambda t: t if t is None or t.dim() == 0 or rows is None else t[rows]  # noqa: E731
    selected = QuantizedTensor(
        data=pick(flat(x.data)), scale=pick(flat(x.scale)), global_scale=x.global_scale, fmt=x.fmt
    )
    if x.fmt is QuantFormat.NONE:
        return selected.data.float()
    return dequantize(selected, torch.float32)


@register_experts
class ReferenceExperts(Experts):
    name = "reference"
    prepared_type = DenseWeights
    capabilities = Capabilities(
        formats=frozenset(ActivationFormat),
        modes=Mode().serving(*SCHEME_PAIRS),
        output=OutputKind.PER_SLOT,
        deterministic=True,
    )

    def prepare_weights(self, weights: ExpertWeights) -> DenseWeights:
        weights.validate(self.problem)
        return dense_weights(weights, self.problem)

    def prepared_sizes(self, weights: DenseWeights) -> tuple[int, int, int]:
        return weights.w2.shape[0], weights.w2.shape[1], weights.w2.shape[2]

    @classmethod
    def declared_workspace(cls, problem: MoEProblem, dispatch: DispatchShape) -> WorkspaceShapes:
        p = problem
        if dispatch.format is ActivationFormat.BATCHED:
            out_shape = (p.local_num_experts, dispatch.max_rows, p.hidden_size)
        else:
            out_shape = (dispatch.max_rows, p.top_k, p.hidden_size)
        return WorkspaceShapes.of(out=(out_shape, torch.float32))

    def apply(self, dispatched: Dispatched, weights: DenseWeights, workspace: Workspace) -> ExpertsOutput:
        p = self.problem
        device = dispatched.x.data.device
        if dispatched.format is ActivationFormat.BATCHED:
            out = workspace["out"][:, : dispatched.num_rows]
            per_expert_rows = torch.arange(dispatched.num_rows, device=device)
            counts = dispatched.tokens_per_expert.to(torch.long)
            valid = per_expert_rows.unsqueeze(0) < counts.unsqueeze(1)  # [E_local, T]
            expert = torch.arange(p.local_num_experts, device=device).unsqueeze(1).expand_as(valid)
            rows, experts = valid.flatten().nonzero().squeeze(1), expert[valid]
            x = dequantize_rows(dispatched.x, rows)
        else:
            out = workspace["out"][: dispatched.num_rows]
            local = weights.expert_map[dispatched.topk.ids.long()].flatten()  # [M' * k]
            rows = (local >= 0).nonzero().squeeze(1)
            experts = local[rows]
            x = dequantize_rows(dispatched.x)[rows // p.top_k]
        out.zero_()
        out.reshape(-1, p.hidden_size)[rows] = self._compute(x, experts, weights)
        return ExpertsOutput(OutputKind.PER_SLOT, out)

    @property
    def intermediate_format(self) -> QuantFormat:
        """The format the intermediate is rounded through before ``w2``: the scheme's activations'."""
        return self.problem.quant.activation

    def _compute(self, x: torch.Tensor, experts: torch.Tensor, w: DenseWeights) -> torch.Tensor:
        """Both GEMMs for rows ``x [n, H]`` routed to local ``experts [n]``; float32 ``[n, H]``.

        One expert at a time (gathering per-row weight copies would need n * R * H floats); the
        intermediate is rounded through the activation format across all rows at once, as kernels do.
        """
        groups = [(e, (experts == e).nonzero().squeeze(1)) for e in experts.unique().tolist()]
        a = x.new_empty(x.shape[0], self.problem.intermediate_size)
        for e, rows in groups:
            h = x[rows] @ w.w13[e].T
            if w.b13 is not None:
                h = h + w.b13[e]
            a[rows] = self.problem.activation(h)
        a = fake_quantize(a, self.intermediate_format)
        y = x.new_empty(x.shape[0], self.problem.hidden_size)
        for e, rows in groups:
            y[rows] = a[rows] @ w.w2[e].T
            if w.b2 is not None:
                y[rows] += w.b2[e]
        return y


class WeightOnlyReferenceExperts(ReferenceExperts):
    """``reference`` as a weight-only mode computes: the scheme's weights, dequantized, with activations
    never quantized (neither the input, which prepare leaves alone, nor the intermediate). The truth of a
    backend whose mode runs weight-only on the platform (`reference_for`); not registered."""

    name = "reference_weight_only"
    capabilities = replace(ReferenceExperts.capabilities, quantizes_input=True)  # prepare: no quantization

    @property
    def intermediate_format(self) -> QuantFormat:
        return QuantFormat.NONE


def reference_for(experts_cls: type[Experts], problem: MoEProblem, platform: Platform | None) -> type[ReferenceExperts]:
    """The reference class ``experts_cls`` is held to for ``problem`` on ``platform``: the weight-only twin
    where its mode keeps quantized-scheme activations unquantized there, else ``ReferenceExperts``."""
    mode = experts_cls.capabilities.modes.get(problem.quant)
    if mode is None or problem.quant.activation is QuantFormat.NONE:
        return ReferenceExperts
    weight_only = mode.activation_format(problem.quant, platform) is QuantFormat.NONE
    return WeightOnlyReferenceExperts if weight_only else ReferenceExperts
