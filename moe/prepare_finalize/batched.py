"""``batched``: one rank, batched format -- tokens scattered into per-expert buffers ``[E_local, T, H]``.

T, the rows per expert, is fixed at construction (``max_tokens_per_expert``, default the problem's
``max_tokens``, which always suffices since a token picks an expert at most once). Shapes never depend
on routing data, so the experts' launch is CUDA-graph friendly; the capacity check itself reads the
largest count on the host. The expert map prepare reads (global id -> local id) is built at
construction on the CPU, and on another device by `load` (which `moe.ModularKernel` calls).
"""

from __future__ import annotations

import torch

from moe.errors import MoEConfigError
from moe.formats import ActivationFormat, Dispatched, DispatchShape, ExpertsOutput, OutputKind
from moe.prepare_finalize.base import QUANTIZABLE, PrepareFinalize, Ranks, Transport, add_shared, batch_slots
from moe.prepare_finalize.combine import sum_over_k
from moe.problem import MoEProblem
from moe.quant import QuantFormat, QuantizedTensor, quantize_activations, row_layout
from moe.registry import register_prepare_finalize
from moe.router import TopK
from moe.workspace import Workspace, WorkspaceShapes


@register_prepare_finalize
class BatchedPrepareFinalize(PrepareFinalize[None]):
    name = "batched"
    transport = Transport(ActivationFormat.BATCHED, QUANTIZABLE, ranks=frozenset({Ranks.ONE}))

    def __init__(self, problem: MoEProblem, max_tokens_per_expert: int | None = None):
        super().__init__(problem)
        capacity = problem.max_tokens if max_tokens_per_expert is None else max_tokens_per_expert
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise MoEConfigError(f"max_tokens_per_expert must be a positive int (got {capacity!r})")
        self.capacity = capacity
        self._buffers = _expert_buffers(problem, capacity)
        self.load("cpu")

    def load(self, device: torch.device | str) -> None:
        """Builds the expert map, int32 ``[E]`` (global id -> local id, -1 elsewhere), on ``device``."""
        p = self.problem
        self._expert_map = p.parallel.global_to_local_tensor(p.num_experts, device)

    def dispatch_shape(self, num_tokens: int) -> DispatchShape:
        return DispatchShape(ActivationFormat.BATCHED, self.capacity)

    def workspace_shapes(self, num_tokens: int) -> WorkspaceShapes:
        return self._buffers  # T rows per expert whatever M is

    @classmethod
    def declared_workspace(cls, problem: MoEProblem) -> tuple[DispatchShape, WorkspaceShapes]:
        capacity = problem.max_tokens  # the default max_tokens_per_expert
        return DispatchShape(ActivationFormat.BATCHED, capacity), _expert_buffers(problem, capacity)

    def prepare(
        self, hidden: torch.Tensor, topk: TopK, quantize_to: QuantFormat, workspace: Workspace
    ) -> tuple[Dispatched, None]:
        p = self.problem
        slot_rows, counts = batch_slots(self._local_ids(topk), p.local_num_experts, self.capacity)
        largest = int(counts.max()) if counts.numel() else 0
        if largest > self.capacity:
            raise MoEConfigError(
                f"batched prepare: an expert received {largest} tokens but max_tokens_per_expert="
                f"{self.capacity}; raise max_tokens_per_expert (at most max_tokens={p.max_tokens} is ever needed)"
            )
        q = quantize_activations(hidden, quantize_to)
        here = (slot_rows >= 0).flatten().nonzero().squeeze(1)
        dest, src = slot_rows.flatten()[here], here // p.top_k
        x = workspace["x"]
        x.view(-1, x.shape[-1])[dest] = q.data[src]
        scale = q.scale
        if scale is not None and scale.dim() > 0:
            scale = workspace["x_scale"]
            scale.view(-1, scale.shape[-1])[dest] = q.scale[src]
        batched = QuantizedTensor(data=x, scale=scale, global_scale=q.global_scale, fmt=q.fmt)
        return Dispatched(ActivationFormat.BATCHED, batched, topk, tokens_per_expert=counts, slot_rows=slot_rows), None

    def finalize(
        self, output: ExpertsOutput, dispatched: Dispatched, route: None, topk: TopK,
        shared_output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output.kind is OutputKind.REDUCED:
            raise MoEConfigError("batched finalize takes per-slot output; experts declared reduced")
        flat, rows = output.out.reshape(-1, output.out.shape[-1]), dispatched.slot_rows
        out = sum_over_k(flat[rows.clamp(min=0)], topk.weights, output.kind, valid=rows >= 0)
        return add_shared(out, shared_output).to(self.problem.dtype)

    def _local_ids(self, topk: TopK) -> torch.Tensor:
        if self._expert_map.device != topk.ids.device:
            raise MoEConfigError(
                f"{self.name}: the tokens are on {topk.ids.device} but the expert map was built for "
                f"{self._expert_map.device}; call load({str(topk.ids.device)!r}) first (a ModularKernel "
                "does it for its device)"
            )
        return self._expert_map[topk.ids.long()]


def _expert_buffers(problem: MoEProblem, capacity: int) -> WorkspaceShapes:
    """The dispatched activations are the experts' input: ``[E_local, T, H(/2 packed)]`` + row scales."""
    row, e_local = row_layout(problem.quant.activation, problem.hidden_size, problem.dtype), problem.local_num_experts
    buffers = {"x": ((e_local, capacity, row.data_columns), row.data_dtype)}
    if row.scale_columns:
        buffers["x_scale"] = ((e_local, capacity, row.scale_columns), row.scale_dtype)
    return WorkspaceShapes.of(**buffers)
