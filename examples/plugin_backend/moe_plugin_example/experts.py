"""``plugin_einsum``: float32 einsums over the dequantized canonical weights -- a toy, but a real one.

Every (token, slot) gathers its expert's weights and runs both GEMMs as one batched einsum. It serves
every weight format whose activations stay unquantized, every activation, biases and expert maps, on
any device; it is meant to show the plugin mechanics, not to be fast.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe import Capabilities, Experts, Mode, register_experts
from moe.formats import ActivationFormat, Dispatched, DispatchShape, ExpertsOutput, OutputKind
from moe.problem import MoEProblem
from moe.quant import QuantFormat
from moe.quant.scheme import SCHEME_PAIRS
from moe.weights import ExpertWeights
from moe.workspace import Workspace, WorkspaceShapes


@dataclass(frozen=True)
class EinsumWeights:
    w13: torch.Tensor  # [E_local, R, H] float32
    w2: torch.Tensor  # [E_local, H, I] float32
    b13: torch.Tensor | None  # [E_local, R] float32
    b2: torch.Tensor | None  # [E_local, H] float32


@register_experts
class EinsumExperts(Experts):
    name = "plugin_einsum"
    capabilities = Capabilities(
        formats=frozenset({ActivationFormat.STANDARD}),
        modes=Mode().serving(*(pair for pair in SCHEME_PAIRS if pair[1] is QuantFormat.NONE)),
        output=OutputKind.PER_SLOT,
    )

    def prepare_weights(self, weights: ExpertWeights) -> EinsumWeights:
        weights.validate(self.problem)
        w13, w2 = weights.dequantize(torch.float32)
        as_f32 = lambda b: None if b is None else b.float()  # noqa: E731
        return EinsumWeights(w13, w2, as_f32(weights.b13), as_f32(weights.b2))

    @classmethod
    def declared_workspace(cls, problem: MoEProblem, dispatch: DispatchShape) -> WorkspaceShapes:
        return WorkspaceShapes.of(out=((dispatch.max_rows, problem.top_k, problem.hidden_size), torch.float32))

    def apply(self, dispatched: Dispatched, weights: EinsumWeights, workspace: Workspace) -> ExpertsOutput:
        p = self.problem
        x = dispatched.x.data.float()  # [M, H]
        out = workspace["out"][: x.shape[0]]
        to_local = torch.tensor(p.parallel.global_to_local(p.num_experts), device=x.device)
        local = to_local[dispatched.topk.ids.long()]  # [M, k], -1: expert not on this rank
        here = (local >= 0).unsqueeze(-1)
        e = local.clamp(min=0)
        h = torch.einsum("mh,mkrh->mkr", x, weights.w13[e])
        if weights.b13 is not None:
            h = h + weights.b13[e]
        y = torch.einsum("mki,mkhi->mkh", p.activation(h), weights.w2[e])
        if weights.b2 is not None:
            y = y + weights.b2[e]
        out.copy_(torch.where(here, y, 0.0))
        return ExpertsOutput(OutputKind.PER_SLOT, out)
