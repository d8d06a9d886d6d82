"""Random inputs for conformance runs: weights and routed activations for a given problem, seeded.

Inputs are never zeros and pass through the scheme's quantizer once (weights are stored quantized,
activations are quantized by the prepare stage), so a backend and ``reference`` see the same values.
"""

from __future__ import annotations

import zlib

import torch

from moe.problem import MoEProblem
from moe.router import Router, TopK
from moe.synthetic import random_dense  # noqa: F401 -- the one generator, re-exported for the kit's users
from moe.weights import ExpertWeights


def seeded_generator(*parts: object) -> torch.Generator:
    """A CPU generator seeded from ``parts`` (e.g. a case label and M): reruns see the same data."""
    gen = torch.Generator()
    gen.manual_seed(zlib.crc32(repr(parts).encode()))
    return gen


def random_weights(problem: MoEProblem, gen: torch.Generator | None = None, device: torch.device | str = "cpu") -> ExpertWeights:
    """Canonical ``ExpertWeights`` for the problem's local experts (`moe.synthetic.random_dense`, float32
    on the CPU), stored in its weight format, then moved to ``device``."""
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
