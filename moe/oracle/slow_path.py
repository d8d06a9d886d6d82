"""Slow paths: token buckets that a GPU layer can serve only with the reference experts, and what would
serve them with a kernel.

The reference experts are the correctness oracle (float32, dequantized weights, a loop over experts):
on a GPU they are orders of magnitude slower than any kernel. A plan that falls back to them there is
legal but never what a user wants unknowingly, so ``FusedMoE`` warns once when it is built (a
``SlowPathWarning``) and ``moe plan`` marks the buckets, each naming the scheme, the device, why every
fast backend refused, and what would serve: the other schemes this platform runs with a kernel, and the
GPUs that run this scheme with one.

    >>> no_triton = Platform.preset("h100").with_libraries(remove=("triton",))
    >>> slow = slow_path(plan(problem_mxfp8, no_triton))                    # doctest: +SKIP
    >>> slow.other_schemes, slow.other_platforms                            # doctest: +SKIP
    (('bf16', 'fp8', 'fp8_block', 'mxfp4'), ('a100', 'h200', 'b200', 'gb200', 'rtx-pro-6000'))

(The other platforms are presets, which assume Triton installed.)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from moe.platform import PRESET_NAMES, Platform
from moe.problem import scale_block_reasons
from moe.quant import QuantScheme

if TYPE_CHECKING:
    from moe.oracle.select import Bucket, Plan

REFERENCE = "reference"  # the registered name of moe.experts.reference.ReferenceExperts
# schemes offered as alternatives, in the order a user would try them (unquantized: the layer's dtype)
_ALTERNATIVE_SCHEMES = ("unquantized", "fp8", "fp8_token", "fp8_block", "mxfp8", "mxfp4", "nvfp4")


@dataclass(frozen=True)
class SlowPath:
    """The buckets a plan serves with the reference experts on a GPU, and the way out."""

    scheme: str  # the problem's scheme name ("nvfp4")
    device: str  # the platform's name ("h100", "NVIDIA H100 80GB HBM3")
    buckets: tuple[tuple[int, int], ...]  # (low, high) token ranges served by the reference
    refusals: tuple[tuple[str, tuple[str, ...]], ...]  # (experts name, its reasons) of every other backend
    other_schemes: tuple[str, ...]  # schemes a kernel serves on this platform
    other_platforms: tuple[str, ...]  # platform presets on which a kernel serves this scheme

    def message(self) -> str:
        ranges = ", ".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in self.buckets)
        lines = [f"slow path: no kernel serves {self.scheme} on {self.device}, so the reference experts "
                 f"(float32, dequantized weights; orders of magnitude slower) run M in {ranges}.",
                 "Why each kernel refused:"]
        lines += [f"  - {name}: {'; '.join(reasons)}" for name, reasons in self.refusals]
        lines.append("What would serve with a kernel: "
                     + "; ".join(part for part in (self._schemes(), self._platforms()) if part))
        return "\n".join(lines)

    def _schemes(self) -> str:
        if not self.other_schemes:
            return "no other scheme on this platform"
        return f"quant={' or '.join(self.other_schemes)} on this {self.device}"

    def _platforms(self) -> str:
        if not self.other_platforms:
            return "no GPU that moe knows runs this scheme with a kernel"
        return f"{self.scheme} on {', '.join(self.other_platforms)}"


def slow_buckets(plan: "Plan") -> tuple["Bucket", ...]:
    """The buckets served by the reference experts, on a CUDA platform only (on a CPU it is the way)."""
    if not plan.platform.is_cuda:
        return ()
    return tuple(b for b in plan.buckets if b.chosen.pair.experts == REFERENCE)


def slow_path(plan: "Plan") -> SlowPath | None:
    """What the plan's slow buckets are and what would serve them; None when there are none, or when
    the policy forced the reference experts (the user asked for them)."""
    buckets = slow_buckets(plan)
    if not buckets or REFERENCE in plan.policy.force:
        return None
    refusals = tuple((c.name, c.reasons) for c in plan.candidates
                     if c.kind == "experts" and c.name != REFERENCE and c.reasons)
    return SlowPath(
        scheme=plan.problem.quant_name, device=plan.platform.name, buckets=tuple((b.low, b.high) for b in buckets),
        refusals=refusals, other_schemes=_schemes_with_a_kernel(plan), other_platforms=_platforms_with_a_kernel(plan),
    )


def _has_a_kernel(plan: "Plan") -> bool:
    return bool(plan.buckets) and all(b.chosen.pair.experts != REFERENCE for b in plan.buckets)


def _schemes_with_a_kernel(plan: "Plan") -> tuple[str, ...]:
    found, p = [], plan.problem
    for name in _ALTERNATIVE_SCHEMES:
        scheme = QuantScheme.from_name(name)
        if scheme == p.quant or scale_block_reasons(scheme, p.hidden_size, p.intermediate_size):
            continue
        problem = dataclasses.replace(p, quant=scheme)
        if _has_a_kernel(plan.replanned(problem=problem)):
            found.append(problem.quant_name)
    return tuple(found)


def _platforms_with_a_kernel(plan: "Plan") -> tuple[str, ...]:
    found = []
    for name in PRESET_NAMES:
        platform = Platform.preset(name)
        if platform.is_cuda and name != plan.platform.kind and _has_a_kernel(plan.replanned(platform=platform)):
            found.append(name)
    return tuple(found)
