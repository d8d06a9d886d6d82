"""Random inputs for conformance runs: weights and routed activations for a given problem, seeded.

Inputs are never zeros and pass through the scheme's quantizer once (weights are stored quantized,
activations are quantized by the prepare stage), so a backend and ``reference`` see the same values.
"""

from __future__ import annotations

import zlib

import torch

from moe.problem import MoEProblem
from moe.router import Router, TopK
from moe.weights import ExpertWeights


def seeded_generator(*parts: object) -> torch.Generator:
    """A CPU generator seeded from ``parts`` (e.g. a case label and M): reruns see the same data."""
    gen = torch.Generator()
    gen.manual_seed(zlib.crc32(repr(parts).encode()))
    return gen


def random_dense(problem: MoEProblem, gen: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """Float32 canonical weights of the local experts, scaled so activations stay O(1)."""
    p, e = problem, problem.local_num_experts
    tensors = {
        "w13": torch.randn(e, p.w13_rows, p.hidden_size, generator=gen) / p.hidden_size**0.5,
        "w2": torch.randn(e, p.hidden_size, p.intermediate_size, generator=gen) / p.intermediate_size**0.5,
    }
    if p.has_bias:
        tensors["b13"] = 0.1 * torch.randn(e, p.w13_rows, generator=gen)
        tensors["b2"] = 0.1 * torch.randn(e, p.hidden_size, generator=gen)
    return tensors


def random_weights(problem: MoEProblem, gen: torch.Generator | None = None, device: torch.device | str = "cpu") -> ExpertWeights:
    """Canonical ``ExpertWeights`` for the problem's local experts, stored in its weight format."""
    weights = ExpertWeights.from_dense(**random_dense(problem, gen), quant=problem.quant, dtype=problem.dtype)
    return weights.to(device)


def random_inputs(
    problem: MoEProblem, num_tokens: int, gen: torch.Generator | None = None, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, TopK]:
    """``hidden [M, H]`` in the problem's dtype and its ``TopK`` from a softmax router over random logits."""
    hidden = torch.randn(num_tokens, problem.hidden_size, generator=gen).to(problem.dtype)
    logits = torch.randn(num_tokens, problem.num_experts, generator=gen)
    topk = Router("softmax", problem.num_experts, problem.top_k)(logits)
    return hidden.to(device), TopK(topk.ids.to(device), topk.weights.to(device))
