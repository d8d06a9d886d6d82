"""Expert parallelism at load: which experts a rank holds, and its shard of the full weights.

Under expert parallelism (``ParallelConfig(ep_size, ep_rank, expert_map, group)``) each rank holds the
weights of its ``E_local`` experts. `shard_weights` cuts them out of the full ``[E, ...]`` weights,
once, at load; how tokens travel to those experts and back is the transports' concern
(`moe.prepare_finalize`).
"""

from __future__ import annotations

from moe.errors import MoEConfigError
from moe.problem import MoEProblem, ParallelConfig
from moe.weights import ExpertWeights


def local_expert_ids(parallel: ParallelConfig, num_experts: int) -> list[int]:
    """The global ids of this rank's experts, in local order (local id i -> ``result[i]``)."""
    to_local = parallel.global_to_local(num_experts)
    owned = sorted((local, expert) for expert, local in enumerate(to_local) if local >= 0)
    return [expert for _, expert in owned]


def shard_weights(weights: ExpertWeights, problem: MoEProblem) -> ExpertWeights:
    """This rank's experts out of the full ``[E, ...]`` weights (scales and biases included).

    >>> import torch
    >>> problem = MoEProblem.create(num_experts=4, top_k=2, hidden_size=8, intermediate_size=4,
    ...                             dtype=torch.float32, quant="fp32",
    ...                             parallel=ParallelConfig(ep_size=2, ep_rank=1))
    >>> full = ExpertWeights.from_dense(torch.randn(4, 8, 8), torch.randn(4, 8, 4))
    >>> shard_weights(full, problem).num_experts       # experts 2 and 3
    2
    """
    if not isinstance(weights, ExpertWeights):
        raise MoEConfigError(f"weights: expected ExpertWeights (got {type(weights).__name__})")
    if problem.parallel.num_redundant_experts:
        raise MoEConfigError(
            f"shard_weights cuts fixed shards; with num_redundant_experts={problem.parallel.num_redundant_experts} "
            "a rank's slots follow the EPLB placement: load the full weights into FusedMoE (moe.eplb)"
        )
    if weights.num_experts != problem.num_experts:
        raise MoEConfigError(
            f"shard_weights takes the full weights of all E={problem.num_experts} experts "
            f"(got {weights.num_experts}); weights that are already sharded need no shard_weights"
        )
    return weights.select_experts(local_expert_ids(problem.parallel, problem.num_experts))
