"""Random weights shaped and scaled like a trained layer's: the one generator of the demos, the
benchmarks and the test kit (``moe.testing.inputs`` re-exports it).

The scaling keeps activations O(1) through both GEMMs: each ``w13`` row has variance 1/H and each
``w2`` row 1/I, so a unit-variance input gives unit-variance outputs, as in a trained layer.
"""

from __future__ import annotations

import torch

from moe.problem import MoEProblem


def random_dense(problem: MoEProblem, gen: torch.Generator | None = None, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Dense canonical weights of ``problem``'s local experts (E_local of them), on ``device``.

    ``w13 [E_local, w13_rows, H]`` ~ N(0, 1/H) and ``w2 [E_local, H, I]`` ~ N(0, 1/I) in ``dtype``; with
    ``problem.has_bias``, ``b13 [E_local, w13_rows]`` and ``b2 [E_local, H]`` ~ 0.1 N(0, 1) in float32
    (the dtype `moe.weights.ExpertWeights` keeps biases in). Drawn in that order from ``gen``, a generator
    on ``device`` (None: torch's default one), so a seed gives the same weights wherever it is drawn with
    the same device and dtype. The keys are the keywords of ``ExpertWeights.from_dense`` and
    ``FusedMoE.load_weights``. ``dtype`` lets a benchmark draw a large layer directly in its storage
    dtype on the GPU, without a float32 copy on the host.
    """
    p, e = problem, problem.local_num_experts
    draw = lambda *shape, dtype=dtype: torch.randn(*shape, generator=gen, device=device, dtype=dtype)  # noqa: E731
    tensors = {
        "w13": draw(e, p.w13_rows, p.hidden_size).div_(p.hidden_size**0.5),
        "w2": draw(e, p.hidden_size, p.intermediate_size).div_(p.intermediate_size**0.5),
    }
    if p.has_bias:
        tensors["b13"] = draw(e, p.w13_rows, dtype=torch.float32).mul_(0.1)
        tensors["b2"] = draw(e, p.hidden_size, dtype=torch.float32).mul_(0.1)
    return tensors
