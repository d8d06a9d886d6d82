"""Moving expert weights between ranks when the EPLB placement (`moe.eplb.Placement`) changes.

Every rank computes the same old and new placements, so every rank knows, without asking, which slot
comes from where: a slot whose expert this rank already held is copied locally; any other is received
from a rank that held it (the holders take turns by slot number). Each tensor of the weights (data,
scales, biases: all start with the expert dimension) travels as bytes in one ``all_to_all_single``
with splits known in advance; nothing is exchanged when no slot changes rank.

The new weights are built in new tensors: the old ones stay intact (and in use) until the caller swaps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe.eplb import ExpertLoadBalancer, Placement
from moe.errors import MoEConfigError
from moe.prepare_finalize._ep import comm_device
from moe.weights import ExpertWeights


@dataclass(frozen=True)
class TransferPlan:
    """Where each of this rank's new slots comes from. Example, 2 ranks of 2 slots, seen from rank 0,
    old ``(0, 1 | 2, 3)`` -> new ``(0, 2 | 1, 3)``: ``local=((0, 0),)``, ``receive=((1, 0),)`` from
    rank 1 (``receive_counts=(0, 1)``), ``send=(1,)`` to rank 1 (``send_counts=(0, 1)``)."""

    local: tuple[tuple[int, int], ...]  # (new local slot, old local slot) copied on this rank
    receive: tuple[int, ...]  # new local slots filled from other ranks, grouped by source rank
    receive_counts: tuple[int, ...]  # slots received from each rank
    send: tuple[int, ...]  # old local slots sent to other ranks, grouped by destination rank
    send_counts: tuple[int, ...]  # slots sent to each rank
    moves: int  # slots received over all ranks: 0 means no collective is needed


def transfer_plan(old: Placement, new: Placement, rank: int) -> TransferPlan:
    """This rank's part of the move from ``old`` to ``new`` (the same computation on every rank)."""
    if (old.num_experts, old.ep_size, len(old.physical_to_logical)) != (
            new.num_experts, new.ep_size, len(new.physical_to_logical)):
        raise MoEConfigError("old and new placements differ in experts, ranks or slots; a move keeps them")
    sources = _sources(old, new)  # per destination rank: [(new slot, source rank, old slot)]
    local = tuple((slot, old_slot) for slot, src, old_slot in sources[rank] if src == rank)
    received = [[(slot, src) for slot, src, _ in sources[rank] if src == s and s != rank] for s in range(old.ep_size)]
    sent = [[old_slot for _, src, old_slot in sources[d] if src == rank and d != rank] for d in range(old.ep_size)]
    moves = sum(1 for d in range(old.ep_size) for _, src, _ in sources[d] if src != d)
    return TransferPlan(local, tuple(slot for group in received for slot, _ in group), tuple(map(len, received)),
                        tuple(slot for group in sent for slot in group), tuple(map(len, sent)), moves)


def _sources(old: Placement, new: Placement) -> list[list[tuple[int, int, int]]]:
    size, holders = old.slots_per_rank, old.replicas()
    found = []
    for rank in range(new.ep_size):
        before = old.rank_slots(rank)
        rows = []
        for slot, expert in enumerate(new.rank_slots(rank)):
            if expert in before:
                rows.append((slot, rank, before.index(expert)))
            else:
                held = holders[expert][(rank * size + slot) % len(holders[expert])]
                rows.append((slot, held // size, held % size))
        found.append(rows)
    return found


def move_weights(weights: ExpertWeights, plan: TransferPlan, group) -> ExpertWeights:
    """This rank's new slot weights from its old ones (``weights``, untouched) per ``plan``.
    Collective when ``plan.moves``: every rank of ``group`` calls it together."""
    comm = comm_device(group)

    def move(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() == 0:  # one value shared by every expert
            return tensor
        rows = tensor.contiguous().view(torch.uint8).reshape(tensor.shape[0], -1)
        new = torch.empty_like(rows)
        if plan.local:
            new_slots, old_slots = (list(column) for column in zip(*plan.local))
            new[new_slots] = rows[old_slots]
        if plan.moves:
            arrived = torch.empty(len(plan.receive), rows.shape[1], dtype=torch.uint8, device=comm)
            dist.all_to_all_single(arrived, rows[list(plan.send)].to(comm), list(plan.receive_counts),
                                   list(plan.send_counts), group=group)
            new[list(plan.receive)] = arrived.to(new.device)
        return new.view(tensor.dtype).reshape(tensor.shape)

    return weights.map_tensors(move)


def gather_slots(weights: ExpertWeights, experts: tuple[int, ...]) -> ExpertWeights:
    """The full ``[E, ...]`` ``weights`` of the logical ``experts``, in order, repeats allowed (a rank's
    slots from a full checkpoint at load)."""
    if weights.num_experts <= max(experts):
        raise MoEConfigError(f"weights hold {weights.num_experts} experts; the placement needs expert {max(experts)}")
    index = torch.tensor(experts, dtype=torch.long, device=weights.device)
    return weights.map_tensors(lambda t: t if t.dim() == 0 else t.index_select(0, index))


@dataclass(frozen=True)
class PendingRebalance:
    """A rebalance computed and moved but not yet in use: the layer still serves the old placement
    (and the old weights) until `FusedMoE.finish_rebalance` swaps both in."""

    placement: Placement  # the new placement
    weights: ExpertWeights  # this rank's slots under it, in new tensors
    loads: tuple[int, ...]  # tokens per logical expert over the group that it was computed from
    moves: int  # slots that changed rank


def begin_rebalance(balancer: ExpertLoadBalancer, weights: ExpertWeights, group) -> PendingRebalance:
    """Collective (every rank of ``group`` together): sums the ranks' token counters, resets them (what
    arrives from now on counts toward the next rebalance), computes the balanced placement and moves
    the weights into new tensors. The balancer and ``weights`` are left as they were."""
    parallel = balancer.problem.parallel
    loads = balancer.tokens_per_expert.to(comm_device(group), copy=True)
    balancer.tokens_per_expert.zero_()
    dist.all_reduce(loads, group=group)
    counts = tuple(loads.tolist())  # the host reads the loads once per rebalance, never per forward
    new = Placement.balanced(counts, parallel.num_redundant_experts, parallel.ep_size, previous=balancer.placement)
    plan = transfer_plan(balancer.placement, new, parallel.ep_rank)
    return PendingRebalance(new, move_weights(weights, plan, group), counts, plan.moves)
