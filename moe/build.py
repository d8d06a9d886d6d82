"""``build(plan, device)``: the one step that turns the oracle's decision into kernels.

The oracle (`moe.oracle.plan`) decides from declarations and builds nothing; here each distinct
(prepare/finalize, experts) pair of the plan becomes one `ModularKernel` for the largest token bucket it
serves, composed against the platform the plan was made for. All of them take their workspace from one
`WorkspaceManager`, passed in when each is constructed: the members never run at once, so one buffer,
as large as the largest member needs, serves them all.
"""

from __future__ import annotations

import torch

from moe.kernel import ModularKernel
from moe.oracle.select import EXPERTS, PREPARE_FINALIZE, Pair, Plan
from moe.workspace import WorkspaceManager


def build(
    plan: Plan, device: torch.device | str = "cpu", workspace: WorkspaceManager | None = None
) -> dict[Pair, ModularKernel]:
    """One ModularKernel per distinct pair of ``plan``, in the order of their first bucket, taking their
    workspace from ``workspace`` (layers that never run at once may share one) or a new manager."""
    manager = WorkspaceManager(device) if workspace is None else workspace
    kernels = {}
    for pair in plan.pairs():
        problem = plan.member_problem(pair)
        pf_cls = plan.classes[PREPARE_FINALIZE][pair.prepare_finalize]
        experts_cls = plan.classes[EXPERTS][pair.experts]
        kernels[pair] = ModularKernel(pf_cls(problem), experts_cls(problem), device=device, platform=plan.platform,
                                      workspace=manager)
    return kernels
