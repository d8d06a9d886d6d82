"""Redundant experts (EPLB) in one process: the config's checks, the placement algorithm, the device
tables and counters (and that they never read the host), the transfer plan, and the oracle's view.
The multi-process layer (rebalance over gloo) is tests/test_eplb_parallel.py."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe import ExpertWeights, MoEProblem, ParallelConfig, Platform
from moe.eplb import ExpertLoadBalancer, Placement
from moe.eplb_transfer import gather_slots, transfer_plan
from moe.errors import MoEConfigError
from moe.oracle import plan
from moe.oracle.cost import roofline
from moe.router import TopK
from moe.sharding import shard_weights
from moe.tools.plan import add_plan_parser
from tests.helpers import make_problem


def _problem(num_experts=8, ep=2, redundant=4, rank=0, **kwargs) -> MoEProblem:
    parallel = ParallelConfig(ep, rank, num_redundant_experts=redundant)
    return dataclasses.replace(make_problem(num_experts=num_experts, **kwargs), parallel=parallel)


def _imbalance(per_rank: list[float]) -> float:
    return max(per_rank) / (sum(per_rank) / len(per_rank))


# --- the config --------------------------------------------------------------------------------
def test_physical_experts_are_counted_per_rank():
    problem = _problem(num_experts=8, ep=2, redundant=4, rank=1)
    assert problem.local_num_experts == 6
    assert problem.parallel.global_to_local(8) == [-1] * 6 + list(range(6))
    assert "E=8 (+4 redundant, 6 physical on this rank)" in problem.sizes
    physical = problem.physical()
    assert (physical.num_experts, physical.local_num_experts, physical.parallel.num_redundant_experts) == (12, 6, 0)
    assert physical.parallel.ep_rank == 1 and make_problem().physical() is not None


@pytest.mark.parametrize("kwargs,match", [
    ({"ep_size": 2, "num_redundant_experts": -1}, "num_redundant_experts must be an int >= 0 \\(got -1\\)"),
    ({"ep_size": 2, "num_redundant_experts": True}, "num_redundant_experts must be an int >= 0 \\(got True\\)"),
    ({"ep_size": 1, "num_redundant_experts": 2}, "needs expert parallelism \\(ep_size > 1\\)"),
    ({"ep_size": 2, "expert_map": (0, -1), "num_redundant_experts": 2}, "goes without expert_map"),
])
def test_bad_redundant_configs_are_named(kwargs, match):
    with pytest.raises(MoEConfigError, match=match):
        ParallelConfig(**kwargs)


@pytest.mark.parametrize("experts,ep,redundant,match", [
    (8, 4, 2, "8 \\+ 2 = 10 physical experts must be divisible by ep_size=4.*num_redundant_experts=4"),
    (4, 2, 6, "num_redundant_experts=6 exceeds num_experts x \\(ep_size - 1\\) = 4"),
])
def test_redundant_counts_are_checked_against_the_experts(experts, ep, redundant, match):
    with pytest.raises(MoEConfigError, match=match):
        _problem(num_experts=experts, ep=ep, redundant=redundant)


def test_shard_weights_points_to_the_placement():
    problem = _problem()
    full = ExpertWeights.from_dense(torch.randn(8, 2 * problem.intermediate_size, problem.hidden_size),
                                    torch.randn(8, problem.hidden_size, problem.intermediate_size))
    with pytest.raises(MoEConfigError, match="slots follow the EPLB placement"):
        shard_weights(full, problem)


# --- the placement -----------------------------------------------------------------------------
def test_initial_placement_keeps_the_contiguous_blocks_and_replicates_other_ranks_experts():
    placement = Placement.initial(8, 4, 2)
    assert placement.physical_to_logical == (0, 1, 2, 3, 4, 5, 4, 5, 6, 7, 0, 1)
    assert placement.replicas()[4] == [4, 6] and placement.replicas()[0] == [0, 10] and placement.replicas()[2] == [2]
    assert Placement((0, 1, 2, 3, 0, 1), 4, 2).replicas()[0] == [0, 4]  # the class docstring's example
    assert Placement.initial(6, 2, 4).slots_per_rank == 2  # E not divisible by ep: balanced equal loads


@pytest.mark.parametrize("slots,match", [((0, 1, 1, 1), "missing \\[2\\]"), ((0, 1, 2, 9), "got \\[9\\] extra"),
                                         ((0, 1, 2), "multiple of ep_size=2 slots")])
def test_placement_rejects_slots_that_lose_an_expert(slots, match):
    with pytest.raises(MoEConfigError, match=match):
        Placement(slots, 3, 2)


def test_balanced_replicates_the_hottest_and_spreads_replicas_over_ranks():
    loads = [100, 60, 10, 10, 5, 5, 5, 5]
    placement = Placement.balanced(loads, 4, 2)
    counts = [len(r) for r in placement.replicas()]
    assert counts == [2, 2, 2, 2, 1, 1, 1, 1]  # 100, 60 split; then 50, 30, 10, 10 -> 2 and 3 too
    for slots in placement.replicas():  # at most one replica of an expert per rank
        assert len({s // placement.slots_per_rank for s in slots}) == len(slots)
    before, after = Placement.initial(8, 4, 2).rank_loads(loads), placement.rank_loads(loads)
    assert sum(after) == pytest.approx(sum(loads)) and _imbalance(after) < _imbalance(before)
    assert _imbalance(after) == pytest.approx(1.0)  # 100 / 2 + 60 / 2 + ... splits exactly here


def test_balanced_caps_replicas_at_one_per_rank():
    placement = Placement.balanced([1000, 1, 1, 1], 4, 2)
    assert [len(r) for r in placement.replicas()] == [2, 2, 2, 2]


def test_balanced_keeps_experts_in_their_old_slots():
    previous = Placement.initial(8, 4, 2)
    loads = [1, 1, 1, 1, 1, 1, 50, 40]
    kept, fresh = Placement.balanced(loads, 4, 2, previous=previous), Placement.balanced(loads, 4, 2)
    assert sorted(kept.rank_loads(loads)) == sorted(fresh.rank_loads(loads))  # the same balance
    for rank in range(2):
        before = previous.rank_slots(rank)
        assert all(before[slot] == e for slot, e in enumerate(kept.rank_slots(rank)) if e in before)
    in_place = [sum(new == old for new, old in transfer_plan(previous, p, 0).local) for p in (kept, fresh)]
    assert in_place[0] == len(transfer_plan(previous, kept, 0).local) > in_place[1]


def test_balanced_sends_each_packed_set_to_the_rank_holding_it():
    loads = [9, 7, 5, 3, 2, 2, 1, 1]
    placement = Placement.balanced(loads, 4, 2)
    swapped = Placement(placement.rank_slots(1) + placement.rank_slots(0), 8, 2)
    assert Placement.balanced(loads, 4, 2, previous=swapped) == swapped
    assert transfer_plan(swapped, Placement.balanced(loads, 4, 2, previous=swapped), 0).moves == 0
    assert transfer_plan(swapped, placement, 0).moves > 0


def test_transfer_plan_docstring_example():
    old, new = Placement((0, 1, 2, 3), 4, 2), Placement((0, 2, 1, 3), 4, 2)
    plan0, plan1 = transfer_plan(old, new, 0), transfer_plan(old, new, 1)
    assert (plan0.local, plan0.receive, plan0.receive_counts, plan0.send, plan0.send_counts) == (
        ((0, 0),), (1,), (0, 1), (1,), (0, 1))
    assert (plan1.local, plan1.receive, plan1.send) == (((1, 1),), (0,), (0,)) and plan0.moves == plan1.moves == 2
    assert transfer_plan(old, old, 0).moves == 0


def test_gather_slots_allows_repeats_and_moves_scales():
    problem = make_problem(num_experts=4, quant="fp32", dtype=torch.float32, has_bias=True)
    full = ExpertWeights.from_dense(torch.randn(4, 2 * problem.intermediate_size, problem.hidden_size),
                                    torch.randn(4, problem.hidden_size, problem.intermediate_size),
                                    torch.randn(4, 2 * problem.intermediate_size), torch.randn(4, problem.hidden_size))
    slots = gather_slots(full, (3, 0, 3))
    assert torch.equal(slots.w13.data, full.w13.data[[3, 0, 3]]) and torch.equal(slots.b2, full.b2[[3, 0, 3]])
    with pytest.raises(MoEConfigError, match="weights hold 4 experts; the placement needs expert 7"):
        gather_slots(full, (7,))


# --- the device state --------------------------------------------------------------------------
_SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
            "unique_consecutive", "bincount", "repeat_interleave", "is_nonzero", "equal", "histc", "item"}


class _HostReads(TorchDispatchMode):
    """Records every aten op that reads device data on the host (a sync on a GPU): ``item``/``tolist``
    (``_local_scalar_dense``), ops whose output size depends on the data, and boolean-mask indexing."""

    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        masks = name in ("index", "index_put", "index_put_") and any(
            isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in (args[1] or ()) if t is not None)
        if name in _SYNCING or masks:
            self.found.append(name)
        return func(*args, **(kwargs or {}))


def test_the_host_read_detector_can_fail():
    x = torch.tensor([0, 3, 0])
    with _HostReads() as reads:
        x.nonzero(), x.sum().item(), x[x > 0]
    assert reads.found == ["nonzero", "_local_scalar_dense", "index"]


def test_counters_and_physical_ids_read_nothing_on_the_host():
    balancer = ExpertLoadBalancer(_problem(rank=1), "cpu")  # slots (0, 1, 2, 3, 4, 5 | 4, 5, 6, 7, 0, 1)
    ids = torch.tensor([[4, 0], [4, 5], [4, 1], [7, 4]], dtype=torch.int32)
    with _HostReads() as reads:
        balancer.record(ids)
        physical = balancer.to_physical(TopK(ids, torch.rand(4, 2)))
    assert reads.found == []
    assert balancer.tokens_per_expert.tolist() == [1, 1, 0, 0, 4, 1, 0, 1]
    balancer.record(ids[:1])
    assert balancer.tokens_per_expert.tolist() == [2, 1, 0, 0, 5, 1, 0, 1]
    slots = balancer.placement.physical_to_logical
    assert [[slots[p] for p in row] for row in physical.ids.tolist()] == ids.tolist()  # the same experts
    assert physical.ids.dtype == torch.int32
    # expert 4 has slots 4 and 6: tokens 0..3 on rank 1 take replica (m + 1) % 2
    assert [row[row.index(p)] for row, p in zip(physical.ids.tolist(), (6, 4, 6, 4))] == [6, 4, 6, 4]


def test_counters_are_exact_for_the_empty_batch_and_every_expert():
    balancer = ExpertLoadBalancer(_problem(), "cpu")
    balancer.record(torch.zeros(0, 2, dtype=torch.int32))
    ids = torch.arange(8, dtype=torch.int32).view(4, 2)
    balancer.record(ids)
    assert balancer.tokens_per_expert.tolist() == [1] * 8
    assert balancer.to_physical(TopK(ids[:0], torch.zeros(0, 2))).ids.shape == (0, 2)


def test_install_rejects_a_placement_of_another_layer():
    balancer = ExpertLoadBalancer(_problem(), "cpu")
    with pytest.raises(MoEConfigError, match="placement is for E=4 on 2 ranks, the layer has E=8 on 2"):
        balancer.install(Placement.initial(4, 2, 2))
    with pytest.raises(MoEConfigError, match="num_redundant_experts > 0"):
        ExpertLoadBalancer(make_problem(), "cpu")


def test_rebalance_needs_redundant_experts():
    from moe import FusedMoE

    layer = FusedMoE(8, 2, 64, 32, dtype=torch.float32, quant="fp32")
    with pytest.raises(MoEConfigError, match="num_redundant_experts=N > 0.*num_redundant_experts=0"):
        layer.rebalance()
    with pytest.raises(MoEConfigError, match="takes what this layer's begin_rebalance returned \\(got Placement"):
        layer.finish_rebalance(Placement.initial(8, 2, 2))


# --- the oracle and moe plan -------------------------------------------------------------------
def test_the_oracle_plans_physical_experts():
    logical = _problem(num_experts=8, ep=2, redundant=4, quant="bf16")
    result = plan(logical, Platform.cpu(), allow_empty=True)
    assert result.problem.num_experts == 12 and result.problem.local_num_experts == 6
    plain = dataclasses.replace(logical, parallel=ParallelConfig(2, 0))
    # more physical experts per rank: more weights read per forward at large M
    assert roofline(result.problem, Platform.cpu(), 4096).weight_bytes > roofline(plain, Platform.cpu(), 4096).weight_bytes


def _plan_cli(capsys, *argv: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="python -m moe")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *argv])
    return args.func(args), capsys.readouterr().out


def test_moe_plan_shows_physical_experts(capsys):
    flags = ("--platform", "h100", "--preset", "deepseek-v3", "--quant", "fp8_block", "--ep", "8")
    code, out = _plan_cli(capsys, *flags, "--redundant", "32")
    assert code == 0
    assert "eplb       E=256 logical + 32 redundant = 288 physical experts, 36 per rank on 8 ranks" in out
    assert "E=288" in out and "36 local experts" in out
    _, out = _plan_cli(capsys, *flags, "--redundant", "32", "--json")
    assert json.loads(out)["eplb"] == {"logical_experts": 256, "redundant_experts": 32, "physical_experts": 288,
                                       "physical_per_rank": 36}
    _, out = _plan_cli(capsys, *flags, "--json")
    assert "eplb" not in json.loads(out)


def test_moe_plan_names_a_bad_redundant_count(capsys):
    with pytest.raises(MoEConfigError, match="256 \\+ 30 = 286 physical experts must be divisible by ep_size=8"):
        _plan_cli(capsys, "--platform", "h100", "--preset", "deepseek-v3", "--ep", "8", "--redundant", "30")
