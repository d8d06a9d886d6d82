"""The Experts contract: the grouped GEMMs of an MoE layer behind one small interface.

An Experts class declares what it can do once, as data (``capabilities``); the oracle, the error
messages, the support table and the test matrix all read that one record. ``check`` derives every
reason it cannot serve a problem from it; override ``extra_checks`` only for what data cannot say.

Lifecycle: ``cls.check(problem, platform)`` -> ``experts = cls(problem)`` ->
``prepared = experts.prepare_weights(weights)`` (once, at load) -> per call:
``experts.apply(dispatched, prepared, workspace)`` inside buffers sized by ``declared_workspace``
(a classmethod: the oracle sizes plans with it without an instance).
"""

from __future__ import annotations

import functools
import typing
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

import torch

from moe.activation import ActivationKind
from moe.formats import ActivationFormat, Dispatched, DispatchShape, ExpertsOutput, OutputKind
from moe.errors import MoEConfigError, UnsupportedError
from moe.platform import Platform, missing_library_reason
from moe.problem import MoEProblem
from moe.quant import QuantFormat
from moe.weights import ExpertWeights
from moe.workspace import Workspace, WorkspaceShapes

ALL_DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float32})


@dataclass(frozen=True)
class Capabilities:
    """What an Experts class can serve. Every field is checked by ``Experts.check``."""

    formats: frozenset[ActivationFormat]
    quant: frozenset[tuple[QuantFormat, QuantFormat]]  # supported (weight, activation) pairs
    activations: frozenset[ActivationKind]
    output: OutputKind
    dtypes: frozenset[torch.dtype] = ALL_DTYPES  # activation dtypes in and out
    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    min_capability: tuple[int, int] | None = None  # CUDA compute capability range, inclusive
    max_capability: tuple[int, int] | None = None
    libraries: tuple[str, ...] = ()  # must be importable (Platform.libraries)
    alignment: Mapping[str, int] = field(default_factory=dict)  # "hidden_size"/"intermediate_size" -> multiple
    pads_to_alignment: bool = False  # the backend pads H/I itself, so alignment is no constraint
    max_tokens: int | None = None
    expert_map: bool = True  # serves expert-parallel problems (some experts not on this rank)
    bias: bool = True
    cuda_graph_safe: bool = False
    deterministic: bool = True
    quantizes_input: bool = False  # True: takes unquantized activations and quantizes them itself
    # routings ("softmax", "gpt_oss", "deepseek_v3") the kernel can compute itself from the router
    # logits; such a class implements apply_router_logits, and ModularKernel.forward_logits uses it
    routes_from_logits: frozenset[str] = frozenset()
    implemented: bool = True  # False: a declaration only, never selected


def _require_problem(problem: object, owner: str) -> None:
    if not isinstance(problem, MoEProblem):
        raise MoEConfigError(f"{owner}(problem): problem must be a MoEProblem, e.g. MoEProblem.create(num_experts=8, "
                             f"top_k=2, hidden_size=..., intermediate_size=...) (got {type(problem).__name__} "
                             f"{problem!r})")


def _fmt_cc(cc: tuple[int, int]) -> str:
    return f"SM{cc[0]}{cc[1]}"


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

        With ``platform=None`` only the problem is checked.
        """
        cap = cls.capabilities
        reasons = []
        pair = (problem.quant.weight, problem.quant.activation)
        if pair not in cap.quant:
            allowed = ", ".join(sorted(f"{w.value}×{a.value}" for w, a in cap.quant))
            reasons.append(
                f"quant {pair[0].value}×{pair[1].value} (weight×activation) not supported; supports {allowed}"
            )
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
        if not cap.pads_to_alignment:
            for dim, multiple in cap.alignment.items():
                value = getattr(problem, dim)
                if value % multiple:
                    reasons.append(f"{dim} must be a multiple of {multiple} (got {value})")
        if not cap.implemented:
            reasons.append("declared only: no working apply in this build")
        if platform is not None:
            reasons += cls._platform_reasons(platform)
        return reasons + cls.extra_checks(problem, platform)

    @classmethod
    def _platform_reasons(cls, platform: Platform) -> list[str]:
        cap = cls.capabilities
        reasons = []
        if platform.device not in cap.devices:
            reasons.append(f"runs on {sorted(cap.devices)}, not {platform.device}")
        elif platform.is_cuda and platform.capability is not None:
            cc = platform.capability
            if cap.min_capability and cc < cap.min_capability:
                reasons.append(f"needs {_fmt_cc(cap.min_capability)} or newer (got {_fmt_cc(cc)})")
            if cap.max_capability and cc > cap.max_capability:
                reasons.append(f"needs {_fmt_cc(cap.max_capability)} or older (got {_fmt_cc(cc)})")
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
