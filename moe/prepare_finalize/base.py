"""The PrepareFinalize contract: how tokens reach the experts and how their results come back.

A PrepareFinalize class declares what it can serve once, as data (``transport``, a `Transport`);
``check`` derives every reason it cannot serve a problem from that record, and the oracle, the
composition checks (`moe.compose`) and the support table read the same record.

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
to (`QUANTIZABLE`) and `batch_slots` (each slot's row in per-expert buffers).
"""

from __future__ import annotations

import dataclasses
import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

import torch

from moe.errors import MoEConfigError
from moe.formats import ActivationFormat, Dispatched, DispatchShape, ExpertsOutput
from moe.platform import Platform, missing_features_reason, missing_library_reason
from moe.problem import MoEProblem, ParallelConfig
from moe.quant import SCHEME_PAIRS, QuantFormat
from moe.router import TopK
from moe.workspace import Workspace, WorkspaceShapes

# every activation format some scheme uses (MXFP4 is a weight format only: e2m1 cannot carry a NaN)
QUANTIZABLE = frozenset(a for _, a in SCHEME_PAIRS) - {QuantFormat.NONE}

class Ranks(enum.Enum):
    """How many ranks a transport serves."""

    ONE = "one"  # a single rank holds every expert
    EXPERT_PARALLEL = "expert_parallel"  # ep_size > 1: tokens travel to the ranks owning their experts


@dataclass(frozen=True)
class Transport:
    """What a PrepareFinalize class can serve. Every field is checked by ``PrepareFinalize.check``."""

    format: ActivationFormat  # the activation format prepare produces
    quant_formats: frozenset[QuantFormat]  # activation formats prepare can quantize to
    ranks: frozenset[Ranks] = frozenset(Ranks)
    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    runs_on: str = ""  # where it runs, in words, for the reason a device is refused (default: the devices)
    libraries: tuple[str, ...] = ()  # must be importable (Platform.libraries)
    features: tuple[str, ...] = ()  # "<library>.<feature>" it calls, where that library is there (Platform.features)
    max_ranks: int | None = None  # the most ranks (ep_size) it can join
    max_top_k: int | None = None
    expert_map: bool = True  # False: experts placed contiguously only (rank = e // (E / ep_size))
    implemented: bool = True  # False: a declaration only, never selected


# a subclass may refine its parent's transport by setting one of these as a class attribute
_REFINABLE = ("format", "quant_formats", "implemented")


R = TypeVar("R")  # a transport's record of how the rows travelled, from prepare to finalize


class PrepareFinalize(ABC, Generic[R]):
    """Base class; subclasses set ``name`` and ``transport``.

    ``format``, ``quant_formats`` and ``implemented`` read the transport's fields. A subclass of a
    declared class may set one of them as a class attribute instead of a whole new transport
    (``quant_formats = frozenset()``): it replaces that field of the inherited transport.
    """

    name: ClassVar[str]
    transport: ClassVar[Transport]
    format: ClassVar[ActivationFormat]  # transport.format
    quant_formats: ClassVar[frozenset[QuantFormat]]  # transport.quant_formats
    implemented: ClassVar[bool]  # transport.implemented
    # finalize returns an owned REDUCED output itself (`ExpertsOutput.owned`): then the kernel hands the
    # experts a fresh "out" to write, and the forward saves finalize's copy (one launch at decode)
    returns_owned_output: ClassVar[bool] = False
    # expert parallelism: prepare compares every rank's M with the capacity inside a collective it makes
    # anyway, and every rank raises the same error; so a kernel or layer leaves M > max_tokens to it (a rank
    # raising alone would leave the others waiting in that collective). False under expert parallelism: the
    # kernel runs this rank's part of the forward with no tokens, then raises on this rank alone
    agrees_on_tokens: ClassVar[bool] = False
    # prepare and finalize can be captured in a CUDA graph: fixed shapes, no count read on the host
    captures_in_cuda_graph: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        inherited = getattr(cls, "transport", None)
        refined = {f: cls.__dict__[f] for f in _REFINABLE if f in cls.__dict__}
        if refined and "transport" not in cls.__dict__ and isinstance(inherited, Transport):
            cls.transport = dataclasses.replace(inherited, **refined)
        if isinstance(getattr(cls, "transport", None), Transport):
            for f in _REFINABLE:
                setattr(cls, f, getattr(cls.transport, f))

    def __init__(self, problem: MoEProblem):
        if not isinstance(problem, MoEProblem):
            raise MoEConfigError(f"{type(self).__name__}(problem): problem must be a MoEProblem "
                                 f"(got {type(problem).__name__} {problem!r})")
        self.problem = problem

    @classmethod
    def check(cls, problem: MoEProblem, platform: Platform | None) -> list[str]:
        """Every reason this class cannot serve ``problem`` on ``platform``; empty when it can.

        With ``platform=None`` only the problem is checked.
        """
        t, parallel = cls.transport, problem.parallel
        reasons = []
        if not t.implemented:
            reasons.append("declared only: no working prepare/finalize in this build")
        if parallel.ep_size > 1 and Ranks.EXPERT_PARALLEL not in t.ranks:
            reasons.append(f"serves one rank; ep_size={parallel.ep_size} needs an all-to-all prepare/finalize")
        if parallel.ep_size == 1 and Ranks.ONE not in t.ranks:
            reasons.append("single rank (ep_size=1): use local")
        if not t.expert_map and not _contiguous(problem):
            reasons.append("places experts contiguously (rank = e // (E / ep_size)); an explicit expert_map is "
                           "not supported: use all_to_all")
        if t.max_ranks is not None and parallel.ep_size > t.max_ranks:
            reasons.append(f"supports at most {t.max_ranks} ranks (got ep_size={parallel.ep_size})")
        if t.max_top_k is not None and problem.top_k > t.max_top_k:
            reasons.append(f"supports top_k <= {t.max_top_k} (got {problem.top_k})")
        if platform is not None:
            reasons += cls._platform_reasons(platform)
        return reasons

    @classmethod
    def _platform_reasons(cls, platform: Platform) -> list[str]:
        """The platform half of the declaration (devices, libraries): what ``check`` adds on ``platform``
        whatever the problem, and what ``python -m moe backends`` reports as usable here."""
        return _transport_platform_reasons(cls.transport, platform)

    @classmethod
    def declared_workspace(cls, problem: MoEProblem) -> tuple[DispatchShape, WorkspaceShapes]:
        """The most an instance built with its default options dispatches for ``problem.max_tokens``
        tokens, and its own scratch -- from the declarations alone (the oracle sizes a plan's workspace
        with it, building nothing). Default: every rank's ``max_tokens`` may arrive (one rank: M rows),
        and no scratch (under expert parallelism a transport's own buffers are not counted)."""
        rows = problem.max_tokens * problem.parallel.ep_size
        return DispatchShape(cls.transport.format, rows), WorkspaceShapes()

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

    def finalize_reduced(self, out: torch.Tensor, shared_output: torch.Tensor | None = None, *,
                         owned: bool = False) -> torch.Tensor:
        """Finalize for experts that reduced over k: ``out [M, H]`` is already this rank's result, so it
        is copied out in the layer's dtype, plus ``shared_output``. ``owned`` (a fresh tensor in the
        layer's dtype that no workspace holds, see `ExpertsOutput`): returned itself, the shared experts'
        output added in place -- no copy. One rank only: over several ranks the tokens must travel home."""
        if self.problem.parallel.ep_size > 1:
            raise MoEConfigError(
                f"{self.name}: finalize_reduced serves one rank, not ep_size={self.problem.parallel.ep_size}: "
                "the tokens must travel home, so route with a Router and call prepare/finalize"
            )
        if owned and out.dtype == self.problem.dtype:
            return add_shared(out, shared_output)
        if shared_output is None:
            return out.to(self.problem.dtype, copy=True)
        return torch.add(out, shared_output).to(self.problem.dtype)  # one pass when out is already in dtype


def add_shared(out: torch.Tensor, shared_output: torch.Tensor | None) -> torch.Tensor:
    """``out += shared_output`` in place (``out`` is finalize's fresh result); ``out`` when None."""
    return out if shared_output is None else out.add_(shared_output)


def _contiguous(problem: MoEProblem) -> bool:
    """True unless the problem places experts by an explicit map other than the contiguous blocks."""
    p = problem.parallel
    if p.expert_map is None:
        return True
    return list(p.expert_map) == ParallelConfig(p.ep_size, p.ep_rank).global_to_local(problem.num_experts)


def _transport_platform_reasons(transport: Transport, platform: Platform) -> list[str]:
    reasons = []
    if platform.device not in transport.devices:
        where = transport.runs_on or str(sorted(transport.devices))
        reasons.append(f"runs on {where}, not {platform.device}")
    for lib in transport.libraries:
        if not platform.has_library(lib):
            reasons.append(missing_library_reason(lib))
    for feature in transport.features:
        lib, short = feature.split(".", 1)
        lacking = missing_features_reason(platform, lib, [short])
        if lacking:
            reasons.append(lacking)
    return reasons


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
