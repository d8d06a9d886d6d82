"""What `moe.layer.FusedMoE` does around the router for kinds whose output is more than ids and weights.

- Zero experts (``Router(num_zero_experts=Z)``, LongCat-Flash): a slot routed to an id in
  ``[E, E + Z)`` outputs ``weight * hidden`` (transformers' ``LongcatFlashExperts`` runs an identity
  for it). `fold_zero_experts` adds those into ``shared_output`` (finalize adds it once) and points the
  slot at one of the token's own real experts (the lowest id) with weight 0, so the experts never see an id >= E and the
  slot loads no expert weights the token does not load already (it is one more row of a GEMM that
  runs anyway; the experts backends have no "skip this slot" id).
- Weight on input (Llama-4): the expert computes ``f(weight * hidden)``, not ``weight * f(hidden)``.
  With top_k = 1 that is the same layer on a scaled input with weight 1 (`weight_on_input`); with
  top_k > 1 each slot would need its own input, which the layer refuses at construction.
"""

from __future__ import annotations

import torch

from moe.routing.topk import TopK


def fold_zero_experts(
    topk: TopK, hidden: torch.Tensor, num_experts: int, shared_output: torch.Tensor | None
) -> tuple[TopK, torch.Tensor]:
    """``topk`` with its zero-expert slots (ids >= ``num_experts``) made inert, and ``shared_output``
    plus their ``weight * hidden`` ([M, H] in hidden's dtype)."""
    zero = topk.ids >= num_experts
    zero_weight = torch.where(zero, topk.weights, 0.0).sum(dim=-1, keepdim=True)  # [M, 1] float32
    identity = (zero_weight * hidden.float()).to(hidden.dtype)
    shared = identity if shared_output is None else shared_output + identity
    # the token's lowest real expert id, or expert 0 when all k slots are zero experts
    first_real = torch.where(zero, num_experts, topk.ids).min(dim=-1, keepdim=True).values
    substitute = torch.where(first_real == num_experts, 0, first_real).to(torch.int32)
    ids = torch.where(zero, substitute, topk.ids)
    return TopK(ids, torch.where(zero, 0.0, topk.weights)), shared


def weight_on_input(topk: TopK, hidden: torch.Tensor) -> tuple[TopK, torch.Tensor]:
    """For top_k = 1: ``(topk with weight 1, hidden * weight)`` (the product in float32, stored in
    hidden's dtype), so that the experts compute ``f(weight * hidden)``."""
    assert topk.top_k == 1, "weight on input is defined for top_k = 1 only (checked by FusedMoE)"
    scaled = (hidden.float() * topk.weights).to(hidden.dtype)
    return TopK(topk.ids, torch.ones_like(topk.weights)), scaled
