"""Builders shared by the tests: small problems, random weights and inputs in a given scheme."""

from __future__ import annotations

import torch

from moe import ExpertWeights, MoEProblem, ParallelConfig, Router
from moe.quant import QuantFormat

# Sizes per weight format: odd-ish where the format allows it (fp8 blocks: partial 128-blocks).
SIZES = {
    QuantFormat.NONE: (40, 24),
    QuantFormat.FP8_TENSOR: (72, 40),
    QuantFormat.FP8_ROW: (72, 40),
    QuantFormat.FP8_BLOCK: (136, 72),
    QuantFormat.MXFP8: (96, 64),
    QuantFormat.MXFP4: (96, 64),
    QuantFormat.NVFP4: (96, 48),
}


def make_problem(weight_fmt=QuantFormat.NONE, *, quant="bf16", activation="silu", dtype=torch.bfloat16,
                 num_experts=6, top_k=2, has_bias=False, max_tokens=64, expert_map=None, **kwargs) -> MoEProblem:
    hidden, intermediate = SIZES[weight_fmt]
    parallel = ParallelConfig(expert_map=tuple(expert_map)) if expert_map else ParallelConfig()
    return MoEProblem.create(
        num_experts=num_experts, top_k=top_k, hidden_size=kwargs.pop("hidden_size", hidden),
        intermediate_size=kwargs.pop("intermediate_size", intermediate), activation=activation,
        quant=quant, dtype=dtype, has_bias=has_bias, max_tokens=max_tokens, parallel=parallel, **kwargs,
    )


def random_dense(problem: MoEProblem, gen: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """Float32 canonical weights for the local experts, scaled so activations stay O(1)."""
    p, e = problem, problem.local_num_experts
    tensors = {
        "w13": torch.randn(e, p.w13_rows, p.hidden_size, generator=gen) / p.hidden_size**0.5,
        "w2": torch.randn(e, p.hidden_size, p.intermediate_size, generator=gen) / p.intermediate_size**0.5,
    }
    if p.has_bias:
        tensors["b13"] = 0.1 * torch.randn(e, p.w13_rows, generator=gen)
        tensors["b2"] = 0.1 * torch.randn(e, p.hidden_size, generator=gen)
    return tensors


def random_weights(problem: MoEProblem, gen=None) -> ExpertWeights:
    return ExpertWeights.from_dense(**random_dense(problem, gen), quant=problem.quant, dtype=problem.dtype)


def random_inputs(problem: MoEProblem, num_tokens: int, gen=None):
    """(hidden [M, H] in the problem's dtype, TopK from a softmax router over random logits)."""
    hidden = torch.randn(num_tokens, problem.hidden_size, generator=gen).to(problem.dtype)
    logits = torch.randn(num_tokens, problem.num_experts, generator=gen)
    topk = Router("softmax", problem.num_experts, problem.top_k)(logits)
    return hidden, topk
