"""The ``@triton.jit`` routing kernel behind `moe.routing.fused` (imported at the first launch).

One program routes BLOCK_M rows held in registers as a ``[BLOCK_M, BLOCK_E]`` tile: score, bias,
group mask, then k rounds of "largest available value, lowest index among equals", then the
weights' normalization and scale, stored once.
"""

import triton
import triton.language as tl

from moe.experts._triton._lang import gdc_launch_dependents, max_, min_, pdl_supported, sum_  # noqa: F401


@triton.jit
def _log1p(y):
    # log(1 + y) accurate for tiny y (Goldberg): log(u) * y / (u - 1) with u = 1 + y rounded
    u = 1.0 + y
    return tl.where(u == 1.0, y, tl.log(u) * (y / tl.where(u == 1.0, 1.0, u - 1.0)))


@triton.jit
def _score(x, valid, SCORE: tl.constexpr):
    """The score function (0 softmax, 1 sigmoid, 2 sqrtsoftplus) of a tile; ``valid`` masks the padding."""
    if SCORE == 0:
        shifted = tl.where(valid, x - max_(tl.where(valid, x, -float("inf")), 1)[:, None], -float("inf"))
        e = tl.where(valid, tl.exp(shifted), 0.0)
        total = sum_(e, 1)
        return e / tl.where(total > 0.0, total, 1.0)[:, None]  # padding rows: 0, not 0/0
    elif SCORE == 1:
        return 1.0 / (1.0 + tl.exp(-x))
    else:
        # torch's softplus: linear above 20
        return tl.sqrt(tl.where(x > 20.0, x, _log1p(tl.exp(tl.minimum(x, 20.0)))))


@triton.jit
def _best(values, available, cols, BLOCK_E: tl.constexpr):
    """Per row: the largest available value and its lowest column among equals ([BLOCK_M] each)."""
    masked = tl.where(available, values, -float("inf"))
    top = max_(masked, 1)
    index = min_(tl.where(available & (masked == top[:, None]), cols[None, :], BLOCK_E), 1)
    return top, index


@triton.jit
def _keep_best_groups(choice, valid, cols, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                      GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr):
    """``valid`` narrowed to the TOPK_GROUP best groups of each row (a group: sum of its top two)."""
    group_of = cols // GROUP_SIZE
    gcols = tl.arange(0, BLOCK_G)
    group_scores = tl.full([BLOCK_M, BLOCK_G], -float("inf"), tl.float32)
    for g in tl.static_range(N_GROUP):
        in_group = valid & (group_of[None, :] == g)
        first, at = _best(choice, in_group, cols, BLOCK_E)
        second, _ = _best(choice, in_group & (cols[None, :] != at[:, None]), cols, BLOCK_E)
        group_scores = tl.where(gcols[None, :] == g, (first + second)[:, None], group_scores)
    keep = tl.zeros([BLOCK_M, BLOCK_E], tl.int32) != 0
    group_available = gcols[None, :] < N_GROUP
    for _ in tl.static_range(TOPK_GROUP):
        _, group = _best(group_scores, group_available, gcols, BLOCK_G)
        group_available = group_available & (gcols[None, :] != group[:, None])
        keep = keep | (group_of[None, :] == group[:, None])
    return valid & keep


@triton.jit
def route_kernel(
    logits_ptr, stride_m, bias_ptr, ids_ptr, weights_ptr, M, E, scale,
    K: tl.constexpr, SCORE: tl.constexpr, ON_LOGITS: tl.constexpr, HAS_BIAS: tl.constexpr,
    N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, RENORMALIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr = False,
):
    """ids [M, K] int32 and weights [M, K] float32 of logits [M, E] (row stride ``stride_m``);
    ``LAUNCH_DEPENDENTS``: a kernel launched after this one as a programmatic dependent launch may start now
    (it waits for this grid to end before it reads the routing)."""
    if LAUNCH_DEPENDENTS:
        gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_E)
    valid = (rows[:, None] < M) & (cols[None, :] < E)
    x = tl.load(logits_ptr + rows[:, None] * stride_m + cols[None, :], mask=valid, other=0.0).to(tl.float32)
    if ON_LOGITS:  # choose on the raw logits; the score applies to the k chosen ones below
        scores = x
        choice = x
    else:
        scores = _score(x, valid, SCORE)
        choice = scores
        if HAS_BIAS:
            choice = scores + tl.load(bias_ptr + cols, mask=cols < E, other=0.0).to(tl.float32)[None, :]
        if N_GROUP > 1 and TOPK_GROUP < N_GROUP:
            valid = _keep_best_groups(
                choice, valid, cols, N_GROUP, TOPK_GROUP, GROUP_SIZE, BLOCK_M, BLOCK_E, BLOCK_G
            )
    kcols = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_M, BLOCK_K], tl.int32)
    weights = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
    for j in tl.static_range(K):
        top, best = _best(choice, valid, cols, BLOCK_E)
        hit = cols[None, :] == best[:, None]
        if HAS_BIAS:  # chosen on scores + bias, weighted by the score: one more pass to pick it out
            weight = sum_(tl.where(hit, scores, 0.0), 1)
        else:  # chosen on the weights themselves: the best value is the weight
            weight = top
        ids = tl.where(kcols[None, :] == j, best[:, None], ids)
        weights = tl.where(kcols[None, :] == j, weight[:, None], weights)
        valid = valid & ~hit
    weights = _weights_of_chosen(weights, kcols < K, SCORE, ON_LOGITS, RENORMALIZE)
    out = rows[:, None] * K + kcols[None, :]
    stored = (rows[:, None] < M) & (kcols[None, :] < K)
    tl.store(ids_ptr + out, ids, mask=stored)
    tl.store(weights_ptr + out, weights * scale, mask=stored)


@triton.jit
def _weights_of_chosen(weights, slot, SCORE: tl.constexpr, ON_LOGITS: tl.constexpr, RENORMALIZE: tl.constexpr):
    """The k chosen values [BLOCK_M, BLOCK_K] turned into weights (``slot`` masks the padding)."""
    if ON_LOGITS:
        weights = _score(weights, slot[None, :], SCORE)
    if RENORMALIZE:
        total = sum_(tl.where(slot[None, :], weights, 0.0), 1)
        weights = weights / tl.maximum(total, 1e-20)[:, None]
    return weights
