"""``batched``: one rank, batched format -- tokens scattered into per-expert buffers ``[E_local, T, H]``.

T, the rows per expert, is fixed at construction (``max_tokens_per_expert``, default the problem's
``max_tokens``, which always suffices since a token picks an expert at most once). Shapes never depend
on routing data, so the experts' launch is CUDA-graph friendly; the capacity check itself reads the
largest count on the host.
"""

from __future__ import annotations

import torch

from moe.errors import MoEConfigError
from moe.formats import ActivationFormat, Dispatched, DispatchShape, ExpertsOutput, OutputKind
from moe.prepare_finalize.base import PrepareFinalize, Ranks, Transport, combine_slots
from moe.prepare_finalize.local import QUANTIZABLE, quantize_activations
from moe.problem import MoEProblem
from moe.quant import QuantFormat, QuantizedTensor
from moe.registry import register_prepare_finalize
from moe.router import TopK
from moe.workspace import Workspace, WorkspaceShapes


def batch_slots(local_ids: torch.Tensor, num_local: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Places each (token, slot) in its expert's buffer, in token order; no host sync.

    ``local_ids [M, k]`` (local expert ids, -1: not here) -> (``slot_rows [M, k]`` int64 row in the
    flattened ``[num_local * capacity]`` buffer or -1, ``tokens_per_expert [num_local]`` int32).
    A count above ``capacity`` leaves rows past the buffer; callers check the counts first.
    """
    key = torch.where(local_ids >= 0, local_ids, num_local).flatten().long()  # not here: a last bucket
    order = key.argsort(stable=True)
    counts = torch.zeros(num_local + 1, dtype=key.dtype, device=key.device)
    counts.scatter_add_(0, key, torch.ones_like(key))  # bincount would read its size on the host
    sorted_key = key[order]
    position = torch.arange(key.numel(), device=key.device) - (counts.cumsum(0) - counts)[sorted_key]
    rows = torch.full_like(key, -1)
    rows[order] = torch.where(sorted_key < num_local, sorted_key * capacity + position, -1)
    return rows.view_as(local_ids), counts[:num_local].to(torch.int32)


@register_prepare_finalize
class BatchedPrepareFinalize(PrepareFinalize):
    name = "batched"
    transport = Transport(ActivationFormat.BATCHED, QUANTIZABLE, ranks=frozenset({Ranks.ONE}))

    def __init__(self, problem: MoEProblem, max_tokens_per_expert: int | None = None):
        super().__init__(problem)
        capacity = problem.max_tokens if max_tokens_per_expert is None else max_tokens_per_expert
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise MoEConfigError(f"max_tokens_per_expert must be a positive int (got {capacity!r})")
        self.capacity = capacity
        # the expert map on each device prepare has seen: built on the first call there, not per call
        self._expert_maps: dict[torch.device, torch.Tensor] = {}
        self._row_layout = _row_probe(problem)

    def dispatch_shape(self, num_tokens: int) -> DispatchShape:
        return DispatchShape(ActivationFormat.BATCHED, self.capacity)

    def workspace_shapes(self, num_tokens: int) -> WorkspaceShapes:
        return _expert_buffers(self.problem, self.capacity, self._row_layout)

    @classmethod
    def declared_workspace(cls, problem: MoEProblem) -> tuple[DispatchShape, WorkspaceShapes]:
        capacity = problem.max_tokens  # the default max_tokens_per_expert
        return DispatchShape(ActivationFormat.BATCHED, capacity), _expert_buffers(problem, capacity, _row_probe(problem))

    def _expert_map(self, device: torch.device) -> torch.Tensor:
        """int32 ``[E]`` on ``device``: global id -> local id, -1 elsewhere (copied there once)."""
        if device not in self._expert_maps:
            p = self.problem
            self._expert_maps[device] = p.parallel.global_to_local_tensor(p.num_experts, device)
        return self._expert_maps[device]

    def prepare(
        self, hidden: torch.Tensor, topk: TopK, quantize_to: QuantFormat, workspace: Workspace
    ) -> Dispatched:
        p = self.problem
        slot_rows, counts = batch_slots(self._expert_map(hidden.device)[topk.ids.long()], p.local_num_experts,
                                        self.capacity)
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
        return Dispatched(ActivationFormat.BATCHED, batched, topk, tokens_per_expert=counts, slot_rows=slot_rows)

    def finalize(
        self, output: ExpertsOutput, dispatched: Dispatched, topk: TopK, shared_output: torch.Tensor | None = None
    ) -> torch.Tensor:
        if output.kind is OutputKind.REDUCED:
            raise MoEConfigError("batched finalize takes per-slot output; experts declared reduced")
        flat = output.out.reshape(-1, output.out.shape[-1])
        rows = dispatched.slot_rows
        per_slot = torch.where((rows >= 0).unsqueeze(-1), flat[rows.clamp(min=0)], 0)
        return combine_slots(per_slot, topk, output.kind, self.problem.dtype, shared_output)


def _row_probe(problem: MoEProblem) -> QuantizedTensor:
    """One row in the activation format: its data and scale layout, read off a tiny quantization."""
    return quantize_activations(torch.ones(1, problem.hidden_size, dtype=problem.dtype), problem.quant.activation)


def _expert_buffers(problem: MoEProblem, capacity: int, probe: QuantizedTensor) -> WorkspaceShapes:
    """The dispatched activations are the experts' input: ``[E_local, T, H(/2 packed)]`` + row scales,
    laid out like ``probe``, one row quantized to the activation format."""
    e_local = problem.local_num_experts
    buffers = {"x": ((e_local, capacity, probe.data.shape[-1]), probe.data.dtype)}
    if probe.scale is not None and probe.scale.dim() > 0:
        buffers["x_scale"] = ((e_local, capacity, probe.scale.shape[-1]), probe.scale.dtype)
    return WorkspaceShapes.of(**buffers)
