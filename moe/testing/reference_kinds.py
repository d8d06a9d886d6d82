"""The reference experts re-expressed in each output kind, to drive a prepare/finalize under test.

``reference`` itself returns ``per_slot`` output; a prepare/finalize must also finalize
``per_slot_weighted`` (weights applied, only the sum over k left) and, in the standard format,
``reduced`` output (nothing left to do). These twins compute the same numbers and hand them over
in the other kinds, so ``check_prepare_finalize`` can exercise every branch of ``finalize``.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from moe.experts.base import Experts
from moe.experts.reference import DenseWeights, ReferenceExperts
from moe.formats import ActivationFormat, Dispatched, DispatchShape, ExpertsOutput, OutputKind
from moe.prepare_finalize.combine import sum_over_k
from moe.problem import MoEProblem
from moe.workspace import Workspace, WorkspaceShapes


def slot_weights(dispatched: Dispatched, local_num_experts: int) -> torch.Tensor:
    """The router weight of every row of per-slot output: ``[M', k]`` or batched ``[E_local, T]``."""
    topk = dispatched.topk
    if dispatched.format is ActivationFormat.STANDARD:
        return topk.weights
    rows = dispatched.num_rows
    flat = torch.zeros(local_num_experts * rows, dtype=torch.float32, device=topk.weights.device)
    valid = dispatched.slot_rows >= 0
    flat[dispatched.slot_rows[valid]] = topk.weights[valid]
    return flat.view(local_num_experts, rows)


class WeightedReferenceExperts(ReferenceExperts):
    """``reference`` with the router weights applied: ``per_slot_weighted`` output."""

    name = "reference_per_slot_weighted"
    capabilities = replace(ReferenceExperts.capabilities, output=OutputKind.PER_SLOT_WEIGHTED)

    def apply(self, dispatched: Dispatched, weights: DenseWeights, workspace: Workspace) -> ExpertsOutput:
        out = super().apply(dispatched, weights, workspace).out
        out.mul_(slot_weights(dispatched, self.problem.local_num_experts).unsqueeze(-1))
        return ExpertsOutput(OutputKind.PER_SLOT_WEIGHTED, out)


class ReducedReferenceExperts(ReferenceExperts):
    """``reference`` weighted and summed over k: ``reduced`` output (standard format only)."""

    name = "reference_reduced"
    capabilities = replace(
        ReferenceExperts.capabilities, formats=frozenset({ActivationFormat.STANDARD}), output=OutputKind.REDUCED
    )

    @classmethod
    def declared_workspace(cls, problem: MoEProblem, dispatch: DispatchShape) -> WorkspaceShapes:
        reduced = WorkspaceShapes.of(reduced=((dispatch.max_rows, problem.hidden_size), torch.float32))
        return super().declared_workspace(problem, dispatch).merge(reduced, prefix="")

    def apply(self, dispatched: Dispatched, weights: DenseWeights, workspace: Workspace) -> ExpertsOutput:
        per_slot = super().apply(dispatched, weights, workspace).out
        out = workspace["reduced"][: dispatched.num_rows]
        sum_over_k(per_slot, dispatched.topk.weights, OutputKind.PER_SLOT, out=out)
        return ExpertsOutput(OutputKind.REDUCED, out)


def reference_experts_for(kind: OutputKind) -> type[Experts]:
    """The reference twin that hands its output over as ``kind``."""
    return {
        OutputKind.PER_SLOT: ReferenceExperts,
        OutputKind.PER_SLOT_WEIGHTED: WeightedReferenceExperts,
        OutputKind.REDUCED: ReducedReferenceExperts,
    }[kind]
