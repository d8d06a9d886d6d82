"""Routers: router logits ``[M, E]`` -> `TopK` (the k experts of each token and their weights).

Three routings, each a pure function (the reference) that `Router` composes with validation and the
routed scaling factor:

- ``softmax`` (Mixtral, Qwen3-MoE): softmax over the E logits in float32, then the k largest
  probabilities; ``renormalize`` divides them by their sum.
- ``gpt_oss`` (GPT-OSS): the k largest raw logits, then a softmax over those k only (sums to 1).
- ``deepseek_v3`` (DeepSeek-V3, Nemotron-3): sigmoid scores; *selection* uses ``scores + bias``
  (the learned ``e_score_correction_bias``), restricted to the ``topk_group`` best of ``n_group``
  equal groups of experts, a group being scored by the sum of its two best biased scores; the
  *weights* are the unbiased scores of the chosen experts, renormalized if asked.

Ties are broken towards the lower index, for experts and for groups alike, so routing is
deterministic on every device (``torch.topk`` promises no order among equal values; a stable
descending sort does). All math is float32 whatever the logits' dtype; outputs live on the
logits' device and nothing here synchronizes with the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from moe.errors import MoEConfigError

ROUTING_NAMES = ("softmax", "gpt_oss", "deepseek_v3")

# A sum of k router weights below this is treated as this, so that renormalizing sigmoid scores
# that all underflowed to 0 gives 0 rather than NaN (HF's DeepSeek-V3 adds 1e-20 for the same reason).
_MIN_WEIGHT_SUM = 1e-20


@dataclass(frozen=True, eq=False)
class TopK:
    """The experts each token goes to, and with what weight: the router's output.

    Row ``m`` lists token m's experts, best first (ties: lower expert id first). Equality is
    identity (tensors have no single truth value).

    Example, M=2 tokens, E=4 experts, k=2, softmax routing with renormalize::

        logits  = [[2.0, 1.0, 0.0, 0.0],    ids     = [[0, 1],    weights = [[e/(e+1), 1/(e+1)],
                   [0.0, 0.0, 3.0, 0.0]]               [2, 0]]               [e^3/(e^3+1), 1/(e^3+1)]]

    (row 1: experts 0, 1 and 3 tie at 0.0, so the lower id, 0, takes the second slot).
    """

    ids: torch.Tensor  # int32 [M, k]: global expert ids in [0, E)
    weights: torch.Tensor  # float32 [M, k]: router weight of each chosen expert

    def __post_init__(self):
        for name in ("ids", "weights"):
            if not isinstance(getattr(self, name), torch.Tensor):
                raise MoEConfigError(
                    f"TopK {name} must be a torch.Tensor [M, k] (got {type(getattr(self, name)).__name__}); "
                    "a Router builds a TopK from router logits"
                )
        if self.ids.dim() != 2 or self.ids.shape != self.weights.shape:
            raise MoEConfigError(
                f"TopK ids and weights must both be [M, k] with the same shape "
                f"(got ids {tuple(self.ids.shape)}, weights {tuple(self.weights.shape)})"
            )
        if self.ids.dtype != torch.int32 or self.weights.dtype != torch.float32:
            raise MoEConfigError(
                f"TopK ids must be torch.int32 and weights torch.float32 "
                f"(got ids {self.ids.dtype}, weights {self.weights.dtype})"
            )
        if self.ids.device != self.weights.device:
            raise MoEConfigError(
                f"TopK ids and weights must be on one device "
                f"(got {self.ids.device} and {self.weights.device})"
            )

    @property
    def num_tokens(self) -> int:
        """M."""
        return self.ids.shape[0]

    @property
    def top_k(self) -> int:
        """k."""
        return self.ids.shape[1]


# ----------------------------------------------------------------------------------------------
# Validation shared by the functions and Router.


def _check_logits(logits: object, num_experts: int | None = None) -> None:
    if not isinstance(logits, torch.Tensor):
        raise MoEConfigError(f"router_logits must be a torch.Tensor (got {type(logits).__name__})")
    if logits.dim() != 2:
        raise MoEConfigError(f"router_logits must be 2-D [M, E] (got shape {tuple(logits.shape)})")
    if not logits.is_floating_point():
        raise MoEConfigError(f"router_logits must be floating point (got {logits.dtype})")
    if num_experts is not None and logits.shape[1] != num_experts:
        raise MoEConfigError(
            f"router_logits last dimension must equal num_experts={num_experts} "
            f"(got shape {tuple(logits.shape)})"
        )


def _check_top_k(top_k: object, num_experts: int) -> None:
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise MoEConfigError(f"top_k must be an int >= 1 (got {top_k!r})")
    if top_k > num_experts:
        raise MoEConfigError(f"top_k must be <= num_experts (got top_k={top_k}, num_experts={num_experts})")


def _check_groups(num_experts: int, top_k: int, n_group: int | None, topk_group: int | None) -> None:
    """The DeepSeek-V3 group constraints; ``n_group=None`` (one group) needs ``topk_group=None``."""
    if n_group is None:
        if topk_group is not None:
            raise MoEConfigError(
                f"topk_group={topk_group!r} needs n_group; pass both or neither (None: one group)"
            )
        return
    for name, value in (("n_group", n_group), ("topk_group", topk_group)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise MoEConfigError(f"{name} must be an int >= 1 when n_group is given (got {value!r})")
    if num_experts % n_group:
        raise MoEConfigError(
            f"n_group must divide num_experts (got n_group={n_group}, num_experts={num_experts})"
        )
    if topk_group > n_group:
        raise MoEConfigError(
            f"topk_group must be <= n_group (got topk_group={topk_group}, n_group={n_group})"
        )
    group_size = num_experts // n_group
    if group_size < 2:
        raise MoEConfigError(
            f"n_group={n_group} leaves groups of {group_size} expert(s) (num_experts={num_experts}); "
            "a group is scored by its top-2 experts, so each needs >= 2; use a smaller n_group"
        )
    if top_k > topk_group * group_size:
        raise MoEConfigError(
            f"top_k={top_k} exceeds the experts of the kept groups: topk_group * num_experts/n_group = "
            f"{topk_group} * {group_size} = {topk_group * group_size}; raise topk_group or lower top_k"
        )


def _check_correction_bias(bias: object, num_experts: int) -> None:
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
        raise MoEConfigError(
            f"correction_bias must be a floating-point tensor [E] "
            f"(got {bias.dtype if isinstance(bias, torch.Tensor) else type(bias).__name__})"
        )
    if tuple(bias.shape) != (num_experts,):
        raise MoEConfigError(
            f"correction_bias must have shape [num_experts] = ({num_experts},) (got {tuple(bias.shape)})"
        )


def _check_renormalize(renormalize: object) -> None:
    if not isinstance(renormalize, bool):
        raise MoEConfigError(f"renormalize must be a bool (got {renormalize!r})")


# ----------------------------------------------------------------------------------------------
# The three routings (pure functions; the reference every fused router is tested against).


def _top_k_descending(values: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row and their indices, ties towards the lower index."""
    sorted_values, indices = torch.sort(values, dim=-1, descending=True, stable=True)
    return sorted_values[:, :top_k], indices[:, :top_k]


def _renormalized(weights: torch.Tensor) -> torch.Tensor:
    return weights / weights.sum(dim=-1, keepdim=True).clamp_min(_MIN_WEIGHT_SUM)


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool = True) -> TopK:
    """Softmax over E (float32), then the k largest; ``renormalize`` makes each row sum to 1."""
    _check_logits(logits)
    _check_top_k(top_k, logits.shape[1])
    _check_renormalize(renormalize)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = _top_k_descending(probs, top_k)
    if renormalize:
        weights = _renormalized(weights)
    return TopK(ids.to(torch.int32), weights)


def gpt_oss_topk(logits: torch.Tensor, top_k: int) -> TopK:
    """The k largest raw logits, then a softmax over those k (each row sums to 1)."""
    _check_logits(logits)
    _check_top_k(top_k, logits.shape[1])
    values, ids = _top_k_descending(logits.float(), top_k)
    return TopK(ids.to(torch.int32), torch.softmax(values, dim=-1))


def deepseek_v3_topk(
    logits: torch.Tensor,
    top_k: int,
    *,
    n_group: int | None,
    topk_group: int | None,
    correction_bias: torch.Tensor | None = None,
    renormalize: bool = True,
) -> TopK:
    """DeepSeek-V3's grouped, bias-corrected sigmoid routing (``noaux_tc``); see the module docstring.

    Experts outside the kept groups are masked with -inf (vLLM does the same; HF masks with 0.0,
    which can pick a masked expert when biased scores are negative).
    """
    _check_logits(logits)
    num_experts = logits.shape[1]
    _check_top_k(top_k, num_experts)
    _check_groups(num_experts, top_k, n_group, topk_group)
    _check_correction_bias(correction_bias, num_experts)
    _check_renormalize(renormalize)
    scores = torch.sigmoid(logits.float())
    biased = scores if correction_bias is None else scores + correction_bias.to(scores)
    if n_group is not None and topk_group < n_group:
        biased = _mask_to_best_groups(biased, n_group, topk_group)
    _, ids = _top_k_descending(biased, top_k)
    weights = scores.gather(1, ids)
    if renormalize:
        weights = _renormalized(weights)
    return TopK(ids.to(torch.int32), weights)


def _mask_to_best_groups(biased: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """``biased`` with every expert outside each row's ``topk_group`` best groups set to -inf."""
    num_tokens, num_experts = biased.shape
    grouped = biased.view(num_tokens, n_group, num_experts // n_group)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # a sum: the order of ties is moot
    _, kept_groups = _top_k_descending(group_scores, topk_group)
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), -math.inf).view(num_tokens, num_experts)


# ----------------------------------------------------------------------------------------------
# Router: one validated configuration of one routing.

# Options each routing reads besides num_experts/top_k/routed_scaling_factor.
_GROUP_OPTIONS = ("n_group", "topk_group", "correction_bias")


@dataclass(frozen=True)
class Router:
    """A routing with its options, validated once; ``router(logits [M, E]) -> TopK``.

    ``routed_scaling_factor`` multiplies the weights of every routing (DeepSeek-V3: 2.5). Options a
    routing would ignore are rejected rather than dropped: ``n_group``, ``topk_group`` and
    ``correction_bias`` belong to ``deepseek_v3`` only, and ``gpt_oss`` always normalizes, so it
    takes no ``renormalize=False``. ``correction_bias`` is a weight, not configuration: it takes no
    part in equality or repr.

    >>> router = Router("softmax", num_experts=8, top_k=2)
    >>> router(torch.zeros(3, 8)).ids.tolist()
    [[0, 1], [0, 1], [0, 1]]
    """

    routing: str  # one of ROUTING_NAMES
    num_experts: int  # E
    top_k: int  # k
    renormalize: bool = True  # softmax, deepseek_v3: make the k weights sum to 1
    n_group: int | None = None  # deepseek_v3: groups of experts (None: one group)
    topk_group: int | None = None  # deepseek_v3: groups kept per token
    correction_bias: torch.Tensor | None = field(default=None, compare=False, repr=False)  # [E]
    routed_scaling_factor: float = 1.0  # multiplies every weight

    def __post_init__(self):
        if self.routing not in ROUTING_NAMES:
            raise MoEConfigError(f"routing must be one of {ROUTING_NAMES} (got {self.routing!r})")
        if (
            isinstance(self.num_experts, bool)
            or not isinstance(self.num_experts, int)
            or self.num_experts < 1
        ):
            raise MoEConfigError(f"num_experts must be an int >= 1 (got {self.num_experts!r})")
        _check_top_k(self.top_k, self.num_experts)
        _check_renormalize(self.renormalize)
        factor = self.routed_scaling_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor < math.inf:
            raise MoEConfigError(f"routed_scaling_factor must be a finite number > 0 (got {factor!r})")
        if self.routing == "deepseek_v3":
            _check_groups(self.num_experts, self.top_k, self.n_group, self.topk_group)
            _check_correction_bias(self.correction_bias, self.num_experts)
            # once, here: a NaN bias would pick arbitrary experts; the per-call check cannot read values
            if self.correction_bias is not None and not bool(torch.isfinite(self.correction_bias).all()):
                raise MoEConfigError("correction_bias contains NaN or inf; every expert's bias must be finite")
            return
        for name in _GROUP_OPTIONS:
            if getattr(self, name) is not None:
                raise MoEConfigError(
                    f"{name} is a deepseek_v3 option; routing={self.routing!r} would ignore it "
                    f"(got {name}={'<tensor>' if name == 'correction_bias' else getattr(self, name)!r})"
                )
        if self.routing == "gpt_oss" and not self.renormalize:
            raise MoEConfigError(
                "renormalize=False is not available for routing='gpt_oss': its weights are a softmax "
                "over the k chosen logits and always sum to 1; leave renormalize at True"
            )

    def __call__(self, router_logits: torch.Tensor) -> TopK:
        """Routes ``router_logits [M, E]`` (any float dtype) to a `TopK` on the same device."""
        _check_logits(router_logits, self.num_experts)
        if self.routing == "softmax":
            topk = softmax_topk(router_logits, self.top_k, self.renormalize)
        elif self.routing == "gpt_oss":
            topk = gpt_oss_topk(router_logits, self.top_k)
        else:
            topk = deepseek_v3_topk(
                router_logits,
                self.top_k,
                n_group=self.n_group,
                topk_group=self.topk_group,
                correction_bias=self.correction_bias,
                renormalize=self.renormalize,
            )
        if self.routed_scaling_factor == 1.0:
            return topk
        return TopK(topk.ids, topk.weights * self.routed_scaling_factor)
