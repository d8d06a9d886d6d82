"""The PyTorch-native baseline: sort the (token, slot) pairs by expert, one GEMM per expert group.

On CUDA (SM90+, bf16) the groups run as one ``torch._grouped_mm`` call per GEMM; elsewhere as a loop
of ``torch.mm`` over the experts that received tokens (which needs the group sizes on the host, so it
is not CUDA-graph safe). Output is reduced: router weights applied and summed over k.

Buffers: the output, the sorted activations and both intermediates live in the workspace; the sort
itself and the ``_grouped_mm`` results are allocated by PyTorch's caching allocator (this is the
baseline the custom kernels are measured against, written the way a PyTorch user would).
"""

from __future__ import annotations

import torch

from moe.activation import ActivationKind
from moe.experts.base import Capabilities, Experts
from moe.formats import ActivationFormat, Dispatched, DispatchShape, ExpertsOutput, OutputKind
from moe.platform import Platform
from moe.problem import MoEProblem
from moe.quant import QuantFormat
from moe.registry import register_experts
from moe.weights import ExpertWeights
from moe.workspace import Workspace, WorkspaceShapes


def _use_grouped_mm(x: torch.Tensor) -> bool:
    # torch._grouped_mm has kernels for bf16 on SM90+ only
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and hasattr(torch, "_grouped_mm")
        and torch.cuda.get_device_capability(x.device) >= (9, 0)
    )


@register_experts
class TorchGroupedExperts(Experts):
    name = "torch_grouped"
    capabilities = Capabilities(
        formats=frozenset({ActivationFormat.STANDARD}),
        quant=frozenset({(QuantFormat.NONE, QuantFormat.NONE)}),
        activations=frozenset(ActivationKind),
        output=OutputKind.REDUCED,
        deterministic=True,
    )

    def prepare_weights(self, weights: ExpertWeights) -> ExpertWeights:
        weights.validate(self.problem)
        return weights

    def workspace_shapes(self, dispatch: DispatchShape) -> WorkspaceShapes:
        p = self.problem
        slots = dispatch.max_rows * p.top_k
        return WorkspaceShapes.of(
            out=((dispatch.max_rows, p.hidden_size), torch.float32),
            x_sorted=((slots, p.hidden_size), p.dtype),
            h=((slots, p.w13_rows), p.dtype),
            a=((slots, p.intermediate_size), p.dtype),
            y=((slots, p.hidden_size), p.dtype),
        )

    def apply(self, dispatched: Dispatched, weights: ExpertWeights, workspace: Workspace) -> ExpertsOutput:
        p, topk = self.problem, dispatched.topk
        x = dispatched.x.data
        num_rows, k = topk.ids.shape
        to_local = torch.tensor(p.parallel.global_to_local(p.num_experts), device=x.device)
        local = to_local[topk.ids.long()].flatten()  # [M' * k], -1: not on this rank
        # experts not on this rank sort last (key E_local) and are cut off by the group offsets
        order = torch.where(local >= 0, local, p.local_num_experts).argsort(stable=True)
        counts = torch.bincount(local[local >= 0], minlength=p.local_num_experts)
        n = int(counts.sum()) if not x.is_cuda else num_rows * k  # host sync only off-GPU
        rows, sorted_experts = order[:n], local[order[:n]]
        xs = workspace["x_sorted"][:n]
        torch.index_select(x, 0, rows // k, out=xs)
        h = self._gemm(xs, weights.w13.data, counts, sorted_experts, workspace["h"][:n])
        if weights.b13 is not None:
            h += weights.b13[sorted_experts.clamp(min=0)].to(h.dtype)
        a = workspace["a"][:n]
        a.copy_(p.activation(h.float()))
        y = self._gemm(a, weights.w2.data, counts, sorted_experts, workspace["y"][:n])
        if weights.b2 is not None:
            y += weights.b2[sorted_experts.clamp(min=0)].to(y.dtype)
        # rows of experts not on this rank (GPU path only) hold garbage: select, never multiply by 0
        weighted = y.float() * topk.weights.flatten()[rows].unsqueeze(1)
        weighted = torch.where((sorted_experts >= 0).unsqueeze(1), weighted, 0.0)
        out = workspace["out"][:num_rows]
        out.zero_()
        out.index_add_(0, rows // k, weighted)
        return ExpertsOutput(OutputKind.REDUCED, out)

    @staticmethod
    def _gemm(x, w, counts, sorted_experts, out):
        """``out[r] = x[r] @ w[e_r].T`` for rows sorted by expert ``e_r`` (counts per expert)."""
        if _use_grouped_mm(x):
            offsets = torch.cumsum(counts, 0, dtype=torch.int32)
            out.copy_(torch._grouped_mm(x, w.transpose(1, 2), offs=offsets))
            return out
        start = 0
        for e, count in enumerate(counts.tolist()):
            if count:
                torch.mm(x[start : start + count], w[e].T, out=out[start : start + count])
                start += count
        return out
