"""The PrepareFinalize contract: how tokens reach the experts and how their results come back.

``prepare`` turns ``hidden [M, H]`` and its ``TopK`` into a ``Dispatched`` in this class's activation
format (quantizing activations when the experts want them quantized, and, under expert parallelism,
sending tokens to the ranks that own their experts), plus the class's own record of how the rows
travelled -- its route, of type ``R`` (None for one rank). ``finalize`` takes both back and turns the
experts' output into ``[M, H]`` in the original token order: weighting and summing over k
(`moe.prepare_finalize.combine.sum_over_k`) unless the experts already did. M = 0 (an idle rank)
goes through both without special cases at the call site.

    dispatched, route = pf.prepare(hidden, topk, quantize_to, workspace)
    out = pf.finalize(experts.apply(dispatched, weights, workspace), dispatched, route, topk)

This module also holds what several transports share: the activation formats prepare can quantize
to (`QUANTIZABLE`), the one-rank check, and `batch_slots` (each slot's row in per-expert buffers).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Generic, TypeVar

import torch

from moe.errors import MoEConfigError
from moe.formats import ActivationFormat, Dispatched, DispatchShape, ExpertsOutput
from moe.platform import Platform
from moe.problem import MoEProblem
from moe.quant import SCHEME_PAIRS, QuantFormat
from moe.router import TopK
from moe.workspace import Workspace, WorkspaceShapes

# every activation format some scheme uses (MXFP4 is a weight format only: e2m1 cannot carry a NaN)
QUANTIZABLE = frozenset(a for _, a in SCHEME_PAIRS) - {QuantFormat.NONE}

R = TypeVar("R")  # a transport's record of how the rows travelled, from prepare to finalize


class PrepareFinalize(ABC, Generic[R]):
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

    @property
    def max_tokens_per_rank(self) -> int:
        return self.problem.max_tokens

    def load(self, device: torch.device | str) -> None:
        """The load step: builds what ``prepare`` reads on ``device`` (tables of the expert placement),
        so no call builds them. `moe.ModularKernel` calls it for its device when composed; a class
        used on its own is ready for the CPU once constructed. Nothing to build by default."""

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
    ) -> tuple[Dispatched, R]:
        """Returns the experts' input and the route finalize needs; ``quantize_to`` is NONE when the
        experts quantize themselves."""

    @abstractmethod
    def finalize(
        self, output: ExpertsOutput, dispatched: Dispatched, route: R, topk: TopK,
        shared_output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Returns a new ``[M, H]`` tensor in ``hidden``'s dtype, plus ``shared_output [M, H]`` (the
        shared experts' result) when given -- added while combining where the transport allows, so it
        costs no extra pass over the output. ``dispatched`` and ``route`` are what ``prepare`` returned.
        (The routed scaling factor needs no hook here: the Router folds it into ``topk.weights``,
        which every backend applies, so it reaches biases too.)"""

    def finalize_reduced(self, out: torch.Tensor, shared_output: torch.Tensor | None = None) -> torch.Tensor:
        """Finalize for experts that routed the tokens in their own kernel (no prepare ran) and reduced
        over k: ``out [M, H]`` is already this rank's result, so it is copied out in the layer's dtype,
        plus ``shared_output``. One rank only: over several ranks the tokens must travel home."""
        if self.problem.parallel.ep_size > 1:
            raise MoEConfigError(
                f"{self.name}: finalize_reduced serves one rank, not ep_size={self.problem.parallel.ep_size}: "
                "the tokens must travel home, so route with a Router and call prepare/finalize"
            )
        if shared_output is None:
            return out.to(self.problem.dtype, copy=True)
        return torch.add(out, shared_output).to(self.problem.dtype)  # one pass when out is already in dtype


def single_rank_reasons(problem: MoEProblem) -> list[str]:
    if problem.parallel.ep_size > 1:
        return [f"serves one rank; ep_size={problem.parallel.ep_size} needs an all-to-all prepare/finalize"]
    return []


def add_shared(out: torch.Tensor, shared_output: torch.Tensor | None) -> torch.Tensor:
    """``out += shared_output`` in place (``out`` is finalize's fresh result); ``out`` when None."""
    return out if shared_output is None else out.add_(shared_output)


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
