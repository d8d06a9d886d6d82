"""`Mode`: what an Experts class needs, and does, to serve one quantization scheme.

A class's ``Capabilities.modes`` maps each scheme it serves to a Mode: the compute capabilities
(`Archs`), activations, dtypes, biases, alignment and padding, and library features that scheme's
kernel needs, the name its reasons give it, and (for backends that keep one) the code that serves it
(``strategy``). Example::

    Mode(name="cutlass_fused_moe (W4A16 mxfp4)", archs=Archs.exactly(90), h_align=128, i_align=128, pads=True)

says: this scheme runs on SM90 exactly; H and I must be multiples of 128, and the backend zero-pads them.
A class that serves several schemes alike declares them in one line: ``Mode().serving("bf16", "fp8")``.

A **weight-only** mode keeps the activations unquantized where its ``weight_only`` archs say (the kernel
dequantizes the weights in registers and multiplies at the activations' dtype, e.g. fp8 weights on an
A100, which has no fp8 tensor cores): more accurate than the scheme's quantized activations, and costed
at the dtype's rate (``activation_format``). ``Mode(weight_only=Archs())`` is weight-only everywhere.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Any

import torch

from moe.activation import ActivationKind
from moe.platform import Platform, missing_features_reason
from moe.problem import MoEProblem
from moe.quant import QuantFormat, QuantScheme

if typing.TYPE_CHECKING:
    from moe.experts.base import Capabilities

ALL_DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float32})


@dataclass(frozen=True)
class Archs:
    """The CUDA compute capabilities a mode runs on, as ``major * 10 + minor`` (SM90 is 90): exactly
    those in ``only`` (prebuilt kernels) when given, else every one from ``low`` up. ``Archs()``: any.

    >>> 90 in Archs.exactly(90, 100), 100 in Archs.from_sm(89), str(Archs.from_sm(89))
    (True, True, 'SM89 or newer')
    """

    only: frozenset[int] = frozenset()
    low: int | None = None

    @classmethod
    def exactly(cls, *archs: int) -> Archs:
        return cls(only=frozenset(archs))

    @classmethod
    def from_sm(cls, low: int) -> Archs:
        return cls(low=low)

    def __contains__(self, arch: int) -> bool:
        if self.only:
            return arch in self.only
        return self.low is None or arch >= self.low

    @property
    def lowest(self) -> int | None:
        return min(self.only) if self.only else self.low

    @property
    def highest(self) -> int | None:
        return max(self.only) if self.only else None

    def __str__(self) -> str:
        if self.only:
            return "/".join(f"SM{a}" for a in sorted(self.only))
        return "any" if self.low is None else f"SM{self.low} or newer"


@dataclass(frozen=True)
class Mode:
    """What one quantization scheme needs from a problem and a platform, and how the class serves it
    (see the module docstring). The defaults need nothing: ``Mode()`` serves any problem anywhere."""

    activations: frozenset[ActivationKind] = frozenset(ActivationKind)
    dtypes: frozenset[torch.dtype] = ALL_DTYPES  # activation dtypes in and out
    bias: bool = True  # takes expert biases
    archs: Archs = Archs()  # CUDA compute capabilities
    h_align: int = 1  # H must be a multiple of this ...
    i_align: int = 1  # ... and I of this (gated activations) ...
    i_align_nongated: int | None = None  # ... or of this (relu2); None: i_align
    pads: bool = False  # True: the backend zero-pads H and I itself, so alignment never refuses
    library: str = ""  # the library whose ``features`` (Platform.features_of) this scheme calls
    features: tuple[str, ...] = ()
    # how the reasons name this mode (its kernel); unnamed, a mode reports only what the class-level
    # reasons cannot (see ``unmet``)
    name: str = ""
    arch_reason: str = "{name} for this quantization needs {archs} (got {got})"  # also {scheme}
    strategy: Any = field(default=None, compare=False, repr=False)  # the backend's code for this scheme
    # where the kernel keeps activations unquantized (weight-only; see the module docstring); None: nowhere.
    # Archs() (any) holds off CUDA too, in Triton's CPU interpreter
    weight_only: Archs | None = None

    def serving(self, *schemes: QuantScheme | str | tuple[QuantFormat, QuantFormat]) -> dict[QuantScheme, Mode]:
        """This mode for each of ``schemes`` (QuantScheme, name or (weight, activation) pair)."""
        return {scheme_of(s): self for s in schemes}

    def activation_format(self, scheme: QuantScheme, platform: Platform | None) -> QuantFormat:
        """The format the kernel reads activations in on ``platform``: the scheme's, or NONE where this mode
        runs weight-only. ``platform=None`` (no GPU known yet): NONE only for a mode weight-only everywhere."""
        if self.weight_only is None:
            return scheme.activation
        arch = cuda_arch(platform)
        everywhere = self.weight_only == Archs()
        return QuantFormat.NONE if everywhere or (arch is not None and arch in self.weight_only) else scheme.activation

    def intermediate_align(self, gated: bool) -> int:
        return self.i_align if gated or self.i_align_nongated is None else self.i_align_nongated

    def padded_sizes(self, problem: MoEProblem) -> tuple[int, int]:
        """(H, I) as the kernel sees them: rounded up to the alignment when the backend pads."""
        h, i = problem.hidden_size, problem.intermediate_size
        if not self.pads:
            return h, i
        return round_up(h, self.h_align), round_up(i, self.intermediate_align(problem.activation.is_gated))

    def unmet(self, problem: MoEProblem, platform: Platform | None, union: Capabilities, owner: str) -> list[str]:
        """What ``problem`` on ``platform`` lacks of this mode. A named mode reports every need it does
        not meet, naming itself; an unnamed one (called ``owner`` here) only where it is narrower than
        ``union``, the class's modes together: ``Experts.check`` reports what the union lacks first."""
        report = lambda union_serves: bool(self.name) or union_serves  # noqa: E731
        name, kind = self.name or owner, problem.activation.kind
        reasons = []
        if kind not in self.activations and report(kind in union.activations):
            allowed = ", ".join(sorted(a.value for a in self.activations))
            reasons.append(f"{name} does not fuse activation {problem.activation.name}; it fuses {allowed}")
        if problem.has_bias and not self.bias and report(union.bias):
            reasons.append(f"{name} takes no expert biases for this quantization")
        if problem.dtype not in self.dtypes and report(problem.dtype in union.dtypes):
            allowed = ", ".join(sorted(str(d) for d in self.dtypes))
            reasons.append(f"{name} runs {allowed} activations for this quantization, not {problem.dtype}")
        reasons += self._misaligned(problem, name)
        arch = cuda_arch(platform)
        if arch is not None:
            if arch not in self.archs and report(not union.capability_reasons(platform.capability)):
                reasons.append(self.arch_reason.format(name=name, archs=self.archs, got=f"SM{arch}",
                                                       scheme=problem.quant.name))
        lacking = missing_features_reason(platform, self.library, self.features) if platform is not None else None
        if lacking:
            reasons.append(lacking)
        return reasons

    def _misaligned(self, problem: MoEProblem, name: str) -> list[str]:
        if self.pads:
            return []
        reasons = []
        alignments = (("hidden_size", self.h_align),
                      ("intermediate_size", self.intermediate_align(problem.activation.is_gated)))
        for dim, multiple in alignments:
            value = getattr(problem, dim)
            if value % multiple:
                reasons.append(f"{dim} must be a multiple of {multiple} for {name} (got {value}); "
                               "pad the weights or use another backend")
        return reasons


def cuda_arch(platform: Platform | None) -> int | None:
    """``platform``'s compute capability as ``major * 10 + minor`` (SM90: 90); None off CUDA or unknown."""
    if platform is None or not platform.is_cuda or platform.capability is None:
        return None
    return platform.capability[0] * 10 + platform.capability[1]


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def scheme_of(scheme: QuantScheme | str | tuple[QuantFormat, QuantFormat]) -> QuantScheme:
    """``scheme`` as a QuantScheme: a name ("fp8") or a (weight, activation) pair converted."""
    if isinstance(scheme, QuantScheme):
        return scheme
    return QuantScheme.from_name(scheme, argument="scheme") if isinstance(scheme, str) else QuantScheme(*scheme)


