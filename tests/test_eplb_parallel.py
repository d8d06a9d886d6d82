"""Redundant experts (EPLB) over gloo on CPU, 2 and 4 processes: a `FusedMoE` with replicas serves skewed
routing equal to the unsharded layer before, during (old placement) and after ``rebalance``; its
counters hold exactly the routed (token, slot) pairs; the rebalance lowers max/mean tokens per rank;
quantized weights with scales, global scales and biases arrive bit for bit.

Each group size is started once (a module fixture, see tests/test_all_to_all.py for why) and every
rank returns what it measured; the tests judge it here.
"""

from __future__ import annotations

import pytest
import torch

from moe import FusedMoE, ParallelConfig
from moe.eplb import Placement
from moe.eplb_transfer import gather_slots
from moe.errors import MoEConfigError
from moe.quant import QuantFormat
from moe.testing import TOLERANCES, relative_error
from moe.tools.ep_demo import launch_ranks
from moe.testing.cases import SIZES
from moe.weights import ExpertWeights

TIMEOUT_S = 120
E, K, H, I = 8, 2, 32, 16
BATCHES, TOKENS = 3, 24
HOT = (1, 3)


def _layers(rank: int, world: int, quant: str, dtype: torch.dtype, hidden: int, inter: int, bias: bool):
    """(EPLB layer on this rank, unsharded reference layer, full dense weights), the same on every rank."""
    gen = torch.Generator().manual_seed(0)
    dense = {"w13": torch.randn(E, 2 * inter, hidden, generator=gen) / 8,
             "w2": torch.randn(E, hidden, inter, generator=gen) / 8}
    if bias:
        dense |= {"b13": torch.randn(E, 2 * inter, generator=gen) / 8, "b2": torch.randn(E, hidden, generator=gen) / 8}
    options = dict(dtype=dtype, quant=quant, experts="reference", has_bias=bias, max_tokens=64)
    reference = FusedMoE(E, K, hidden, inter, **options)
    reference.load_weights(**dense)
    layer = FusedMoE(E, K, hidden, inter, parallel=ParallelConfig(world, rank, num_redundant_experts=world),
                     **options)
    layer.load_weights(**dense)
    return layer, reference, dense


def _skewed_batches(rank: int, hidden: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Logits favouring experts 1 and 3 (HOT), which the initial placement does not replicate: most slots
    go to their one rank (rank 0 of 2; ranks 0 and 1 of 4)."""
    gen = torch.Generator().manual_seed(100 + rank)
    batches = []
    for _ in range(BATCHES):
        logits = torch.randn(TOKENS, E, generator=gen)
        logits[:, list(HOT)] += 3.0
        batches.append((torch.randn(TOKENS, hidden, generator=gen).to(dtype), logits))
    return batches


def _errors(layer: FusedMoE, reference: FusedMoE, batches) -> float:
    """The largest relative error of the layer against the reference over ``batches`` (forwards are
    collective: every rank runs the same number)."""
    return max(relative_error(layer(x, logits), reference(x, logits)) for x, logits in batches)


def _tokens_per_rank(layer: FusedMoE, batches, world: int) -> list[int]:
    """Slots this rank sends to each rank under the layer's current placement."""
    balancer, total = layer.balancer, torch.zeros(world, dtype=torch.int64)
    for _, logits in batches:
        physical = balancer.to_physical(layer.router(logits)).ids.long()
        total += torch.bincount(balancer.physical_rank[physical].flatten(), minlength=world)
    return total.tolist()


def _balance_case(rank: int, world: int) -> dict:
    layer, reference, _ = _layers(rank, world, "fp32", torch.float32, H, I, bias=False)
    batches = _skewed_batches(rank, H, torch.float32)
    before_error = _errors(layer, reference, batches)  # also counts every batch once
    routed = torch.cat([layer.router(logits).ids.flatten().long() for _, logits in batches])
    counters = layer.balancer.tokens_per_expert.tolist()
    old, per_rank_before = layer.balancer.placement, _tokens_per_rank(layer, batches, world)
    pending = layer.begin_rebalance()
    reset = layer.balancer.tokens_per_expert.tolist()
    during_error = _errors(layer, reference, batches)
    still_old = layer.balancer.placement == old and layer.weights is not pending.weights
    new = layer.finish_rebalance(pending)
    after_error = _errors(layer, reference, batches)
    # model code that routes itself hands in logical ids: counted, then sent to replicas like the router's
    counted = layer.balancer.tokens_per_expert.sum().item()
    routed_by_caller = [(x, layer.router(logits)) for x, logits in batches]
    topk_error = max(relative_error(layer(x, topk_ids=t.ids.long(), topk_weights=t.weights), reference(x, logits))
                     for (x, t), (_, logits) in zip(routed_by_caller, batches))
    topk_counted = layer.balancer.tokens_per_expert.sum().item() - counted
    return {"topk_error": topk_error, "topk_counted": topk_counted, "slots": sum(t.ids.numel() for _, t in routed_by_caller),"counters": counters, "expected": torch.bincount(routed, minlength=E).tolist(), "reset": reset,
            "loads": list(pending.loads), "errors": (before_error, during_error, after_error),
            "still_old": still_old, "swapped": layer.balancer.placement == new != old,
            "per_rank": (per_rank_before, _tokens_per_rank(layer, batches, world)), "moves": pending.moves,
            "local": layer.balancer.local_experts()}


def _quantized_case(rank: int, world: int) -> dict:
    """nvfp4 weights with biases: data, block scales, per-expert global scales and biases all move."""
    hidden, inter = SIZES[QuantFormat.NVFP4]
    layer, reference, dense = _layers(rank, world, "nvfp4", torch.bfloat16, hidden, inter, bias=True)
    batches = _skewed_batches(rank, hidden, torch.bfloat16)
    _errors(layer, reference, batches)
    layer.rebalance()
    error = _errors(layer, reference, batches)
    full = ExpertWeights.from_dense(**dense, quant=layer.problem.quant, dtype=layer.problem.dtype)
    want, got = gather_slots(full, layer.balancer.local_experts()), layer.weights
    same = [torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)) for a, b in (
        (got.w13.data, want.w13.data), (got.w13.scale, want.w13.scale), (got.w2.global_scale, want.w2.global_scale),
        (got.w2.data, want.w2.data), (got.w2.scale, want.w2.scale), (got.b13, want.b13), (got.b2, want.b2))]
    return {"same": same, "error": error, "moved": layer.balancer.placement != Placement.initial(E, world, world)}


def _bad_input_case(rank: int, world: int) -> dict:
    layer = FusedMoE(E, K, H, I, dtype=torch.float32, quant="fp32", experts="reference",
                     parallel=ParallelConfig(world, rank, num_redundant_experts=world))
    errors = {}
    try:
        layer.rebalance()
    except MoEConfigError as error:
        errors["unloaded"] = str(error)
    local = layer.problem.local_num_experts
    try:
        layer.load_weights(w13=torch.randn(local, 2 * I, H), w2=torch.randn(local, H, I))
    except MoEConfigError as error:
        errors["rank_local"] = str(error)
    return errors


def _run(rank: int, world: int) -> dict:
    return {"balance": _balance_case(rank, world), "quantized": _quantized_case(rank, world),
            "bad": _bad_input_case(rank, world)}


@pytest.fixture(scope="module", params=[2, 4], ids=["ep2", "ep4"])
def group(request):
    return request.param, launch_ranks(_run, request.param, timeout_s=TIMEOUT_S)


def test_serves_like_the_unsharded_layer_before_during_and_after(group):
    _, ranks = group
    bound = TOLERANCES["fp32"]
    for rank, result in enumerate(ranks):
        case = result["balance"]
        assert all(error <= bound for error in case["errors"]), f"rank {rank}: {case['errors']} > {bound}"
        assert case["still_old"] and case["swapped"], f"rank {rank}: the placement changed at the wrong step"
        assert case["topk_error"] <= bound, f"rank {rank}: precomputed routing {case['topk_error']} > {bound}"
        assert case["topk_counted"] == case["slots"], f"rank {rank}: precomputed routing not counted"


def test_counters_hold_the_routed_slots_and_reset(group):
    _, ranks = group
    for rank, result in enumerate(ranks):
        case = result["balance"]
        assert case["counters"] == case["expected"] and sum(case["counters"]) == BATCHES * TOKENS * K
        assert case["reset"] == [0] * E
    total = [sum(r["balance"]["expected"][e] for r in ranks) for e in range(E)]
    assert all(r["balance"]["loads"] == total for r in ranks)  # every rank planned from the same sums


def test_rebalance_lowers_max_over_mean_tokens_per_rank(group):
    world, ranks = group
    before, after = ([sum(r["balance"]["per_rank"][i][d] for r in ranks) for d in range(world)] for i in (0, 1))
    assert sum(before) == sum(after) == world * BATCHES * TOKENS * K
    ratio_before, ratio_after = (max(c) * world / sum(c) for c in (before, after))
    assert ratio_after < ratio_before, (before, after)
    assert ranks[0]["balance"]["moves"] > 0
    replicas = [sum(r["balance"]["local"].count(e) for r in ranks) for e in range(E)]
    assert all(replicas[e] >= 2 for e in HOT) and sum(replicas) == E + world, replicas


def test_quantized_weights_with_scales_and_biases_move_bit_for_bit(group):
    _, ranks = group
    bound = 2 * TOLERANCES["fp4"]  # nvfp4 activations take one scale per received batch (see test_all_to_all)
    for rank, result in enumerate(ranks):
        case = result["quantized"]
        assert case["moved"] and all(case["same"]), f"rank {rank}: {case['same']}"
        assert case["error"] <= bound, f"rank {rank}: {case['error']}"


def test_bad_input_is_named(group):
    _, ranks = group
    for result in ranks:
        bad = result["bad"]
        assert "rebalance needs a loaded layer" in bad["unloaded"] and "weights not loaded" in bad["unloaded"]
        assert "loads the full weights of all E=8 logical experts" in bad["rank_local"]
