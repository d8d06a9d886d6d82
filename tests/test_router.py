"""Routers against hand-worked examples, plus properties on random logits and every validation error.

sigmoid(x) below is 1 / (1 + e^-x); sigmoid(0) = 0.5 exactly.
"""

from __future__ import annotations

import math

import pytest
import torch

from moe.errors import MoEConfigError
from moe.router import (
    ROUTING_NAMES,
    Router,
    TopK,
    deepseek_v3_topk,
    gpt_oss_topk,
    softmax_topk,
)

E1 = math.e


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def assert_topk(topk: TopK, ids, weights) -> None:
    assert topk.ids.dtype == torch.int32 and topk.weights.dtype == torch.float32
    assert topk.ids.tolist() == ids
    torch.testing.assert_close(topk.weights, torch.tensor(weights, dtype=torch.float32), rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------------------------
# softmax


def test_softmax_renormalized():
    logits = torch.tensor([[2.0, 1.0, 0.0, 0.0], [0.0, 0.0, 3.0, 0.0]])
    e3 = math.exp(3)
    # row 1: experts 0, 1 and 3 tie at 0.0; the lower id (0) takes the second slot.
    assert_topk(
        softmax_topk(logits, 2),
        [[0, 1], [2, 0]],
        [[E1 / (E1 + 1), 1 / (E1 + 1)], [e3 / (e3 + 1), 1 / (e3 + 1)]],
    )


def test_softmax_not_renormalized():
    logits = torch.tensor([[2.0, 1.0, 0.0, 0.0]])
    total = math.exp(2) + E1 + 2
    assert_topk(softmax_topk(logits, 2, renormalize=False), [[0, 1]], [[math.exp(2) / total, E1 / total]])


def test_softmax_all_tied_takes_lowest_ids():
    assert_topk(softmax_topk(torch.zeros(2, 8), 3), [[0, 1, 2]] * 2, [[1 / 3] * 3] * 2)
    assert_topk(softmax_topk(torch.zeros(1, 8), 3, renormalize=False), [[0, 1, 2]], [[1 / 8] * 3])


def test_softmax_ties_in_the_middle():
    logits = torch.tensor([[1.0, 5.0, 1.0, 5.0, 1.0]])
    assert Router("softmax", 5, 4)(logits).ids.tolist() == [[1, 3, 0, 2]]


def test_softmax_in_float32_from_bf16():
    logits = torch.tensor([[2.0, 1.0, 0.0, 0.0]], dtype=torch.bfloat16)
    assert_topk(softmax_topk(logits, 2), [[0, 1]], [[E1 / (E1 + 1), 1 / (E1 + 1)]])


# ----------------------------------------------------------------------------------------------
# gpt_oss


def test_gpt_oss_softmax_over_the_k():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    assert_topk(gpt_oss_topk(logits, 2), [[1, 2]], [[E1 / (E1 + 1), 1 / (E1 + 1)]])


def test_gpt_oss_ties_and_top1():
    logits = torch.tensor([[5.0, 1.0, 5.0, 5.0]])
    assert_topk(gpt_oss_topk(logits, 2), [[0, 2]], [[0.5, 0.5]])
    assert_topk(gpt_oss_topk(logits, 1), [[0]], [[1.0]])


# ----------------------------------------------------------------------------------------------
# deepseek_v3

# E=8 in 4 groups of 2. Group scores (sum of the two sigmoid scores):
#   g0 [3, -3]   -> s(3) + s(-3) = 1.0       holds the single best expert, 0 (s(3) = 0.953)
#   g1 [2, 1]    -> s(2) + s(1)  = 1.612     best group
#   g2 [.5, .5]  -> 2 s(0.5)     = 1.245     second group
#   g3 [0, 0]    -> 1.0
# A plain top-2 would pick experts 0 and 2; keeping the 2 best groups picks 2 and 3.
GROUPED_LOGITS = torch.tensor([[3.0, -3.0, 2.0, 1.0, 0.5, 0.5, 0.0, 0.0]])


def test_deepseek_group_choice_differs_from_plain_topk():
    plain = Router("deepseek_v3", 8, 2)(GROUPED_LOGITS)
    assert plain.ids.tolist() == [[0, 2]]
    s2, s1 = sigmoid(2), sigmoid(1)
    grouped = deepseek_v3_topk(GROUPED_LOGITS, 2, n_group=4, topk_group=2)
    assert_topk(grouped, [[2, 3]], [[s2 / (s2 + s1), s1 / (s2 + s1)]])
    raw = deepseek_v3_topk(GROUPED_LOGITS, 2, n_group=4, topk_group=2, renormalize=False)
    assert_topk(raw, [[2, 3]], [[s2, s1]])


def test_deepseek_tie_within_kept_groups_takes_lower_expert():
    topk = deepseek_v3_topk(GROUPED_LOGITS, 3, n_group=4, topk_group=2, renormalize=False)
    assert_topk(topk, [[2, 3, 4]], [[sigmoid(2), sigmoid(1), sigmoid(0.5)]])


def test_deepseek_tied_groups_take_lower_group():
    # g0 = [1, 0] and g1 = [0, 1] have exactly the same score; g0 wins. Were g1 kept instead the
    # answer would be [3, 2]; a plain top-2 would give [0, 3].
    logits = torch.tensor([[1.0, 0.0, 0.0, 1.0, -1.0, -1.0, -2.0, -2.0]])
    s1 = sigmoid(1)
    topk = deepseek_v3_topk(logits, 2, n_group=4, topk_group=1)
    assert_topk(topk, [[0, 1]], [[s1 / (s1 + 0.5), 0.5 / (s1 + 0.5)]])


def test_deepseek_bias_changes_selection_not_weights():
    logits = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    bias = torch.tensor([0.0, 0.0, 2.0, 0.0])
    # biased: [s(1), .5, 2.5, .5] -> expert 2 first; its weight is the unbiased s(0) = 0.5.
    topk = deepseek_v3_topk(logits, 2, n_group=None, topk_group=None, correction_bias=bias, renormalize=False)
    assert_topk(topk, [[2, 0]], [[0.5, sigmoid(1)]])
    unbiased = deepseek_v3_topk(logits, 2, n_group=None, topk_group=None, renormalize=False)
    assert_topk(unbiased, [[0, 1]], [[sigmoid(1), 0.5]])


def test_deepseek_bias_changes_group_choice():
    # g0 = [1, 1] scores 2 s(1) = 1.46; g1 = [0, 0] + bias [0, 1] scores 0.5 + 1.5 = 2.0 -> g1 kept.
    logits = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 1.0])
    router = Router("deepseek_v3", 4, 1, n_group=2, topk_group=1, correction_bias=bias, renormalize=False)
    assert_topk(router(logits), [[3]], [[0.5]])


def test_deepseek_bias_of_lower_precision_and_bf16_logits():
    logits = torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.bfloat16)
    bias = torch.tensor([0.0, 0.0, 2.0, 0.0], dtype=torch.bfloat16)
    router = Router("deepseek_v3", 4, 1, correction_bias=bias, renormalize=False)
    assert_topk(router(logits), [[2]], [[0.5]])


def test_deepseek_routed_scaling_factor():
    router = Router("deepseek_v3", 8, 2, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    s2, s1 = sigmoid(2), sigmoid(1)
    assert_topk(router(GROUPED_LOGITS), [[2, 3]], [[2.5 * s2 / (s2 + s1), 2.5 * s1 / (s2 + s1)]])


def test_deepseek_one_group_is_plain_topk():
    one = Router("deepseek_v3", 8, 2, n_group=1, topk_group=1)(GROUPED_LOGITS)
    none = Router("deepseek_v3", 8, 2)(GROUPED_LOGITS)
    assert one.ids.tolist() == none.ids.tolist() == [[0, 2]]
    torch.testing.assert_close(one.weights, none.weights)


# ----------------------------------------------------------------------------------------------
# Router: scaling, zero tokens, equality


def test_routed_scaling_factor_applies_to_every_routing():
    logits = torch.tensor([[2.0, 1.0, 0.0, 0.0]])
    softmax = Router("softmax", 4, 2, routed_scaling_factor=2.0)(logits)
    assert_topk(softmax, [[0, 1]], [[2 * E1 / (E1 + 1), 2 / (E1 + 1)]])
    gpt_oss = Router("gpt_oss", 4, 2, routed_scaling_factor=3.0)(logits)
    assert_topk(gpt_oss, [[0, 1]], [[3 * E1 / (E1 + 1), 3 / (E1 + 1)]])


@pytest.mark.parametrize(
    "router",
    [
        Router("softmax", 8, 2),
        Router("gpt_oss", 8, 3),
        Router("deepseek_v3", 8, 4, n_group=4, topk_group=2, correction_bias=torch.zeros(8)),
    ],
    ids=lambda r: r.routing,
)
def test_zero_tokens(router):
    topk = router(torch.empty(0, 8, dtype=torch.bfloat16))
    assert topk.ids.shape == topk.weights.shape == (0, router.top_k)
    assert (topk.num_tokens, topk.top_k) == (0, router.top_k)
    assert topk.ids.dtype == torch.int32 and topk.weights.dtype == torch.float32


def test_router_equality_and_repr_round_trip():
    router = Router("deepseek_v3", 8, 2, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    assert eval(repr(router), {"Router": Router}) == router
    # correction_bias is a weight: not compared, not shown.
    assert Router("deepseek_v3", 4, 1, correction_bias=torch.ones(4)) == Router("deepseek_v3", 4, 1)
    assert "correction_bias" not in repr(Router("deepseek_v3", 4, 1, correction_bias=torch.ones(4)))


def test_topk_properties_and_validation():
    topk = TopK(torch.zeros(3, 2, dtype=torch.int32), torch.ones(3, 2))
    assert (topk.num_tokens, topk.top_k) == (3, 2)
    with pytest.raises(MoEConfigError, match="ids and weights"):
        TopK(torch.zeros(3, 2, dtype=torch.int32), torch.ones(3, 1))
    with pytest.raises(MoEConfigError, match="ids must be torch.int32"):
        TopK(torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2))
    with pytest.raises(MoEConfigError, match="weights torch.float32"):
        TopK(torch.zeros(3, 2, dtype=torch.int32), torch.ones(3, 2, dtype=torch.bfloat16))
    with pytest.raises(MoEConfigError, match=r"\[M, k\]"):
        TopK(torch.zeros(3, dtype=torch.int32), torch.ones(3))


# ----------------------------------------------------------------------------------------------
# Properties on random logits


@pytest.mark.parametrize("seed", range(4))
def test_softmax_renormalized_rows_sum_to_one(seed):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(33, 16, generator=generator) * 3
    topk = Router("softmax", 16, 4)(logits)
    torch.testing.assert_close(topk.weights.sum(-1), torch.ones(33))
    assert bool((topk.weights[:, :-1] >= topk.weights[:, 1:]).all())  # best first
    assert all(len(set(row)) == 4 for row in topk.ids.tolist())


@pytest.mark.parametrize("seed", range(4))
def test_gpt_oss_rows_sum_to_one(seed):
    logits = torch.randn(17, 32, generator=torch.Generator().manual_seed(seed))
    topk = Router("gpt_oss", 32, 4)(logits)
    torch.testing.assert_close(topk.weights.sum(-1), torch.ones(17))
    assert topk.ids.tolist() == torch.topk(logits, 4).indices.tolist()  # no ties in random data


def _kept_groups(biased_row: list[float], n_group: int, topk_group: int) -> set[int]:
    """Independent re-derivation: groups ranked by (top-2 sum descending, group index ascending)."""
    size = len(biased_row) // n_group
    scores = [sum(sorted(biased_row[g * size : (g + 1) * size], reverse=True)[:2]) for g in range(n_group)]
    return set(sorted(range(n_group), key=lambda g: (-scores[g], g))[:topk_group])


@pytest.mark.parametrize("seed", range(4))
def test_deepseek_ids_lie_in_the_kept_groups(seed):
    generator = torch.Generator().manual_seed(seed)
    n_group, topk_group, num_experts, top_k = 8, 3, 64, 6
    logits = torch.randn(25, num_experts, generator=generator)
    bias = torch.randn(num_experts, generator=generator) * 0.1
    topk = Router(
        "deepseek_v3", num_experts, top_k, n_group=n_group, topk_group=topk_group, correction_bias=bias
    )(logits)
    biased = (torch.sigmoid(logits) + bias).tolist()
    group_size = num_experts // n_group
    for row_ids, row_biased in zip(topk.ids.tolist(), biased):
        kept = _kept_groups(row_biased, n_group, topk_group)
        assert {e // group_size for e in row_ids} <= kept
        assert len(set(row_ids)) == top_k
    unbiased = torch.sigmoid(logits).gather(1, topk.ids.long())
    torch.testing.assert_close(topk.weights, unbiased / unbiased.sum(-1, keepdim=True))


# ----------------------------------------------------------------------------------------------
# Validation: every error names its argument


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        (dict(routing="topk", num_experts=8, top_k=2), "routing must be one of"),
        (dict(routing="softmax", num_experts=0, top_k=1), "num_experts"),
        (dict(routing="softmax", num_experts=8, top_k=9), "top_k must be <= num_experts"),
        (dict(routing="softmax", num_experts=8, top_k=0), "top_k must be an int >= 1"),
        (dict(routing="softmax", num_experts=8, top_k=2, renormalize=1), "renormalize"),
        (dict(routing="deepseek_v3", num_experts=8, top_k=2, n_group=3, topk_group=1), "n_group must divide"),
        (
            dict(routing="deepseek_v3", num_experts=8, top_k=2, n_group=2, topk_group=3),
            "topk_group must be <= n_group",
        ),
        (
            dict(routing="deepseek_v3", num_experts=8, top_k=2, n_group=8, topk_group=2),
            "n_group=8 leaves groups",
        ),
        (dict(routing="deepseek_v3", num_experts=8, top_k=4, n_group=4, topk_group=1), "top_k=4 exceeds"),
        (dict(routing="deepseek_v3", num_experts=8, top_k=2, topk_group=1), "topk_group=1 needs n_group"),
        (dict(routing="deepseek_v3", num_experts=8, top_k=2, n_group=4), "topk_group must be an int"),
        (
            dict(routing="deepseek_v3", num_experts=8, top_k=2, correction_bias=torch.zeros(4)),
            "correction_bias must have shape",
        ),
        (
            dict(
                routing="deepseek_v3",
                num_experts=8,
                top_k=2,
                correction_bias=torch.zeros(8, dtype=torch.int32),
            ),
            "correction_bias must be a floating",
        ),
        (dict(routing="softmax", num_experts=8, top_k=2, routed_scaling_factor=0.0), "routed_scaling_factor"),
        (
            dict(routing="softmax", num_experts=8, top_k=2, routed_scaling_factor=-1.0),
            "routed_scaling_factor",
        ),
        (
            dict(routing="softmax", num_experts=8, top_k=2, routed_scaling_factor=math.inf),
            "routed_scaling_factor",
        ),
        (
            dict(routing="softmax", num_experts=8, top_k=2, n_group=2, topk_group=1),
            "n_group is a deepseek_v3 option",
        ),
        (dict(routing="gpt_oss", num_experts=8, top_k=2, topk_group=1), "topk_group is a deepseek_v3 option"),
        (
            dict(routing="softmax", num_experts=8, top_k=2, correction_bias=torch.zeros(8)),
            "correction_bias is a deepseek_v3",
        ),
        (dict(routing="gpt_oss", num_experts=8, top_k=2, renormalize=False), "renormalize=False"),
    ],
)
def test_router_rejects(kwargs, argument):
    with pytest.raises(MoEConfigError, match=argument):
        Router(**kwargs)


def test_unknown_routing_lists_the_allowed():
    with pytest.raises(MoEConfigError) as error:
        Router("topk", 8, 2)
    assert all(name in str(error.value) for name in ROUTING_NAMES) and "'topk'" in str(error.value)


@pytest.mark.parametrize(
    "logits, message",
    [
        (torch.zeros(8), "router_logits must be 2-D"),
        (torch.zeros(2, 4), "router_logits last dimension must equal num_experts=8"),
        (torch.zeros(2, 8, dtype=torch.int64), "router_logits must be floating point"),
        ([[0.0] * 8], "router_logits must be a torch.Tensor"),
    ],
)
def test_router_call_rejects_bad_logits(logits, message):
    with pytest.raises(MoEConfigError, match=message):
        Router("softmax", 8, 2)(logits)


def test_functions_validate_too():
    logits = torch.zeros(2, 8)
    with pytest.raises(MoEConfigError, match="top_k must be <= num_experts"):
        softmax_topk(logits, 9)
    with pytest.raises(MoEConfigError, match="top_k must be an int"):
        gpt_oss_topk(logits, 0)
    with pytest.raises(MoEConfigError, match="router_logits must be 2-D"):
        gpt_oss_topk(torch.zeros(2, 2, 8), 2)
    with pytest.raises(MoEConfigError, match="correction_bias must have shape"):
        deepseek_v3_topk(logits, 2, n_group=None, topk_group=None, correction_bias=torch.zeros(7))
    with pytest.raises(MoEConfigError, match="n_group must divide"):
        deepseek_v3_topk(logits, 2, n_group=3, topk_group=1)
