"""``ModeSpec``: what one FlashInfer backend needs for one (weight, activation) format pair.

One FlashInfer backend runs different kernels per quantization pair, each with its own architectures,
alignment, activations and bias support. A backend declares them as a table of ModeSpecs -- data, read
by its ``extra_checks`` -- next to the class-level ``Capabilities`` (which holds the union). Example::

    W4A16 = ModeSpec(archs=SM90_ONLY, h_align=128, i_align=128, pads=True, ...)

says: this pair runs on SM90 exactly; H and I must be multiples of 128, and the backend zero-pads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe.activation import ActivationKind
from moe.experts._flashinfer.library import missing_feature_reasons
from moe.platform import Platform
from moe.problem import MoEProblem
from moe.quant import QuantFormat

Pair = tuple[QuantFormat, QuantFormat]

SM90_ONLY = frozenset({90})
SM89_TO_SM121 = frozenset({89, 90, 100, 103, 107, 110, 120, 121})
SM100_FAMILY = frozenset({100, 103})  # trtllm-gen cubins and CuTe-DSL NVFP4 in FlashInfer 0.7.2
SM100_PLUS = frozenset({100, 103, 107, 110, 120, 121})

GATED = frozenset({ActivationKind.SILU, ActivationKind.GELU, ActivationKind.SWIGLU_OAI})
ALL_ACTIVATIONS = GATED | {ActivationKind.RELU2}


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def sm_name(archs: frozenset[int]) -> str:
    return "/".join(f"SM{a}" for a in sorted(archs))


@dataclass(frozen=True)
class ModeSpec:
    """One format pair's kernel and its constraints."""

    kernel: str  # the FlashInfer entry point (for messages and contract tests)
    archs: frozenset[int]  # compute capabilities as major*10+minor, exactly
    activations: frozenset[ActivationKind]
    h_align: int = 1  # H must be a multiple of this ...
    i_align: int = 1  # ... and I of this (gated activations) ...
    i_align_nongated: int | None = None  # ... or of this (relu2); None: i_align
    pads: bool = False  # True: the backend zero-pads H and I itself, so alignment never rejects
    bias: bool = False
    dtypes: frozenset[torch.dtype] = frozenset({torch.bfloat16})
    features: tuple[str, ...] = ()  # FlashInfer features (library.FEATURE_SOURCES) it calls

    def intermediate_align(self, problem: MoEProblem) -> int:
        if problem.activation.is_gated or self.i_align_nongated is None:
            return self.i_align
        return self.i_align_nongated

    def padded_sizes(self, problem: MoEProblem) -> tuple[int, int]:
        """(H, I) as the kernel sees them: rounded up to the alignment when the backend pads."""
        h, i = problem.hidden_size, problem.intermediate_size
        if not self.pads:
            return h, i
        return round_up(h, self.h_align), round_up(i, self.intermediate_align(problem))

    def problem_reasons(self, problem: MoEProblem) -> list[str]:
        reasons = []
        if problem.activation.kind not in self.activations:
            allowed = ", ".join(sorted(a.value for a in self.activations))
            reasons.append(f"{self.kernel} does not fuse activation {problem.activation.name}; it fuses {allowed}")
        if problem.has_bias and not self.bias:
            reasons.append(f"{self.kernel} takes no expert biases for this quantization")
        if problem.dtype not in self.dtypes:
            allowed = ", ".join(sorted(str(d) for d in self.dtypes))
            reasons.append(f"{self.kernel} runs {allowed} activations for this quantization, not {problem.dtype}")
        if not self.pads:
            alignments = (("hidden_size", self.h_align), ("intermediate_size", self.intermediate_align(problem)))
            for dim, multiple in alignments:
                value = getattr(problem, dim)
                if value % multiple:
                    reasons.append(
                        f"{dim} must be a multiple of {multiple} for {self.kernel} (got {value}); "
                        "pad the weights or use another backend"
                    )
        return reasons

    def platform_reasons(self, platform: Platform) -> list[str]:
        reasons = []
        if platform.is_cuda and platform.capability is not None:
            arch = platform.capability[0] * 10 + platform.capability[1]
            if arch not in self.archs:
                reasons.append(f"{self.kernel} for this quantization needs {sm_name(self.archs)} (got SM{arch})")
        return reasons + missing_feature_reasons(platform, self.features)


def mode_reasons(modes: dict[Pair, ModeSpec], problem: MoEProblem, platform: Platform | None) -> list[str]:
    """The reasons of the mode serving ``problem``'s quantization pair (none when no mode does:
    the class-level capability check already reports the unsupported pair)."""
    spec = modes.get((problem.quant.weight, problem.quant.activation))
    if spec is None:
        return []
    reasons = spec.problem_reasons(problem)
    if platform is not None:
        reasons += spec.platform_reasons(platform)
    return reasons


def contiguous_expert_slice(problem: MoEProblem) -> tuple[int, int] | None:
    """(first global expert, count) when this rank's experts are one contiguous block, else None.

    FlashInfer kernels take expert parallelism as an offset + count (or ep_size/ep_rank), so an
    expert map that scatters a rank's experts cannot be expressed.
    """
    table = problem.parallel.global_to_local(problem.num_experts)
    local = [g for g, l in enumerate(table) if l >= 0]
    if not local or local != list(range(local[0], local[0] + len(local))):
        return None
    if [table[g] for g in local] != list(range(len(local))):
        return None
    return local[0], len(local)


def expert_map_reasons(problem: MoEProblem, *, ep_size_rank: bool = False) -> list[str]:
    """Why ``problem``'s expert placement cannot be expressed (empty when it can).

    ``ep_size_rank``: the kernel takes ``ep_size``/``ep_rank`` (CUTLASS), so the block must also be the
    default contiguous sharding ``E / ep_size`` experts per rank.
    """
    block = contiguous_expert_slice(problem)
    if block is None:
        return ["the expert map gives this rank a non-contiguous set of experts; FlashInfer takes an offset + count"]
    if ep_size_rank and problem.parallel.enabled:
        ep = problem.parallel
        per_rank = problem.num_experts // ep.ep_size
        if problem.num_experts % ep.ep_size or block != (ep.ep_rank * per_rank, per_rank):
            return [
                "cutlass_fused_moe shards experts as ep_rank * E/ep_size .. + E/ep_size; "
                f"this rank holds experts {block[0]}..{block[0] + block[1] - 1}"
            ]
    return []
