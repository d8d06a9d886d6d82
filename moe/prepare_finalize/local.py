"""``local``: one rank, standard format. Quantizes activations when the experts want them quantized."""

from __future__ import annotations

import torch

from moe.formats import ActivationFormat, Dispatched, DispatchShape, ExpertsOutput, OutputKind
from moe.prepare_finalize.base import PrepareFinalize, Ranks, Transport, combine_slots
from moe.quant import SCHEME_PAIRS, QuantFormat, QuantizedTensor, quantize
from moe.registry import register_prepare_finalize
from moe.router import TopK
from moe.workspace import Workspace

# every activation format some scheme uses (MXFP4 is a weight format only: e2m1 cannot carry a NaN)
QUANTIZABLE = frozenset(a for _, a in SCHEME_PAIRS) - {QuantFormat.NONE}


def quantize_activations(hidden: torch.Tensor, fmt: QuantFormat) -> QuantizedTensor:
    """``hidden [M, H]`` in ``fmt`` (unchanged for NONE); M = 0 gives empty data and scales."""
    if fmt is QuantFormat.NONE:
        return QuantizedTensor(data=hidden, scale=None, global_scale=None, fmt=fmt)
    # no NaN scan here: it would sync the host on every call, and a NaN still shows in the output
    return quantize(hidden, fmt, role="activation", check_finite=False)


@register_prepare_finalize
class LocalPrepareFinalize(PrepareFinalize):
    name = "local"
    transport = Transport(ActivationFormat.STANDARD, QUANTIZABLE, ranks=frozenset({Ranks.ONE}))

    def dispatch_shape(self, num_tokens: int) -> DispatchShape:
        return DispatchShape(ActivationFormat.STANDARD, num_tokens)

    def prepare(
        self, hidden: torch.Tensor, topk: TopK, quantize_to: QuantFormat, workspace: Workspace
    ) -> Dispatched:
        return Dispatched(ActivationFormat.STANDARD, quantize_activations(hidden, quantize_to), topk)

    def finalize(
        self, output: ExpertsOutput, dispatched: Dispatched, topk: TopK, shared_output: torch.Tensor | None = None
    ) -> torch.Tensor:
        dtype = self.problem.dtype
        if output.kind is not OutputKind.REDUCED:
            return combine_slots(output.out, topk, output.kind, dtype, shared_output)
        if shared_output is None:
            return output.out.to(dtype, copy=True)
        return torch.add(output.out, shared_output).to(dtype)  # one pass when out is already in dtype
