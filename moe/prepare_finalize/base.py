"""The PrepareFinalize contract: how tokens reach the experts and how their results come back.

``prepare`` turns ``hidden [M, H]`` and its ``TopK`` into a ``Dispatched`` in this class's activation
format (quantizing activations when the experts want them quantized, and, under expert parallelism,
sending tokens to the ranks that own their experts). ``finalize`` turns the experts' output back into
``[M, H]`` in the original token order: weighting and summing over k unless the experts already did.
M = 0 (an idle rank) goes through both without special cases at the call site.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from moe.errors import MoEConfigError
from moe.formats import ActivationFormat, Dispatched, DispatchShape, ExpertsOutput, OutputKind
from moe.platform import Platform
from moe.problem import MoEProblem
from moe.quant import QuantFormat
from moe.router import TopK
from moe.workspace import Workspace, WorkspaceShapes


class PrepareFinalize(ABC):
    """Base class; subclasses set ``name``, ``format`` and ``quant_formats``."""

    name: ClassVar[str]
    format: ClassVar[ActivationFormat]
    quant_formats: ClassVar[frozenset[QuantFormat]]  # activation formats prepare can quantize to
    implemented: ClassVar[bool] = True

    def __init__(self, problem: MoEProblem):
        if not isinstance(problem, MoEProblem):
            raise MoEConfigError(f"{type(self).__name__}(problem): problem must be a MoEProblem "
                                 f"(got {type(problem).__name__} {problem!r})")
        self.problem = problem

    @classmethod
    def check(cls, problem: MoEProblem, platform: Platform | None) -> list[str]:
        """Every reason this class cannot serve ``problem`` on ``platform``; empty when it can."""
        reasons = []
        if not cls.implemented:
            reasons.append("declared only: no working prepare/finalize in this build")
        return reasons

    # --- properties of the transport -----------------------------------------------------------
    @property
    def num_dispatchers(self) -> int:
        """How many ranks send tokens to this rank's experts."""
        return 1

    @property
    def output_is_reduced(self) -> bool:
        """True when finalize's output is already summed across ranks."""
        return True

    @property
    def max_tokens_per_rank(self) -> int:
        return self.problem.max_tokens

    # --- per call ------------------------------------------------------------------------------
    @abstractmethod
    def dispatch_shape(self, num_tokens: int) -> DispatchShape:
        """Upper bound on the Dispatched that ``prepare`` produces for ``num_tokens`` tokens."""

    def workspace_shapes(self, num_tokens: int) -> WorkspaceShapes:
        """Scratch that prepare/finalize need for ``num_tokens`` tokens; none by default."""
        return WorkspaceShapes()

    @abstractmethod
    def prepare(
        self, hidden: torch.Tensor, topk: TopK, quantize_to: QuantFormat, workspace: Workspace
    ) -> Dispatched:
        """Returns the experts' input; ``quantize_to`` is NONE when the experts quantize themselves."""

    @abstractmethod
    def finalize(
        self, output: ExpertsOutput, dispatched: Dispatched, topk: TopK, shared_output: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Returns a new ``[M, H]`` tensor in ``hidden``'s dtype, plus ``shared_output [M, H]`` (the
        shared experts' result) when given -- added while combining where the transport allows, so it
        costs no extra pass over the output. (The routed scaling factor needs no hook here: the Router
        folds it into ``topk.weights``, which every backend applies, so it reaches biases too.)"""


def combine_slots(
    per_slot: torch.Tensor, topk: TopK, kind: OutputKind, dtype: torch.dtype, shared_output: torch.Tensor | None = None
) -> torch.Tensor:
    """Sums ``[M, k, H]`` over k, weighting by the router weights unless already weighted, in float32,
    adding ``shared_output`` before the cast."""
    if kind is OutputKind.PER_SLOT:
        per_slot = per_slot.float() * topk.weights.unsqueeze(-1)
    elif kind is not OutputKind.PER_SLOT_WEIGHTED:
        raise MoEConfigError(f"combine_slots takes per-slot output, not {kind.value}")
    out = per_slot.sum(dim=1, dtype=torch.float32)
    if shared_output is not None:
        out += shared_output
    return out.to(dtype)


def add_shared(out: torch.Tensor, shared_output: torch.Tensor | None) -> torch.Tensor:
    """``out += shared_output`` in place (``out`` is finalize's fresh result); ``out`` when None."""
    return out if shared_output is None else out.add_(shared_output)
