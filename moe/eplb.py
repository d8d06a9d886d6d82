"""Redundant experts and load balancing under expert parallelism (EPLB).

With ``ParallelConfig(ep_size, ep_rank, num_redundant_experts=N)`` the E logical experts (what the
router picks) live in ``P = E + N`` physical slots, ``S = P / ep_size`` per rank, rank r holding slots
``[r * S, (r + 1) * S)`` -- a fixed sharding, so the transports and kernels see a plain expert-parallel
layer of P experts (`MoEProblem.physical`). What changes is which logical expert each slot holds: every
logical expert has one replica or more, and the hot ones get more.

- `Placement`         slot -> logical expert, with the greedy balancing algorithm (`Placement.balanced`)
- `ExpertLoadBalancer` one rank's device state: the replica tables, the token counters, and the step that
                      turns the router's logical ids into physical ones -- all without a host sync

Moving the weights when the placement changes is `moe.eplb_transfer`'s; `FusedMoE.rebalance` runs the
whole step. The algorithm follows the facts of DeepSeek's EPLB (replicate the experts with the highest
load per replica, then pack replicas onto ranks heaviest first), written here from its description.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

import torch

from moe.errors import MoEConfigError
from moe.problem import MoEProblem
from moe.router import TopK


@dataclass(frozen=True)
class Placement:
    """Which logical expert each physical slot holds.

    Example, E=4 logical experts, N=2 redundant, 2 ranks (S=3 slots each):
    ``physical_to_logical=(0, 1, 2, 3, 0, 1)`` -- rank 0 holds experts 0, 1, 2, rank 1 holds 3 and
    replicas of 0 and 1; ``replicas()[0] == [0, 4]``.
    """

    physical_to_logical: tuple[int, ...]  # P entries: the logical expert of slot p
    num_experts: int  # E, logical
    ep_size: int

    def __post_init__(self):
        slots, experts = len(self.physical_to_logical), self.num_experts
        if slots % self.ep_size or slots < experts:
            raise MoEConfigError(f"a placement needs a multiple of ep_size={self.ep_size} slots, at least "
                                 f"num_experts={experts} (got {slots})")
        held = set(self.physical_to_logical)
        missing = sorted(set(range(experts)) - held)
        if missing or not held <= set(range(experts)):
            raise MoEConfigError(f"every logical expert 0..{experts - 1} needs a slot, and slots hold only those "
                                 f"(missing {missing[:8]}, got {sorted(held - set(range(experts)))[:8]} extra)")

    @property
    def slots_per_rank(self) -> int:
        return len(self.physical_to_logical) // self.ep_size

    def rank_slots(self, rank: int) -> tuple[int, ...]:
        """The logical experts of ``rank``'s slots, in local order."""
        start = rank * self.slots_per_rank
        return self.physical_to_logical[start:start + self.slots_per_rank]

    def replicas(self) -> list[list[int]]:
        """Logical expert e -> its physical slots, ascending."""
        found: list[list[int]] = [[] for _ in range(self.num_experts)]
        for slot, expert in enumerate(self.physical_to_logical):
            found[expert].append(slot)
        return found

    def rank_loads(self, loads: Sequence[float]) -> list[float]:
        """Tokens per rank when each expert's ``loads[e]`` splits evenly over its replicas."""
        replicas, per_rank = self.replicas(), [0.0] * self.ep_size
        for expert, slots in enumerate(replicas):
            for slot in slots:
                per_rank[slot // self.slots_per_rank] += loads[expert] / len(slots)
        return per_rank

    @classmethod
    def initial(cls, num_experts: int, num_redundant: int, ep_size: int) -> "Placement":
        """Before any load is known: rank r's first E/ep slots hold its contiguous block of experts, as
        without EPLB, and its N/ep redundant slots replicate the first N/ep experts of the next rank's
        block (never its own while N/ep <= E - E/ep). Needs E and N divisible by ep_size; otherwise the
        balanced placement of equal loads."""
        if num_experts % ep_size or num_redundant % ep_size:
            return cls.balanced([1] * num_experts, num_redundant, ep_size)
        own, extra = num_experts // ep_size, num_redundant // ep_size
        slots = []
        for rank in range(ep_size):
            slots += range(rank * own, (rank + 1) * own)
            slots += [((rank + 1) * own + i) % num_experts for i in range(extra)]
        return cls(tuple(slots), num_experts, ep_size)

    @classmethod
    def balanced(cls, loads: Sequence[float], num_redundant: int, ep_size: int,
                 previous: "Placement | None" = None) -> "Placement":
        """A placement for ``loads`` (tokens per logical expert), greedy in two steps:

        1. replicate: each of the N redundant slots goes, one at a time, to the expert whose load per
           replica is the highest (ties: the lower id), at most ``ep_size`` replicas each (a second
           replica on the same rank would not spread the load);
        2. pack: replicas, heaviest first (load / replicas), each to the least loaded rank that has a free
           slot and no replica of that expert yet (else any rank with a free slot), ties to the lower rank.

        With ``previous``, so that fewer weights move: each packed set goes to the rank that already holds
        most of it (the sets are interchangeable, their loads being what was balanced), and each rank keeps
        the experts it held in their old slots. Deterministic: every rank computes the same placement.
        """
        counts = _replicate(loads, num_redundant, ep_size)
        bins = _pack(loads, counts, ep_size, (len(loads) + num_redundant) // ep_size)
        if previous is None:
            return cls(tuple(e for experts in bins for e in experts), len(loads), ep_size)
        slots: list[int] = []
        for rank, experts in enumerate(_match_ranks(bins, previous)):
            slots += _keep_in_place(experts, previous.rank_slots(rank))
        return cls(tuple(slots), len(loads), ep_size)


def _replicate(loads: Sequence[float], num_redundant: int, ep_size: int) -> list[int]:
    """Replicas per expert: 1 each, then one more at a time to the highest load per replica."""
    counts = [1] * len(loads)
    heap = [(-float(load), expert) for expert, load in enumerate(loads)]
    heapq.heapify(heap)
    for _ in range(num_redundant):
        while True:  # the ParallelConfig check (N <= E x (ep - 1)) guarantees an expert below the cap
            _, expert = heapq.heappop(heap)
            if counts[expert] < ep_size:
                break
        counts[expert] += 1
        if counts[expert] < ep_size:
            heapq.heappush(heap, (-float(loads[expert]) / counts[expert], expert))
    return counts


def _pack(loads: Sequence[float], counts: list[int], ep_size: int, slots_per_rank: int) -> list[list[int]]:
    """Longest-processing-time packing of the replicas onto ranks of ``slots_per_rank`` slots each."""
    replicas = [(loads[e] / counts[e], e) for e in range(len(loads)) for _ in range(counts[e])]
    replicas.sort(key=lambda item: (-item[0], item[1]))  # heaviest first, ties: the lower expert id
    bins: list[list[int]] = [[] for _ in range(ep_size)]
    totals = [0.0] * ep_size
    for load, expert in replicas:
        free = [r for r in range(ep_size) if len(bins[r]) < slots_per_rank]
        spread = [r for r in free if expert not in bins[r]] or free
        rank = min(spread, key=lambda r: (totals[r], r))
        bins[rank].append(expert)
        totals[rank] += load
    return bins


def _match_ranks(bins: list[list[int]], previous: Placement) -> list[list[int]]:
    """``bins`` reordered so that bin i goes to rank i: each bin in turn to the free rank sharing the most
    experts with it in ``previous`` (ties: the lower rank)."""
    free, matched = list(range(len(bins))), [[] for _ in bins]
    for experts in bins:
        rank = max(free, key=lambda r: (len(set(experts) & set(previous.rank_slots(r))), -r))
        free.remove(rank)
        matched[rank] = experts
    return matched


def _keep_in_place(experts: list[int], old: Sequence[int]) -> list[int]:
    """``experts`` ordered into a rank's slots so that those it held before keep their old slot."""
    remaining = list(experts)
    slots: list[int | None] = [None] * len(old)
    for slot, expert in enumerate(old):
        if expert in remaining:
            remaining.remove(expert)
            slots[slot] = expert
    fill = iter(sorted(remaining))
    return [next(fill) if expert is None else expert for expert in slots]


class ExpertLoadBalancer:
    """One rank's EPLB state for one layer, on the layer's device; nothing in the forward reads the host.

    - ``replica_table`` int64 ``[E, R]``: the physical slots of expert e (R = min(ep_size, N + 1); a row
      is padded with its first slot), ``replica_counts`` int64 ``[E]``, ``physical_rank`` int64 ``[P]``;
      updated in place, so a captured CUDA graph keeps reading the current placement.
    - ``tokens_per_expert`` int64 ``[E]``: (token, slot) pairs this rank routed to each logical expert
      since the last rebalance, added by `record` with one fixed-shape ``index_add_``.
    """

    def __init__(self, problem: MoEProblem, device: torch.device | str):
        p = problem.parallel
        if not p.num_redundant_experts:
            raise MoEConfigError("ExpertLoadBalancer serves a ParallelConfig with num_redundant_experts > 0 "
                                 f"(got {p.num_redundant_experts})")
        self.problem, self.rank = problem, p.ep_rank
        experts, width = problem.num_experts, min(p.ep_size, p.num_redundant_experts + 1)
        self.placement = Placement.initial(experts, p.num_redundant_experts, p.ep_size)
        self.replica_table = torch.zeros(experts, width, dtype=torch.int64, device=device)
        self.replica_counts = torch.zeros(experts, dtype=torch.int64, device=device)
        slots = p.num_physical_experts(experts)
        ranks = torch.arange(slots, dtype=torch.int64) // (slots // p.ep_size)
        self.physical_rank = ranks.to(device)
        self.tokens_per_expert = torch.zeros(experts, dtype=torch.int64, device=device)
        self.install(self.placement)

    def install(self, placement: Placement) -> None:
        """Makes ``placement`` the one `to_physical` uses (a host-to-device copy, in place)."""
        if (placement.num_experts, placement.ep_size) != (self.problem.num_experts, self.problem.parallel.ep_size):
            raise MoEConfigError(f"placement is for E={placement.num_experts} on {placement.ep_size} ranks, the "
                                 f"layer has E={self.problem.num_experts} on {self.problem.parallel.ep_size}")
        width = self.replica_table.shape[1]
        replicas = placement.replicas()
        if max(map(len, replicas)) > width:
            raise MoEConfigError(f"placement gives an expert {max(map(len, replicas))} replicas; at most {width}")
        rows = [slots + [slots[0]] * (width - len(slots)) for slots in replicas]
        self.replica_table.copy_(torch.tensor(rows, dtype=torch.int64))
        self.replica_counts.copy_(torch.tensor([len(s) for s in replicas], dtype=torch.int64))
        self.placement = placement

    def record(self, ids: torch.Tensor) -> None:
        """Adds this batch's logical ``ids [M, k]`` to ``tokens_per_expert`` (no host sync)."""
        flat = ids.reshape(-1).long()
        self.tokens_per_expert.index_add_(0, flat, torch.ones_like(flat))

    def to_physical(self, topk: TopK) -> TopK:
        """The same routing with physical ids: token m's slot on expert e goes to replica
        ``(m + ep_rank) % replicas(e)`` -- deterministic, spread over the replicas, no host sync."""
        ids = topk.ids.long()
        token = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1) + self.rank
        replica = token % self.replica_counts[ids]
        physical = self.replica_table[ids, replica].to(topk.ids.dtype)
        return TopK(physical, topk.weights)

    def local_experts(self) -> tuple[int, ...]:
        """The logical experts of this rank's slots, in local order."""
        return self.placement.rank_slots(self.rank)
