"""The PyTorch-native baseline: sort the (token, slot) pairs by expert, one GEMM per expert group.

Written the way a PyTorch user would, as the baseline the custom kernels are measured against::

    sort     slots keyed by local expert (experts elsewhere last: key E_local), stable
    groups   ends[e] = searchsorted(sorted keys, e, right=True): where expert e's rows end
    gather   x_sorted[r] = x[token of sorted slot r]
    gemm1    a = act(x_sorted @ w13[e].T + b13[e])   (act in float32, rounded once)
    gemm2    y = a @ w2[e].T + b2[e]; rows of experts elsewhere zeroed
    combine  out[t] = sum_j topk_weights[t, j] * y[slot (t, j)]   (float32, fixed order: deterministic)

On CUDA (SM90+, bf16, rows a multiple of 16 bytes) each GEMM is one ``torch._grouped_mm`` call and
nothing reads routing data on the host -- shapes depend on M only, so ``apply`` captures into a CUDA
graph. Elsewhere each GEMM is a loop of ``torch.mm`` over the experts, which reads the group ends on the
host. The path is chosen once, at load (``GroupedWeights.grouped_mm``).

Buffers: the output, the sorted activations (reused for the results back in slot order) and the
activation's output live in the workspace, and so do both GEMM results on the loop path. The routing
metadata (int tensors of M·k entries, the sort's scratch), the ``_grouped_mm`` results (it has no
``out=``; the declared ``h`` and ``y`` bound them) and the float32 temporaries of the activation and
the combine come from PyTorch's caching allocator. So the class does not declare ``cuda_graph_safe``,
although it captures: the conformance kit holds graph-safe classes to allocating nothing outside
their workspace.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe.experts.base import Capabilities, Experts, Mode
from moe.formats import ActivationFormat, Dispatched, DispatchShape, ExpertsOutput, OutputKind
from moe.platform import Platform
from moe.prepare_finalize.combine import sum_over_k
from moe.problem import MoEProblem
from moe.registry import register_experts
from moe.weights import ExpertWeights
from moe.workspace import Workspace, WorkspaceShapes


@dataclass(frozen=True)
class GroupedWeights:
    """What ``apply`` reads, built once at load by ``prepare_weights``.

    With ``ParallelConfig(ep_size=2, ep_rank=1)`` and E=4: ``expert_map = [-1, -1, 0, 1]``,
    ``group_ids = [0, 1]``.
    """

    weights: ExpertWeights  # validated, canonical layout: w13 [E_local, R, H], w2 [E_local, H, I]
    expert_map: torch.Tensor  # int32 [E] on the weights' device: global id -> local id, -1 elsewhere
    group_ids: torch.Tensor  # int32 [E_local] = 0 .. E_local-1: searched for in the sorted keys
    grouped_mm: bool  # True: one torch._grouped_mm per GEMM, no host sync; False: a loop of torch.mm


def grouped_mm_serves(problem: MoEProblem, platform: Platform) -> bool:
    """Whether ``torch._grouped_mm`` runs this problem on ``platform`` without reading the group ends on
    the host: its CUTLASS kernels take bf16 on SM90+ (elsewhere it falls back to a loop that does), with
    rows whose strides are multiples of 16 bytes (H and I; it raises otherwise, on any device)."""
    row_bytes = (problem.hidden_size * problem.dtype.itemsize, problem.intermediate_size * problem.dtype.itemsize)
    return (
        platform.is_cuda
        and platform.capability_at_least(9)
        and problem.dtype == torch.bfloat16
        and all(n % 16 == 0 for n in row_bytes)
        and hasattr(torch, "_grouped_mm")
    )


@register_experts
class TorchGroupedExperts(Experts):
    name = "torch_grouped"
    prepared_type = GroupedWeights
    capabilities = Capabilities(
        formats=frozenset({ActivationFormat.STANDARD}),
        modes=Mode().serving("unquantized"),
        output=OutputKind.REDUCED,
        deterministic=True,
    )

    def prepare_weights(self, weights: ExpertWeights) -> GroupedWeights:
        weights.validate(self.problem)
        p, device = self.problem, weights.device
        return GroupedWeights(
            weights=weights,
            expert_map=p.parallel.global_to_local_tensor(p.num_experts, device),
            group_ids=torch.arange(p.local_num_experts, dtype=torch.int32, device=device),
            grouped_mm=grouped_mm_serves(p, Platform.detect(device)),
        )

    def prepared_sizes(self, weights: GroupedWeights) -> tuple[int, int, int]:
        return super().prepared_sizes(weights.weights)

    @classmethod
    def declared_workspace(cls, problem: MoEProblem, dispatch: DispatchShape) -> WorkspaceShapes:
        p = problem
        slots = dispatch.max_rows * p.top_k
        return WorkspaceShapes.of(
            out=((dispatch.max_rows, p.hidden_size), torch.float32),
            x_sorted=((slots, p.hidden_size), p.dtype),
            h=((slots, p.w13_rows), p.dtype),
            a=((slots, p.intermediate_size), p.dtype),
            y=((slots, p.hidden_size), p.dtype),
        )

    def apply(self, dispatched: Dispatched, weights: GroupedWeights, workspace: Workspace) -> ExpertsOutput:
        p, topk, w = self.problem, dispatched.topk, weights.weights
        num_rows, k = topk.ids.shape
        slots = num_rows * k
        out = workspace["out"][:num_rows]
        if slots == 0:
            return ExpertsOutput(OutputKind.REDUCED, out)
        # 1. slots sorted by local expert, experts elsewhere last (past the last group's end)
        local = weights.expert_map.index_select(0, topk.ids.flatten())  # int32 [M' * k], -1: elsewhere
        sorted_key, order = torch.where(local >= 0, local, p.local_num_experts).sort(stable=True)
        ends = torch.searchsorted(sorted_key, weights.group_ids, right=True, out_int32=True)
        # each row's expert, to pick its bias (rows of experts elsewhere take the last one's: ignored)
        experts = sorted_key.clamp(max=p.local_num_experts - 1) if w.has_bias else None
        x_sorted = workspace["x_sorted"][:slots]
        torch.index_select(dispatched.x.data, 0, order // k, out=x_sorted)
        # 2. both GEMMs; the activation between them computes in float32 and rounds once, writing
        #    into ``a`` (in bf16 throughout, act(gate) rounds before the product: 1.2e-2 from reference
        #    at the tests' small shapes, past the bf16 bound)
        h = _gemm(x_sorted, w.w13.data, w.b13, ends, experts, workspace["h"][:slots], weights.grouped_mm)
        a = p.activation(h.float(), out=workspace["a"][:slots])
        y = _gemm(a, w.w2.data, w.b2, ends, experts, workspace["y"][:slots], weights.grouped_mm)
        # 3. back in slot order, weighted, summed over k in float32, in a fixed order (index_add_ would add
        #    in whatever order its atomics land). No GEMM wrote the rows of experts elsewhere: they hold
        #    garbage, maybe NaN, so they are zeroed, never multiplied by a zero weight
        y.masked_fill_((sorted_key == p.local_num_experts).unsqueeze(1), 0)
        per_slot = x_sorted.index_copy_(0, order, y).view(num_rows, k, p.hidden_size)  # x_sorted is free
        sum_over_k(per_slot, topk.weights, OutputKind.PER_SLOT, out=out)
        return ExpertsOutput(OutputKind.REDUCED, out)


def _gemm(x, w, bias, ends, experts, out, grouped_mm: bool) -> torch.Tensor:
    """``x[r] @ w[e].T + bias[e]`` for rows sorted by expert, expert e's rows ending at ``ends[e]``;
    rows past the last end hold garbage. Into ``out`` on the loop path; a new tensor otherwise."""
    if grouped_mm:
        out = torch._grouped_mm(x, w.transpose(1, 2), offs=ends)
    else:
        start = 0
        for e, end in enumerate(ends.tolist()):  # the group ends on the host: a sync on CUDA
            if end > start:
                torch.mm(x[start:end], w[e].T, out=out[start:end])
            start = end
    if bias is not None:
        out += bias.index_select(0, experts)
    return out
