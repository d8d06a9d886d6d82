"""The data that crosses stage boundaries: activation formats and the frozen records between stages.

    hidden [M, H] --Router--> TopK --prepare--> Dispatched --experts--> ExpertsOutput --finalize--> [M, H]

Two activation formats are the only structural contract between a PrepareFinalize and an Experts:

- ``STANDARD``: rows ``[M', H]`` with their top-k ids (M' = tokens this rank computes);
- ``BATCHED``: ``[E_local, T, H]`` plus ``tokens_per_expert [E_local]`` -- fixed shapes, CUDA-graph
  friendly; T (rows per expert) is the prepare stage's capacity.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from moe.quant import QuantizedTensor
from moe.router import TopK


class ActivationFormat(str, enum.Enum):
    STANDARD = "standard"
    BATCHED = "batched"

    def __repr__(self) -> str:
        return f"ActivationFormat.{self.name}"


class OutputKind(str, enum.Enum):
    """Who applies the router weights and sums over k.

    - ``REDUCED``: the experts did both; output ``[M', H]``.
    - ``PER_SLOT``: neither; output ``[M', k, H]`` (standard) or ``[E_local, T, H]`` (batched),
      finalize weights and sums.
    - ``PER_SLOT_WEIGHTED``: weights applied (e.g. inside the second GEMM), finalize only sums.
    """

    REDUCED = "reduced"
    PER_SLOT = "per_slot"
    PER_SLOT_WEIGHTED = "per_slot_weighted"

    def __repr__(self) -> str:
        return f"OutputKind.{self.name}"


@dataclass(frozen=True)
class DispatchShape:
    """An upper bound on what ``prepare`` hands to the experts for a given M, known before any data.

    ``max_rows``: standard format -- the most rows M' of ``x``; batched -- T, the rows per expert.
    """

    format: ActivationFormat
    max_rows: int


@dataclass(frozen=True)
class Dispatched:
    """What the experts receive.

    Example (standard, one rank, bf16): M=3 tokens, k=2 -> ``x.data [3, H] bf16``, ``x.scale None``,
    ``topk.ids [3, 2]``, ``tokens_per_expert None``, ``slot_rows None``.
    Example (batched, E_local=4, T=8): ``x.data [4, 8, H]``, ``tokens_per_expert [4] int32`` with the
    rows filled per expert, ``slot_rows [3, 2] int64`` = row of each (token, slot) in the flattened
    ``[E_local * T]`` buffer, -1 where that slot's expert is not on this rank.
    """

    format: ActivationFormat
    x: QuantizedTensor  # activations, quantized when the experts want them quantized (fmt NONE otherwise)
    topk: TopK  # standard: routing of the rows of x (global expert ids); batched: of the original M tokens
    tokens_per_expert: torch.Tensor | None = None  # int32 [E_local]; batched format only
    slot_rows: torch.Tensor | None = None  # int64 [M, k]; batched format only

    @property
    def num_rows(self) -> int:
        """M' for the standard format; T for the batched one."""
        shape = self.x.data.shape
        return shape[0] if self.format is ActivationFormat.STANDARD else shape[1]


@dataclass(frozen=True)
class ExpertsOutput:
    """What the experts return; ``out`` is a view into their workspace (finalize copies out of it), or,
    ``owned``, the fresh ``[M, H]`` tensor the kernel handed them as their ``"out"`` buffer (finalize may
    return it as it is: `moe.kernel.ModularKernel` decides, never the experts)."""

    kind: OutputKind
    out: torch.Tensor  # REDUCED [M', H]; PER_SLOT* standard [M', k, H], batched [E_local, T, H]
    owned: bool = False
