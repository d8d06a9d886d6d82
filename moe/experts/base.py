"""The Experts contract: the grouped GEMMs of an MoE layer behind one small interface.

An Experts class declares what it can do once, as data (``capabilities``): per quantization scheme a
`Mode` -- the architectures, activations, dtypes, biases, alignment and library features that scheme's
kernel needs -- and what holds for every scheme (formats, output kind, devices, ...). The oracle, the
error messages, the support table and the conformance kit's cases and exclusions all read that one
record. ``check`` derives every reason a class cannot serve a problem from it; override
``extra_checks`` only for what data cannot say.

Lifecycle: ``cls.check(problem, platform)`` -> ``experts = cls(problem)`` ->
``prepared = experts.prepare_weights(weights)`` (once, at load) -> per call:
``experts.apply(dispatched, prepared, workspace)`` inside buffers sized by ``declared_workspace``
(a classmethod: the oracle sizes plans with it without an instance).
"""

from __future__ import annotations

import enum
import functools
import types
import typing
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import torch

from moe.activation import ActivationKind
from moe.formats import ActivationFormat, Dispatched, DispatchShape, ExpertsOutput, OutputKind
from moe.errors import MoEConfigError, UnsupportedError
from moe.experts.mode import ALL_DTYPES, Archs, Mode, scheme_of  # noqa: F401 -- Archs: of this contract
from moe.platform import Platform, missing_library_reason
from moe.problem import MoEProblem
from moe.quant import QuantFormat, QuantScheme
from moe.weights import ExpertWeights
from moe.workspace import Workspace, WorkspaceShapes


class ExpertLayout(str, enum.Enum):
    """Which expert maps (this rank's share of the E experts, ``ParallelConfig``) a class takes."""

    ANY = "any"
    BLOCK = "block"  # this rank's experts as one contiguous block, in order: an offset + count
    EVEN_SHARDS = "even_shards"  # only the default sharding: experts ep_rank * E/ep_size .. + E/ep_size


def local_expert_block(problem: MoEProblem) -> tuple[int, int] | None:
    """(first global expert, count) when this rank's experts are one contiguous block in order, else None."""
    table = problem.parallel.global_to_local(problem.num_experts)
    local = [g for g, l in enumerate(table) if l >= 0]
    if not local or local != list(range(local[0], local[0] + len(local))):
        return None
    if [table[g] for g in local] != list(range(len(local))):
        return None
    return local[0], len(local)


def _layout_reasons(owner: str, layout: ExpertLayout, problem: MoEProblem) -> list[str]:
    if layout is ExpertLayout.ANY:
        return []
    block = local_expert_block(problem)
    if block is None:
        return [f"the expert map gives this rank a non-contiguous set of experts; {owner} takes an offset + count"]
    ep = problem.parallel
    if layout is ExpertLayout.EVEN_SHARDS and ep.enabled:
        per_rank = problem.num_experts // ep.ep_size
        if problem.num_experts % ep.ep_size or block != (ep.ep_rank * per_rank, per_rank):
            return [f"{owner} shards experts as ep_rank * E/ep_size .. + E/ep_size; "
                    f"this rank holds experts {block[0]}..{block[0] + block[1] - 1}"]
    return []


@dataclass(frozen=True)
class Capabilities:
    """What an Experts class can serve: a `Mode` per quantization scheme (``modes``, the one
    declaration of the schemes and what each needs), and what holds for all of them.

    ``quant``, ``activations``, ``dtypes``, ``bias`` and the compute-capability range are the union of
    the modes, derived (for the support table and the class-level reasons), never declared.
    """

    formats: frozenset[ActivationFormat]
    modes: Mapping[QuantScheme, Mode]
    output: OutputKind
    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    libraries: tuple[str, ...] = ()  # must be importable (Platform.libraries)
    max_tokens: int | None = None
    expert_map: bool = True  # serves expert-parallel problems (some experts not on this rank) ...
    expert_layout: ExpertLayout = ExpertLayout.ANY  # ... with these expert maps
    cuda_graph_safe: bool = False
    deterministic: bool = True
    quantizes_input: bool = False  # True: takes unquantized activations and quantizes them itself
    # routings ("softmax", "gpt_oss", "deepseek_v3") the kernel can compute itself from the router
    # logits; such a class implements apply_router_logits, and ModularKernel.forward_logits uses it
    routes_from_logits: frozenset[str] = frozenset()
    implemented: bool = True  # False: a declaration only, never selected

    def __post_init__(self) -> None:
        if not isinstance(self.modes, Mapping):
            raise MoEConfigError(f"Capabilities(modes=...): a mapping QuantScheme -> Mode, e.g. "
                                 f"Mode().serving('bf16') (got {self.modes!r})")
        object.__setattr__(self, "modes", types.MappingProxyType({scheme_of(s): m for s, m in self.modes.items()}))

    @property
    def quant(self) -> frozenset[tuple[QuantFormat, QuantFormat]]:
        """The (weight, activation) pairs of the schemes served."""
        return frozenset((s.weight, s.activation) for s in self.modes)

    @property
    def activations(self) -> frozenset[ActivationKind]:
        return frozenset().union(*(m.activations for m in self.modes.values()))

    @property
    def dtypes(self) -> frozenset[torch.dtype]:
        return frozenset().union(*(m.dtypes for m in self.modes.values()))

    @property
    def bias(self) -> bool:
        return any(m.bias for m in self.modes.values())

    @property
    def min_capability(self) -> tuple[int, int] | None:
        """The lowest compute capability of any mode (inclusive); None: no lower bound."""
        lows = [m.archs.lowest for m in self.modes.values()]
        return None if not lows or None in lows else divmod(min(lows), 10)

    @property
    def max_capability(self) -> tuple[int, int] | None:
        highs = [m.archs.highest for m in self.modes.values()]
        return None if not highs or None in highs else divmod(max(highs), 10)

    def capability_reasons(self, capability: tuple[int, int]) -> list[str]:
        """Why a GPU of ``capability`` is outside ``min_capability .. max_capability``."""
        name = lambda cc: f"SM{cc[0]}{cc[1]}"  # noqa: E731
        low, high, reasons = self.min_capability, self.max_capability, []
        if low and capability < low:
            reasons.append(f"needs {name(low)} or newer (got {name(capability)})")
        if high and capability > high:
            reasons.append(f"needs {name(high)} or older (got {name(capability)})")
        return reasons


def _class_reasons(cap: Capabilities, problem: MoEProblem) -> list[str]:
    """The reasons the union of the modes (and the class-wide fields) gives."""
    reasons = []
    if problem.quant not in cap.modes:
        allowed = ", ".join(sorted(f"{w.value}×{a.value}" for w, a in cap.quant))
        pair = f"{problem.quant.weight.value}×{problem.quant.activation.value}"
        reasons.append(f"quant {pair} (weight×activation) not supported; supports {allowed}")
    if problem.activation.kind not in cap.activations:
        allowed = ", ".join(sorted(a.value for a in cap.activations))
        reasons.append(f"activation {problem.activation.name} not supported; supports {allowed}")
    if problem.dtype not in cap.dtypes:
        reasons.append(f"dtype {problem.dtype} not supported; supports {sorted(map(str, cap.dtypes))}")
    if problem.has_bias and not cap.bias:
        reasons.append("expert biases (has_bias=True) not supported")
    if problem.parallel.enabled and not cap.expert_map:
        reasons.append("expert parallelism (an expert map) not supported")
    if cap.max_tokens is not None and problem.max_tokens > cap.max_tokens:
        reasons.append(f"max_tokens={problem.max_tokens} exceeds the backend's limit {cap.max_tokens}")
    if not cap.implemented:
        reasons.append("declared only: no working apply in this build")
    return reasons


def _require_problem(problem: object, owner: str) -> None:
    if not isinstance(problem, MoEProblem):
        raise MoEConfigError(f"{owner}(problem): problem must be a MoEProblem, e.g. MoEProblem.create(num_experts=8, "
                             f"top_k=2, hidden_size=..., intermediate_size=...) (got {type(problem).__name__} "
                             f"{problem!r})")


class Experts(ABC):
    """Base class of every Experts backend. Subclasses set ``name`` and ``capabilities``, and
    ``prepared_type`` when ``prepare_weights`` returns something other than `ExpertWeights`."""

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    # What prepare_weights returns and apply reads. apply checks its weights against it first, so
    # weights that were never prepared fail naming the call that prepares them, not with an
    # AttributeError inside a kernel.
    prepared_type: ClassVar[type] = ExpertWeights

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        if "prepare_weights" in cls.__dict__ and "prepared_type" not in cls.__dict__:
            # converts the weights without declaring to what (a plugin written before prepared_type):
            # trust prepare_weights' return annotation, else check nothing rather than refuse good weights
            cls.prepared_type = _returned_type(cls.prepare_weights)
            if "prepared_sizes" not in cls.__dict__:  # the parent's reads the parent's prepared type
                cls.prepared_sizes = Experts.prepared_sizes
        # apply is called directly (the conformance kit, bench, users) as well as by ModularKernel,
        # so the check wraps each class's own apply instead of living in one of its callers
        if "apply" in cls.__dict__:
            cls.apply = _checking_apply(cls.__dict__["apply"])
        if "apply_router_logits" in cls.__dict__:
            cls.apply_router_logits = _checking_apply_router_logits(cls.__dict__["apply_router_logits"])

    def __init__(self, problem: MoEProblem):
        _require_problem(problem, type(self).__name__)
        reasons = self.check(problem, platform=None)  # the platform is the oracle's (or layer's) concern
        if reasons:
            raise UnsupportedError(f"{self.name} cannot serve this problem", reasons)
        self.problem = problem

    # --- declaration-driven check --------------------------------------------------------------
    @classmethod
    def check(cls, problem: MoEProblem, platform: Platform | None) -> list[str]:
        """Every reason this class cannot serve ``problem`` on ``platform``; empty when it can.

        In order: what the union of the modes and the class-wide fields refuse, what the platform
        lacks, what the problem's mode needs (``Mode.unmet``), the expert layout, ``extra_checks``.
        With ``platform=None`` only the problem is checked.
        """
        cap = cls.capabilities
        reasons = _class_reasons(cap, problem)
        if platform is not None:
            reasons += cls._platform_reasons(platform)
        mode = cap.modes.get(problem.quant)
        if mode is not None:
            reasons += mode.unmet(problem, platform, cap, f"{cls.name} ({problem.quant_name})")
        reasons += _layout_reasons(cls.name, cap.expert_layout, problem)
        return reasons + cls.extra_checks(problem, platform)

    @classmethod
    def _platform_reasons(cls, platform: Platform) -> list[str]:
        cap = cls.capabilities
        reasons = []
        if platform.device not in cap.devices:
            reasons.append(f"runs on {sorted(cap.devices)}, not {platform.device}")
        elif platform.is_cuda and platform.capability is not None:
            reasons += cap.capability_reasons(platform.capability)
        for lib in cap.libraries:
            if not platform.has_library(lib):
                reasons.append(missing_library_reason(lib))
        return reasons

    @classmethod
    def extra_checks(cls, problem: MoEProblem, platform: Platform | None) -> list[str]:
        """Reasons the capability data cannot express; none by default."""
        return []

    # --- lifecycle -----------------------------------------------------------------------------
    def prepare_weights(self, weights: ExpertWeights) -> Any:
        """Converts canonical weights once, at load, to what ``apply`` wants. Default: validate only."""
        weights.validate(self.problem)
        return weights

    def check_prepared(self, weights: Any, *, sizes: bool = False) -> None:
        """Raises `MoEConfigError` unless ``weights`` is what this class's ``prepare_weights`` returns;
        with ``sizes``, also unless they hold this problem's E (local), H and I (where `prepared_sizes`
        can tell)."""
        if not isinstance(weights, self.prepared_type):
            wanted = self.prepared_type.__name__
            if isinstance(weights, ExpertWeights):
                got = "unprepared ExpertWeights (the canonical layout)"
            else:
                got = "None" if weights is None else f"{type(weights).__name__} (prepared by another backend?)"
            raise MoEConfigError(
                f"weights: {self.name} computes on the {wanted} its prepare_weights returns, got {got}; "
                "call prepared = experts.prepare_weights(weights) once at load and pass prepared to apply "
                "(a ModularKernel prepares its own: kernel.load(weights))"
            )
        held = self.prepared_sizes(weights) if sizes else None
        p = self.problem
        if held is not None and tuple(held) != (p.local_num_experts, p.hidden_size, p.intermediate_size):
            raise MoEConfigError(
                "weights: prepared for E={}, H={}, I={}, but {} was built for {}; prepare them with this "
                "instance: experts.prepare_weights(weights)".format(*held, self.name, p.sizes)
            )

    def prepared_sizes(self, weights: Any) -> tuple[int, int, int] | None:
        """``(E local, H, I)`` that prepared ``weights`` hold, read from their shapes; None: cannot tell."""
        if isinstance(weights, ExpertWeights):
            return weights.num_experts, weights.hidden_size, weights.intermediate_size
        return None

    def warmup(self, weights: Any, buckets: tuple[int, ...] | None = None) -> None:
        """Once after ``prepare_weights``, before serving or CUDA-graph capture: tune or compile for
        the token counts in ``buckets`` (upper edges). Nothing by default; libraries that autotune
        (FlashInfer) do it here so the hot path only looks their choice up."""

    @classmethod
    def declared_workspace(cls, problem: MoEProblem, dispatch: DispatchShape) -> WorkspaceShapes:
        """Every buffer ``apply`` uses for inputs of at most ``dispatch`` -- an upper bound that does not
        depend on routing data; includes the output buffer and any scratch a library allocates.

        Computed from the class and the problem alone, without an instance: the oracle sizes a plan's
        workspace with it, building nothing. Every backend defines it."""
        raise NotImplementedError(f"{cls.__name__} defines no declared_workspace(problem, dispatch)")

    def workspace_shapes(self, dispatch: DispatchShape) -> WorkspaceShapes:
        """The buffers this instance's ``apply`` uses (what a kernel reserves): ``declared_workspace``
        for its problem, unless a class refines it for what only an instance knows (the GPU it runs on)."""
        return type(self).declared_workspace(self.problem, dispatch)

    def apply_router_logits(
        self, hidden: torch.Tensor, router_logits: torch.Tensor, router: Any, weights: Any, workspace: Workspace
    ) -> ExpertsOutput:
        """Routing fused into the kernel: ``hidden [M, H]`` unquantized, ``router_logits [M, E]``, the
        layer's ``Router`` for its options. Only for the routings in ``capabilities.routes_from_logits``."""
        raise NotImplementedError(f"{self.name} declares no routing it computes from logits")

    @abstractmethod
    def apply(self, dispatched: Dispatched, weights: Any, workspace: Workspace) -> ExpertsOutput:
        """Computes the experts on ``dispatched`` into ``workspace``; allocates nothing else."""


def _returned_type(prepare_weights: Any) -> type:
    """The class ``prepare_weights`` is annotated to return; ``object`` (anything) when that is unknown."""
    try:
        returned = typing.get_type_hints(prepare_weights).get("return")
    except (NameError, TypeError, AttributeError):  # an annotation that does not resolve: check nothing
        return object
    return returned if isinstance(returned, type) else object


def _checking_apply(apply: Any) -> Any:
    @functools.wraps(apply)
    def checked(self: Experts, dispatched: Dispatched, weights: Any, workspace: Workspace) -> ExpertsOutput:
        self.check_prepared(weights, sizes=True)
        return apply(self, dispatched, weights, workspace)

    return checked


def _checking_apply_router_logits(apply_router_logits: Any) -> Any:
    @functools.wraps(apply_router_logits)
    def checked(self: Experts, hidden, router_logits, router, weights: Any, workspace: Workspace) -> ExpertsOutput:
        self.check_prepared(weights, sizes=True)
        return apply_router_logits(self, hidden, router_logits, router, weights, workspace)

    return checked
