"""Conformance cases, generated from a backend's declaration alone (nothing is declared twice).

An Experts class's ``capabilities`` give the axes -- (weight, activation) quant pairs, activation
formats, activations, dtypes, biases, expert maps, the token limit and the alignment -- and the cases
are drawn from them:

- ``full``: the product of every axis;
- ``quick``: every (quant pair, format) once, with the other axes rotated across them so that every
  declared value of every axis is seen at least once (a few seconds on a CPU).

Each case runs at several token counts, always including 0, 1 and odd sizes. Exclusion cases are the
complement: one problem per thing the declaration leaves out (quick: one per axis; full: all), which
``check`` must reject and construction must refuse with ``UnsupportedError``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Iterator

import torch

from moe.activation import Activation, ActivationKind
from moe.experts.base import ALL_DTYPES, Capabilities
from moe.formats import ActivationFormat, OutputKind
from moe.problem import MoEProblem, ParallelConfig
from moe.quant import SCHEME_PAIRS, QuantFormat, QuantScheme

MODES = ("quick", "full")
TOKEN_COUNTS = {"quick": (0, 1, 7, 33), "full": (0, 1, 2, 7, 33, 64)}
NUM_EXPERTS, TOP_K = 6, 2
EXPERT_MAP = (0, -1, 1, 2, -1, 3)  # 4 of the 6 experts live on this rank, scattered
CONTIGUOUS_EXPERT_MAP = (-1, -1, 0, 1, 2, 3)  # 4 local experts as one block (offset + count)
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
    prepare/finalize of that (undeclared) format must fail instead.
    """

    excluded: str  # what the declaration leaves out, e.g. "activation gelu"
    problem: MoEProblem
    format: ActivationFormat | None = None

    @property
    def label(self) -> str:
        return f"excludes {self.excluded}: {describe(self.problem)}"

    @property
    def id(self) -> str:
        return "excludes-" + self.excluded.replace(" ", "-").replace("=", "")


def describe(problem: MoEProblem) -> str:
    """A short readable name: ``bf16 silu E=6 k=2 H=40 I=24 +bias +expert_map`` (``+expert_block``: the
    expert map holds this rank's experts as one contiguous block)."""
    p = problem
    scheme = p.quant_name if not p.quant.is_quantized else f"{p.quant_name}/{_DTYPE_NAMES[p.dtype]}"
    words = [scheme, p.activation.name, f"E={p.num_experts} k={p.top_k} H={p.hidden_size} I={p.intermediate_size}"]
    words += ["+bias"] * p.has_bias
    if p.parallel.enabled:
        words.append("+expert_block" if p.parallel.expert_map == CONTIGUOUS_EXPERT_MAP else "+expert_map")
    return " ".join(words)


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"cases must be one of {MODES} (got {mode!r})")
    return mode


# --- building problems ---------------------------------------------------------------------------
def sizes_for(cap: Capabilities, weight: QuantFormat) -> tuple[int, int]:
    """(H, I) for the weight format, rounded up to the declared alignment unless the backend pads."""
    hidden, inter = SIZES[weight]
    if cap.pads_to_alignment:
        return hidden, inter  # unaligned on purpose: exercises the padding

    def aligned(dim: str, value: int) -> int:
        multiple = math.lcm(cap.alignment.get(dim, 1), weight.k_multiple)
        return -(-value // multiple) * multiple

    return aligned("hidden_size", hidden), aligned("intermediate_size", inter)


def build_problem(cap: Capabilities, pair, activation: ActivationKind, dtype: torch.dtype, *,
                  bias: bool = False, expert_map: bool = False, max_tokens: int = 64) -> MoEProblem:
    hidden, inter = sizes_for(cap, pair[0])
    parallel = ParallelConfig(expert_map=EXPERT_MAP) if expert_map else ParallelConfig()
    return MoEProblem.create(
        num_experts=NUM_EXPERTS, top_k=TOP_K, hidden_size=hidden, intermediate_size=inter,
        activation=Activation.parse(activation), quant=QuantScheme(*pair), dtype=dtype,
        has_bias=bias, max_tokens=max_tokens, parallel=parallel,
    )


def problem_variants(cap: Capabilities, problem: MoEProblem) -> list[MoEProblem]:
    """Nearby problems to try when ``check`` refuses a generated one for what data cannot say: the
    expert map as one contiguous block, the sizes rounded up to the declared alignment (a backend
    that pads may still need aligned sizes for some scheme), and both."""
    contiguous = None
    if problem.parallel.expert_map == EXPERT_MAP:
        contiguous = replace(problem, parallel=ParallelConfig(expert_map=CONTIGUOUS_EXPERT_MAP))
    aligned = None
    if cap.alignment:
        weight = problem.quant.weight
        multiple = {d: math.lcm(cap.alignment.get(d, 1), weight.k_multiple) for d in ("hidden_size", "intermediate_size")}
        sizes = {d: -(-getattr(problem, d) // m) * m for d, m in multiple.items()}
        if any(sizes[d] != getattr(problem, d) for d in sizes):
            aligned = replace(problem, **sizes)
    both = replace(aligned, parallel=contiguous.parallel) if aligned and contiguous else None
    return [v for v in (contiguous, aligned, both) if v is not None]


def token_counts(cap: Capabilities, mode: str) -> tuple[int, ...]:
    counts = TOKEN_COUNTS[check_mode(mode)]
    if cap.max_tokens is not None:
        counts = tuple(sorted({m for m in counts if m <= cap.max_tokens} | {cap.max_tokens}))
    return counts


def _cover(primary: list, secondary: dict[str, tuple], mode: str) -> Iterator[tuple[object, dict]]:
    """Full: primary x every secondary axis. Quick: each primary once, secondaries rotated so every
    value of every axis appears (the rotation shifts by one per pass over ``primary``)."""
    names = list(secondary)
    if mode == "full":
        for item, values in itertools.product(primary, itertools.product(*secondary.values())):
            yield item, dict(zip(names, values))
        return
    binary = [n for n in names if len(secondary[n]) == 2]
    count = max([len(primary), 2 ** len(binary)] + [len(v) for v in secondary.values()])
    for i in range(count):
        rotated = i + i // len(primary) if len(primary) > 1 else i
        choice, stride = {}, 1
        for name in names:
            values = secondary[name]
            if name in binary:  # binary axes as bits, so every on/off combination shows up
                choice[name] = values[(rotated // stride) % 2]
                stride *= 2
            else:
                choice[name] = values[rotated % len(values)]
        yield primary[i % len(primary)], choice


def _ordered_dtypes(dtypes) -> tuple[torch.dtype, ...]:
    return tuple(d for d in _DTYPE_ORDER if d in dtypes)


def _secondary_axes(cap: Capabilities) -> dict[str, tuple]:
    return {
        "activation": tuple(sorted(cap.activations, key=lambda a: a.value)),
        "dtype": _ordered_dtypes(cap.dtypes),
        "bias": (False, True) if cap.bias else (False,),
        "expert_map": (False, True) if cap.expert_map else (False,),
    }


# --- experts cases -------------------------------------------------------------------------------
def experts_cases(cap: Capabilities, mode: str = "quick") -> list[Case]:
    """Every problem x format the declaration covers (quick: a covering subset), with token counts."""
    counts = token_counts(cap, mode)
    pairs = sorted(cap.quant, key=lambda pair: (pair[0].value, pair[1].value))
    formats = sorted(cap.formats, key=lambda f: f.value, reverse=True)  # standard first
    primary = [(fmt, pair) for fmt in formats for pair in pairs]
    cases = []
    for (fmt, pair), axes in _cover(primary, _secondary_axes(cap), mode):
        problem = build_problem(cap, pair, axes["activation"], axes["dtype"], bias=axes["bias"],
                                expert_map=axes["expert_map"], max_tokens=max(counts))
        cases.append(Case(problem, fmt, counts))
    return cases


def exclusion_cases(cap: Capabilities, mode: str = "quick") -> list[ExclusionCase]:
    """One problem per value the declaration leaves out (quick: the first of each axis)."""
    take = (lambda xs: list(xs)[:1]) if check_mode(mode) == "quick" else list
    pair = min(cap.quant, key=lambda pair: (pair[0].value, pair[1].value))
    activation = min(cap.activations, key=lambda a: a.value)
    dtype = _ordered_dtypes(cap.dtypes)[0]
    base = build_problem(cap, pair, activation, dtype, max_tokens=TOKEN_COUNTS["quick"][-1])
    cases = []
    for other in take(sorted(SCHEME_PAIRS - cap.quant, key=lambda p: (p[0].value, p[1].value))):
        problem = build_problem(cap, other, activation, dtype, max_tokens=base.max_tokens)
        cases.append(ExclusionCase(f"quant {QuantScheme(*other).name}", problem))
    for kind in take(sorted(set(ActivationKind) - cap.activations, key=lambda a: a.value)):
        cases.append(ExclusionCase(f"activation {kind.value}", build_problem(cap, pair, kind, dtype)))
    for other_dtype in take(_ordered_dtypes(ALL_DTYPES - cap.dtypes)):
        cases.append(ExclusionCase(f"dtype {_DTYPE_NAMES[other_dtype]}", replace(base, dtype=other_dtype)))
    if not cap.bias:
        cases.append(ExclusionCase("biases", replace(base, has_bias=True)))
    if not cap.expert_map:
        cases.append(ExclusionCase("expert maps", replace(base, parallel=ParallelConfig(expert_map=EXPERT_MAP))))
    if cap.max_tokens is not None:
        cases.append(ExclusionCase(f"max_tokens > {cap.max_tokens}", replace(base, max_tokens=cap.max_tokens + 1)))
    cases += _misaligned_cases(cap, base)
    for fmt in sorted(set(ActivationFormat) - cap.formats, key=lambda f: f.value):
        cases.append(ExclusionCase(f"format {fmt.value}", base, format=fmt))
    return cases


def _misaligned_cases(cap: Capabilities, base: MoEProblem) -> list[ExclusionCase]:
    if cap.pads_to_alignment:
        return []
    cases = []
    for dim, multiple in sorted(cap.alignment.items()):
        if multiple <= 1:
            continue
        step = base.quant.weight.k_multiple * 2  # stays storable in the weight format (and even)
        value = next(v for v in itertools.count(multiple + step, step) if v % multiple)
        cases.append(ExclusionCase(f"{dim}={value} (not a multiple of {multiple})", replace(base, **{dim: value})))
    return cases


# --- prepare/finalize cases ----------------------------------------------------------------------
def prepare_finalize_cases(pf_format: ActivationFormat, quant_formats, mode: str = "quick") -> list[Case]:
    """Problems for a prepare/finalize: every scheme whose activations it can produce, every output kind
    its format can carry, against the reference experts (which serve everything)."""
    counts = TOKEN_COUNTS[check_mode(mode)]
    reference = Capabilities(formats=frozenset({pf_format}), quant=SCHEME_PAIRS, activations=frozenset(ActivationKind),
                             output=OutputKind.PER_SLOT)
    pairs = sorted((p for p in SCHEME_PAIRS if p[1] is QuantFormat.NONE or p[1] in quant_formats),
                   key=lambda pair: (pair[0].value, pair[1].value))
    kinds = [OutputKind.PER_SLOT, OutputKind.PER_SLOT_WEIGHTED]
    if pf_format is ActivationFormat.STANDARD:
        kinds.append(OutputKind.REDUCED)  # the batched format cannot carry reduced output
    axes = {"output": tuple(kinds), **_secondary_axes(reference)}
    cases = []
    for pair, choice in _cover(pairs, axes, mode):
        problem = build_problem(reference, pair, choice["activation"], choice["dtype"], bias=choice["bias"],
                                expert_map=choice["expert_map"], max_tokens=max(counts))
        cases.append(Case(problem, pf_format, counts, output=choice["output"]))
    return cases
