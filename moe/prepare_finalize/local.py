"""``local``: one rank, standard format. Quantizes activations when the experts want them quantized."""

from __future__ import annotations

import torch

from moe.formats import ActivationFormat, Dispatched, DispatchShape, ExpertsOutput, OutputKind
from moe.prepare_finalize.base import QUANTIZABLE, PrepareFinalize, Ranks, Transport, add_shared
from moe.prepare_finalize.combine import sum_over_k
from moe.quant import QuantFormat, quantize_activations
from moe.registry import register_prepare_finalize
from moe.router import TopK
from moe.workspace import Workspace


@register_prepare_finalize
class LocalPrepareFinalize(PrepareFinalize[None]):
    name = "local"
    transport = Transport(ActivationFormat.STANDARD, QUANTIZABLE, ranks=frozenset({Ranks.ONE}))
    returns_owned_output = True
    captures_in_cuda_graph = True

    def dispatch_shape(self, num_tokens: int) -> DispatchShape:
        return DispatchShape(ActivationFormat.STANDARD, num_tokens)

    def prepare(
        self, hidden: torch.Tensor, topk: TopK, quantize_to: QuantFormat, workspace: Workspace
    ) -> tuple[Dispatched, None]:
        return Dispatched(ActivationFormat.STANDARD, quantize_activations(hidden, quantize_to), topk), None

    def finalize(
        self, output: ExpertsOutput, dispatched: Dispatched, route: None, topk: TopK,
        shared_output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output.kind is OutputKind.REDUCED:
            return self.finalize_reduced(output.out, shared_output, owned=output.owned)
        return add_shared(sum_over_k(output.out, topk.weights, output.kind), shared_output).to(self.problem.dtype)
