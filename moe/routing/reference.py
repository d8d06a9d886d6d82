"""The reference of every routing kind: plain torch, float32, composed from the kind's declaration.

Ties are broken towards the lower index, for experts and for groups alike, so routing is
deterministic on every device (``torch.topk`` promises no order among equal values; a stable
descending sort does). Outputs live on the logits' device; nothing here synchronizes with the host.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

import torch

from moe.routing import ROUTING_KINDS
from moe.routing.topk import TopK

if TYPE_CHECKING:
    from moe.router import Router

# A sum of k router weights below this is treated as this, so that renormalizing sigmoid scores
# that all underflowed to 0 gives 0 rather than NaN (HF's DeepSeek-V3/V4 add 1e-20 for the same reason).
MIN_WEIGHT_SUM = 1e-20


def sqrtsoftplus(x: torch.Tensor) -> torch.Tensor:
    """``sqrt(softplus(x))`` with torch's softplus (beta 1, linear above 20): DeepSeek-V4's score."""
    return torch.nn.functional.softplus(x).sqrt()


SCORE_FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "softmax": lambda x: torch.softmax(x, dim=-1),
    "sigmoid": torch.sigmoid,
    "sqrtsoftplus": sqrtsoftplus,
}


def top_k_descending(values: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row and their indices, ties towards the lower index."""
    sorted_values, indices = torch.sort(values, dim=-1, descending=True, stable=True)
    return sorted_values[:, :top_k], indices[:, :top_k]


def renormalized(weights: torch.Tensor) -> torch.Tensor:
    """Each row divided by its sum (a sum below MIN_WEIGHT_SUM counts as MIN_WEIGHT_SUM)."""
    return weights / weights.sum(dim=-1, keepdim=True).clamp_min(MIN_WEIGHT_SUM)


def mask_to_best_groups(biased: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """``biased`` with every expert outside each row's ``topk_group`` best groups set to -inf; a group
    scores the sum of its two best values.

    -inf, as vLLM does; HF's DeepSeek-V3 masks with 0.0, which can pick a masked expert when biased
    scores are negative."""
    num_tokens, num_experts = biased.shape
    grouped = biased.view(num_tokens, n_group, num_experts // n_group)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # a sum: the order of ties is moot
    _, kept_groups = top_k_descending(group_scores, topk_group)
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), -math.inf).view(num_tokens, num_experts)


def route_reference(logits: torch.Tensor, router: Router, input_ids: torch.Tensor | None = None) -> TopK:
    """``router``'s routing of ``logits [M, E + num_zero_experts]`` (validated by the caller), in torch.

    ``input_ids [M]`` (token ids) is read by the ``table`` selection only."""
    kind = ROUTING_KINDS[router.routing]
    score = SCORE_FUNCTIONS[kind.score]
    values = logits.float()
    if kind.selection == "logits":
        chosen, ids = top_k_descending(values, router.top_k)
        weights = score(chosen)
    else:
        scores = score(values)
        ids = (
            router.hash_table[input_ids.long()].long()
            if kind.selection == "table"
            else _select_by_scores(scores, router)
        )
        weights = scores.gather(1, ids)
    if router.renormalize and not kind.always_normalized:
        weights = renormalized(weights)
    if router.routed_scaling_factor != 1.0:
        weights = weights * router.routed_scaling_factor
    return TopK(ids.to(torch.int32), weights)


def _select_by_scores(scores: torch.Tensor, router: Router) -> torch.Tensor:
    """The k best of ``scores + correction_bias`` within the kept groups: int64 ids ``[M, k]``."""
    bias = router.correction_bias
    biased = scores if bias is None else scores + bias.to(scores)
    if router.n_group is not None and router.topk_group < router.n_group:
        biased = mask_to_best_groups(biased, router.n_group, router.topk_group)
    return top_k_descending(biased, router.top_k)[1]
