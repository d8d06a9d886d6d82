"""Routers: router logits ``[M, E]`` -> `TopK` (the k experts of each token and their weights).

`Router` is one validated configuration of one routing kind. The kinds are data
(`moe.routing.ROUTING_KINDS`: score function, selection, renormalize default, what options they
take), so a Router composes its routing from a declaration:

- ``softmax`` (Mixtral, Qwen2-MoE, Qwen3-MoE): softmax over the E logits, then the k largest
  probabilities; ``renormalize`` (HF's ``norm_topk_prob``) divides them by their sum.
- ``gpt_oss`` (GPT-OSS): the k largest raw logits, then a softmax over those k only (sums to 1).
- ``deepseek_v3`` (DeepSeek-V3, Nemotron-3): sigmoid scores; *selection* uses ``scores + bias``
  (the learned ``e_score_correction_bias``), restricted to the ``topk_group`` best of ``n_group``
  equal groups of experts, a group being scored by the sum of its two best biased scores; the
  *weights* are the unbiased scores of the chosen experts, renormalized if asked.
- ``deepseek_v4``: as ``deepseek_v3`` without groups, with ``sqrt(softplus(x))`` scores.
- ``deepseek_v4_hash`` (DeepSeek-V4's first layers): the experts are ``hash_table[input_ids]``,
  weighted by their ``sqrt(softplus)`` scores, renormalized.
- ``llama4``: the k largest raw logits, each weighted by its sigmoid; the layer multiplies the
  expert's *input* by the weight (top_k=1 only).
- ``longcat_flash``: softmax scores, bias-corrected choice, unnormalized weights.

``num_zero_experts`` (any kind) adds identity experts numbered E..E+Z-1 after the E real ones (the
logits are ``[M, E + Z]``): `moe.layer.FusedMoE` adds ``weight * hidden`` for each such slot.

Ties are broken towards the lower index. All math is float32 whatever the logits' dtype; outputs
live on the logits' device. On CUDA the routing runs as one fused Triton kernel where
`moe.routing.fused.fused_pays` says so; `moe.routing.reference.route_reference` is its twin.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from moe.errors import MoEConfigError
from moe.routing import ROUTING_KINDS, ROUTING_NAMES, RoutingKind
from moe.routing.checks import (
    check_correction_bias,
    check_count,
    check_groups,
    check_hash_table,
    check_input_ids,
    check_logits,
    check_renormalize,
    check_top_k,
)
from moe.routing.fused import fused_pays, fused_route  # Triton loads at the first launch only
from moe.routing.reference import route_reference
from moe.routing.topk import TopK

__all__ = ["ROUTING_NAMES", "Router", "TopK", "deepseek_v3_topk", "gpt_oss_topk", "softmax_topk"]

# Router options only some kinds take, and the RoutingKind flag that says which.
_KIND_OPTIONS = {"n_group": "groups", "topk_group": "groups", "correction_bias": "bias"}


@dataclass(frozen=True)
class Router:
    """A routing with its options, validated once; ``router(logits [M, E + Z], input_ids=None) -> TopK``.

    ``routed_scaling_factor`` multiplies the weights of every routing (DeepSeek-V3: 2.5). Options a
    routing would ignore are rejected rather than dropped: ``n_group``/``topk_group`` belong to the
    kinds that take groups, ``correction_bias`` to those that take a bias, ``hash_table`` to
    ``deepseek_v4_hash`` (which needs it); ``gpt_oss`` always normalizes, so it takes no
    ``renormalize=False``. ``renormalize=None`` means the kind's default (resolved at construction).
    ``correction_bias`` and ``hash_table`` are weights, not configuration: no part of equality or repr.

    >>> router = Router("softmax", num_experts=8, top_k=2)
    >>> router(torch.zeros(3, 8)).ids.tolist()
    [[0, 1], [0, 1], [0, 1]]
    """

    routing: str  # one of ROUTING_NAMES
    num_experts: int  # E: real experts (not counting zero experts)
    top_k: int  # k
    renormalize: bool | None = None  # make the k weights sum to 1; None: the kind's default
    n_group: int | None = None  # kinds with groups: groups of experts (None: one group)
    topk_group: int | None = None  # kinds with groups: groups kept per token
    correction_bias: torch.Tensor | None = field(default=None, compare=False, repr=False)  # [E + Z]
    routed_scaling_factor: float = 1.0  # multiplies every weight
    num_zero_experts: int = 0  # Z identity experts, ids E..E+Z-1 (LongCat-Flash's zero_expert_num)
    hash_table: torch.Tensor | None = field(default=None, compare=False, repr=False)  # int [vocab, k]

    def __post_init__(self):
        if self.routing not in ROUTING_NAMES:
            raise MoEConfigError(f"routing must be one of {ROUTING_NAMES} (got {self.routing!r})")
        check_count("num_experts", self.num_experts, 1)
        check_count("num_zero_experts", self.num_zero_experts, 0)
        check_top_k(self.top_k, self.num_choices)
        if self.renormalize is None:
            object.__setattr__(self, "renormalize", self.kind.renormalize)  # the kind's default, once
        check_renormalize(self.renormalize)
        factor = self.routed_scaling_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor < math.inf:
            raise MoEConfigError(f"routed_scaling_factor must be a finite number > 0 (got {factor!r})")
        self._check_kind_options()

    def _check_kind_options(self) -> None:
        kind = self.kind
        for name, flag in _KIND_OPTIONS.items():
            if getattr(self, name) is not None and not getattr(kind, flag):
                takers = [k.name for k in ROUTING_KINDS.values() if getattr(k, flag)]
                shown = "<tensor>" if name == "correction_bias" else repr(getattr(self, name))
                raise MoEConfigError(
                    f"{name} is a {' / '.join(takers)} option; routing={self.routing!r} would ignore it "
                    f"(got {name}={shown})"
                )
        if kind.groups:
            check_groups(self.num_choices, self.top_k, self.n_group, self.topk_group)
        check_correction_bias(self.correction_bias, self.num_choices)
        # once, here: a NaN bias would pick arbitrary experts; the per-call check cannot read values
        if self.correction_bias is not None and not bool(torch.isfinite(self.correction_bias).all()):
            raise MoEConfigError("correction_bias contains NaN or inf; every expert's bias must be finite")
        if kind.always_normalized and not self.renormalize:
            raise MoEConfigError(
                f"renormalize=False is not available for routing={self.routing!r}: its weights are a softmax "
                "over the k chosen logits and always sum to 1; leave renormalize at True"
            )
        if (kind.selection == "table") != (self.hash_table is not None):
            raise MoEConfigError(
                f"hash_table (int [vocab_size, top_k], DeepSeek-V4's tid2eid) is required by routing="
                f"'deepseek_v4_hash' and taken by no other (got routing={self.routing!r}, "
                f"hash_table={'<tensor>' if self.hash_table is not None else None})"
            )
        if self.hash_table is not None:
            check_hash_table(self.hash_table, self.top_k, self.num_choices)

    @property
    def kind(self) -> RoutingKind:
        """The declaration of this router's routing."""
        return ROUTING_KINDS[self.routing]

    @property
    def num_choices(self) -> int:
        """E + Z: the width of the router logits, real experts then zero experts."""
        return self.num_experts + self.num_zero_experts

    def __call__(self, router_logits: torch.Tensor, input_ids: torch.Tensor | None = None) -> TopK:
        """Routes ``router_logits [M, E + Z]`` (any float dtype) to a `TopK` on the same device.

        ``input_ids [M]`` (integer token ids) is required by ``deepseek_v4_hash``; other kinds check
        its shape when given (a model may pass the ids to every layer) and do not read it."""
        self.check_inputs(router_logits, input_ids)
        if fused_pays(self, router_logits):
            return fused_route(router_logits, self)
        return route_reference(router_logits, self, input_ids)

    def check_inputs(self, router_logits: torch.Tensor, input_ids: torch.Tensor | None) -> None:
        """Raises `MoEConfigError` unless ``router_logits`` / ``input_ids`` fit this router."""
        check_logits(router_logits)
        if router_logits.shape[1] != self.num_choices:
            zero = f" + num_zero_experts={self.num_zero_experts}" if self.num_zero_experts else ""
            raise MoEConfigError(
                f"router_logits last dimension must equal num_experts={self.num_experts}{zero} "
                f"(got shape {tuple(router_logits.shape)})"
            )
        if input_ids is None and self.hash_table is not None:
            raise MoEConfigError(
                "routing='deepseek_v4_hash' picks experts by token id: pass input_ids [M] (the layer's token ids)"
            )
        if input_ids is not None:
            vocab = None if self.hash_table is None else self.hash_table.shape[0]
            check_input_ids(input_ids, router_logits.shape[0], router_logits.device, vocab)


# ----------------------------------------------------------------------------------------------
# The original three routings as functions: each the reference of one kind, validating its arguments.


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool = True) -> TopK:
    """Softmax over E (float32), then the k largest; ``renormalize`` makes each row sum to 1."""
    check_logits(logits)
    return route_reference(logits, Router("softmax", logits.shape[1], top_k, renormalize))


def gpt_oss_topk(logits: torch.Tensor, top_k: int) -> TopK:
    """The k largest raw logits, then a softmax over those k (each row sums to 1)."""
    check_logits(logits)
    return route_reference(logits, Router("gpt_oss", logits.shape[1], top_k))


def deepseek_v3_topk(
    logits: torch.Tensor,
    top_k: int,
    *,
    n_group: int | None,
    topk_group: int | None,
    correction_bias: torch.Tensor | None = None,
    renormalize: bool = True,
) -> TopK:
    """DeepSeek-V3's grouped, bias-corrected sigmoid routing (``noaux_tc``); see the module docstring."""
    check_logits(logits)
    router = Router("deepseek_v3", logits.shape[1], top_k, renormalize, n_group, topk_group, correction_bias)
    return route_reference(logits, router)
