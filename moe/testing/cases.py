"""Conformance cases, generated from a backend's declaration alone (nothing is declared twice).

An Experts class's ``capabilities`` give the axes: the activation formats and, per quantization scheme,
its `Mode` -- activations, dtypes, biases, alignment -- plus the expert maps its layout takes and the
token limit. The cases are drawn from them:

- ``full``: per (format, scheme), the product of its mode's axes;
- ``quick``: every (format, scheme) once, with the other axes rotated across them so that every
  value of a one-mode class is seen at least once (a few seconds on a CPU).

Sizes are rounded up to each mode's alignment unless the mode pads. Each case runs at several token
counts, always including 0, 1 and odd sizes. Exclusion cases are the complement, per mode: one problem
per thing the declaration leaves out (quick: one per axis; full: all), which ``check`` must reject and
construction must refuse with ``UnsupportedError`` -- and a GPU outside a mode's architectures (within
the class's range), which ``check`` must reject on that platform.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Iterator

import torch

from moe.activation import Activation, ActivationKind
from moe.experts.base import ALL_DTYPES, Capabilities, ExpertLayout, Mode
from moe.experts.mode import round_up, scheme_of
from moe.formats import ActivationFormat, OutputKind
from moe.platform import PRESET_NAMES, Platform
from moe.problem import MoEProblem, ParallelConfig
from moe.quant import SCHEME_PAIRS, QuantFormat, QuantScheme

MODES = ("quick", "full")
TOKEN_COUNTS = {"quick": (0, 1, 7, 33), "full": (0, 1, 2, 7, 33, 64)}
NUM_EXPERTS, TOP_K = 6, 2
EXPERT_MAP = (0, -1, 1, 2, -1, 3)  # 4 of the 6 experts live on this rank, scattered
CONTIGUOUS_EXPERT_MAP = (-1, -1, 0, 1, 2, 3)  # 4 local experts as one block (offset + count)
EVEN_SHARD = ParallelConfig(ep_size=2, ep_rank=1)  # the default sharding: experts 3..5 of 6
# (H, I) per weight format: small, and odd-ish where the format allows (fp8 blocks: partial 128-blocks)
SIZES = {
    QuantFormat.NONE: (40, 24),
    QuantFormat.FP8_TENSOR: (72, 40),
    QuantFormat.FP8_ROW: (72, 40),
    QuantFormat.FP8_BLOCK: (136, 72),
    QuantFormat.MXFP8: (96, 64),
    QuantFormat.MXFP4: (96, 64),
    QuantFormat.NVFP4: (96, 48),
}
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_DTYPE_ORDER = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class Case:
    """One problem run through one activation format at several token counts.

    ``output`` is set for prepare/finalize cases only: the output kind of the reference experts
    placed on the other side of the prepare/finalize under test.
    """

    problem: MoEProblem
    format: ActivationFormat
    token_counts: tuple[int, ...]
    output: OutputKind | None = None

    @property
    def label(self) -> str:
        words = [self.format.value, describe(self.problem)]
        if self.output is not None:
            words.append(f"experts output {self.output.value}")
        return " ".join(words)

    @property
    def id(self) -> str:
        """A pytest id: the label with no spaces."""
        return self.label.replace(" ", "-").replace("=", "")


@dataclass(frozen=True)
class ExclusionCase:
    """Something the declaration excludes: ``check`` must give reasons, construction must raise.

    With ``format`` set the problem itself is supported and composing the experts with a
    prepare/finalize of that (undeclared) format must fail instead; with ``platform`` set, ``check``
    must refuse the problem on that platform (construction does not see it).
    """

    excluded: str  # what the declaration leaves out, e.g. "activation gelu"
    problem: MoEProblem
    format: ActivationFormat | None = None
    platform: Platform | None = None

    @property
    def label(self) -> str:
        return f"excludes {self.excluded}: {describe(self.problem)}"

    @property
    def id(self) -> str:
        return "excludes-" + self.excluded.replace(" ", "-").replace("=", "")


def describe(problem: MoEProblem) -> str:
    """A short readable name: ``bf16 silu E=6 k=2 H=40 I=24 +bias +expert_map`` (``+expert_block``: the
    expert map holds this rank's experts as one contiguous block; ``+ep_shard``: rank 1 of 2, default
    sharding)."""
    p = problem
    scheme = p.quant_name if not p.quant.is_quantized else f"{p.quant_name}/{_DTYPE_NAMES[p.dtype]}"
    words = [scheme, p.activation.name, f"E={p.num_experts} k={p.top_k} H={p.hidden_size} I={p.intermediate_size}"]
    words += ["+bias"] * p.has_bias
    if p.parallel.enabled:
        maps = {EXPERT_MAP: "+expert_map", CONTIGUOUS_EXPERT_MAP: "+expert_block"}
        words.append(maps.get(p.parallel.expert_map, "+ep_shard"))
    return " ".join(words)


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"cases must be one of {MODES} (got {mode!r})")
    return mode


# --- building problems ---------------------------------------------------------------------------
def sizes_for(mode: Mode, scheme: QuantScheme, gated: bool) -> tuple[int, int]:
    """(H, I) for the scheme's weight format, rounded up to the mode's alignment unless it pads."""
    hidden, inter = SIZES[scheme.weight]
    if mode.pads:
        return hidden, inter  # unaligned on purpose: exercises the padding
    storable = math.lcm(scheme.weight.k_multiple, scheme.activation.k_multiple)
    return (round_up(hidden, math.lcm(mode.h_align, storable)),
            round_up(inter, math.lcm(mode.intermediate_align(gated), storable)))


def expert_parallel(layout: ExpertLayout) -> ParallelConfig:
    """The expert map of the cases with one: scattered where any is taken, else one the layout takes."""
    if layout is ExpertLayout.EVEN_SHARDS:
        return EVEN_SHARD
    return ParallelConfig(expert_map=CONTIGUOUS_EXPERT_MAP if layout is ExpertLayout.BLOCK else EXPERT_MAP)


def build_problem(cap: Capabilities, scheme, activation: ActivationKind, dtype: torch.dtype, *,
                  bias: bool = False, expert_map: bool = False, max_tokens: int = 64) -> MoEProblem:
    """A problem of ``scheme`` sized for its mode (a scheme ``cap`` lacks: for an unconstrained one)."""
    scheme, activation = scheme_of(scheme), Activation.parse(activation)
    hidden, inter = sizes_for(cap.modes.get(scheme, Mode()), scheme, activation.is_gated)
    parallel = expert_parallel(cap.expert_layout) if expert_map else ParallelConfig()
    return MoEProblem.create(
        num_experts=NUM_EXPERTS, top_k=TOP_K, hidden_size=hidden, intermediate_size=inter,
        activation=activation, quant=scheme, dtype=dtype, has_bias=bias, max_tokens=max_tokens, parallel=parallel,
    )


def token_counts(cap: Capabilities, mode: str) -> tuple[int, ...]:
    counts = TOKEN_COUNTS[check_mode(mode)]
    if cap.max_tokens is not None:
        counts = tuple(sorted({m for m in counts if m <= cap.max_tokens} | {cap.max_tokens}))
    return counts


def _cover(primary: list, axes_of, mode: str) -> Iterator[tuple[object, dict]]:
    """Full: each primary item x the product of its secondary axes (``axes_of(item)``). Quick: each
    primary once, secondaries rotated so every value of every axis appears (the rotation shifts by one
    per pass over ``primary``)."""
    if mode == "full":
        for item in primary:
            axes = axes_of(item)
            for values in itertools.product(*axes.values()):
                yield item, dict(zip(axes, values))
        return
    count = len(primary)
    for axes in map(axes_of, primary):
        binary = [n for n, values in axes.items() if len(values) == 2]
        count = max([count, 2 ** len(binary)] + [len(v) for v in axes.values()])
    for i in range(count):
        item = primary[i % len(primary)]
        axes = axes_of(item)
        rotated = i + i // len(primary) if len(primary) > 1 else i
        choice, stride = {}, 1
        for name, values in axes.items():
            if len(values) == 2:  # binary axes as bits, so every on/off combination shows up
                choice[name] = values[(rotated // stride) % 2]
                stride *= 2
            else:
                choice[name] = values[rotated % len(values)]
        yield item, choice


def _ordered_dtypes(dtypes) -> tuple[torch.dtype, ...]:
    return tuple(d for d in _DTYPE_ORDER if d in dtypes)


def _secondary_axes(mode: Mode, expert_map: bool) -> dict[str, tuple]:
    return {
        "activation": tuple(sorted(mode.activations, key=lambda a: a.value)),
        "dtype": _ordered_dtypes(mode.dtypes),
        "bias": (False, True) if mode.bias else (False,),
        "expert_map": (False, True) if expert_map else (False,),
    }


def _schemes(cap: Capabilities) -> list[QuantScheme]:
    return sorted(cap.modes, key=lambda s: (s.weight.value, s.activation.value))


# --- experts cases -------------------------------------------------------------------------------
def experts_cases(cap: Capabilities, mode: str = "quick") -> list[Case]:
    """Every problem x format the declaration covers (quick: a covering subset), with token counts."""
    counts = token_counts(cap, mode)
    formats = sorted(cap.formats, key=lambda f: f.value, reverse=True)  # standard first
    primary = [(fmt, scheme) for fmt in formats for scheme in _schemes(cap)]
    cases = []
    for (fmt, scheme), axes in _cover(primary, lambda item: _secondary_axes(cap.modes[item[1]], cap.expert_map), mode):
        problem = build_problem(cap, scheme, axes["activation"], axes["dtype"], bias=axes["bias"],
                                expert_map=axes["expert_map"], max_tokens=max(counts))
        cases.append(Case(problem, fmt, counts))
    return cases


def exclusion_cases(cap: Capabilities, mode: str = "quick") -> list[ExclusionCase]:
    """One problem per value the declaration leaves out (quick: the first of each axis of each mode)."""
    take = (lambda xs: list(xs)[:1]) if check_mode(mode) == "quick" else list
    schemes = _schemes(cap)
    base = _base_problem(cap, schemes[0])
    activation, dtype = base.activation.kind, base.dtype
    cases = []
    for other in take(sorted(SCHEME_PAIRS - cap.quant, key=lambda p: (p[0].value, p[1].value))):
        problem = build_problem(cap, other, activation, dtype, max_tokens=base.max_tokens)
        cases.append(ExclusionCase(f"quant {QuantScheme(*other).name}", problem))
    for scheme in schemes:
        cases += _mode_exclusions(cap, scheme, take, f" with {scheme.name}" if len(schemes) > 1 else "")
    if not cap.expert_map:
        cases.append(ExclusionCase("expert maps", replace(base, parallel=ParallelConfig(expert_map=EXPERT_MAP))))
    cases += _layout_exclusions(cap.expert_layout, base)
    if cap.max_tokens is not None:
        cases.append(ExclusionCase(f"max_tokens > {cap.max_tokens}", replace(base, max_tokens=cap.max_tokens + 1)))
    for fmt in sorted(set(ActivationFormat) - cap.formats, key=lambda f: f.value):
        cases.append(ExclusionCase(f"format {fmt.value}", base, format=fmt))
    return cases


def _base_problem(cap: Capabilities, scheme: QuantScheme) -> MoEProblem:
    """The scheme's simplest problem: its mode's first activation and dtype, no bias, no expert map."""
    mode = cap.modes[scheme]
    activation = min(mode.activations, key=lambda a: a.value)
    return build_problem(cap, scheme, activation, _ordered_dtypes(mode.dtypes)[0], max_tokens=TOKEN_COUNTS["quick"][-1])


def _mode_exclusions(cap: Capabilities, scheme: QuantScheme, take, suffix: str) -> list[ExclusionCase]:
    """What one mode leaves out: activations, dtypes, biases, unpadded misalignment, architectures."""
    mode, base = cap.modes[scheme], _base_problem(cap, scheme)
    cases = []
    for kind in take(sorted(set(ActivationKind) - mode.activations, key=lambda a: a.value)):
        problem = build_problem(cap, scheme, kind, base.dtype)
        cases.append(ExclusionCase(f"activation {kind.value}{suffix}", problem))
    for other_dtype in take(_ordered_dtypes(ALL_DTYPES - mode.dtypes)):
        cases.append(ExclusionCase(f"dtype {_DTYPE_NAMES[other_dtype]}{suffix}", replace(base, dtype=other_dtype)))
    if not mode.bias:
        cases.append(ExclusionCase(f"biases{suffix}", replace(base, has_bias=True)))
    cases += _misaligned_cases(mode, base, suffix)
    return cases + _arch_cases(cap, mode, base, suffix)


def _misaligned_cases(mode: Mode, base: MoEProblem, suffix: str) -> list[ExclusionCase]:
    if mode.pads:
        return []
    cases = []
    alignments = (("hidden_size", mode.h_align), ("intermediate_size", mode.intermediate_align(base.activation.is_gated)))
    for dim, multiple in alignments:
        if multiple <= 1:
            continue
        # stays storable in the scheme's formats (and even); none is misaligned when the step is aligned
        step = math.lcm(base.quant.weight.k_multiple, base.quant.activation.k_multiple, 2)
        if step % multiple == 0:
            continue
        value = next(v for v in itertools.count(multiple + step, step) if v % multiple)
        excluded = f"{dim}={value} (not a multiple of {multiple}){suffix}"
        cases.append(ExclusionCase(excluded, replace(base, **{dim: value})))
    return cases


def _arch_cases(cap: Capabilities, mode: Mode, base: MoEProblem, suffix: str) -> list[ExclusionCase]:
    """A GPU preset the class's range admits but the mode's architectures do not (the first one)."""
    if "cuda" not in cap.devices:
        return []
    for name in PRESET_NAMES:
        platform = Platform.preset(name)
        if platform.is_cuda and not cap.capability_reasons(platform.capability):
            arch = platform.capability[0] * 10 + platform.capability[1]
            if arch not in mode.archs:
                return [ExclusionCase(f"{name} (SM{arch}){suffix}", base, platform=platform)]
    return []


def _layout_exclusions(layout: ExpertLayout, base: MoEProblem) -> list[ExclusionCase]:
    """The expert maps a layout refuses: scattered ones; for even shards, a block of another size too."""
    cases = []
    if layout is not ExpertLayout.ANY:
        cases.append(ExclusionCase("scattered expert maps", replace(base, parallel=ParallelConfig(expert_map=EXPERT_MAP))))
    if layout is ExpertLayout.EVEN_SHARDS:
        block = ParallelConfig(expert_map=CONTIGUOUS_EXPERT_MAP)
        cases.append(ExclusionCase("expert blocks other than the even shards", replace(base, parallel=block)))
    return cases


# --- prepare/finalize cases ----------------------------------------------------------------------
def prepare_finalize_cases(pf_format: ActivationFormat, quant_formats, mode: str = "quick") -> list[Case]:
    """Problems for a prepare/finalize: every scheme whose activations it can produce, every output kind
    its format can carry, against the reference experts (which serve everything)."""
    counts = TOKEN_COUNTS[check_mode(mode)]
    reference = Capabilities(formats=frozenset({pf_format}), modes=Mode().serving(*SCHEME_PAIRS),
                             output=OutputKind.PER_SLOT)
    pairs = sorted((p for p in SCHEME_PAIRS if p[1] is QuantFormat.NONE or p[1] in quant_formats),
                   key=lambda pair: (pair[0].value, pair[1].value))
    kinds = [OutputKind.PER_SLOT, OutputKind.PER_SLOT_WEIGHTED]
    if pf_format is ActivationFormat.STANDARD:
        kinds.append(OutputKind.REDUCED)  # the batched format cannot carry reduced output
    axes = {"output": tuple(kinds), **_secondary_axes(Mode(), expert_map=True)}
    cases = []
    for pair, choice in _cover(pairs, lambda pair: axes, mode):
        problem = build_problem(reference, pair, choice["activation"], choice["dtype"], bias=choice["bias"],
                                expert_map=choice["expert_map"], max_tokens=max(counts))
        cases.append(Case(problem, pf_format, counts, output=choice["output"]))
    return cases
