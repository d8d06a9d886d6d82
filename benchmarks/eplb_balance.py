"""Max/mean (token, expert) slots per rank before and after an EPLB rebalance, on a skewed routing trace.

    python benchmarks/eplb_balance.py                       # DeepSeek-V3 at EP8, 32 redundant experts
    python benchmarks/eplb_balance.py --zipf 0.8 --batches 8 --markdown benchmarks/results/eplb_balance_cpu.md

The trace is SYNTHETIC and deterministic (seeded): expert popularity follows a Zipf law (the i-th most
popular expert is picked with weight 1 / i^s, the popularity order a seeded permutation of the E
experts), and each token draws its k distinct experts by that weight (Gumbel top-k: sampling without
replacement). Each batch of M tokens is split evenly over the ranks, token m living on rank
m // (M / ep). No process group is needed: the placement math and the replica choice are the ones
`FusedMoE` runs (`moe.eplb.Placement`, `ExpertLoadBalancer.to_physical` per rank), on CPU tensors.

Reported per placement, on the batches the counters saw ("seen") and on as many fresh batches drawn
from the same law ("held out"): max / mean slots per rank, where a slot is one (token, expert) pair
computed on the rank that holds the chosen replica (1.00 is perfect balance).
"""

from __future__ import annotations

import argparse
import time

import torch

from moe.eplb import ExpertLoadBalancer, Placement
from moe.problem import MoEProblem, ParallelConfig
from moe.router import TopK


def zipf_trace(num_experts: int, top_k: int, tokens: int, batches: int, exponent: float,
               seed: int, stream: int) -> list[torch.Tensor]:
    """``batches`` int32 ``[tokens, top_k]`` id tensors of the law in the module docstring: ``seed`` fixes
    the law (the popularity order), ``stream`` the draws (another stream: other batches, same law)."""
    order = torch.randperm(num_experts, generator=torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed * 1000 + stream + 1)
    popularity = torch.empty(num_experts)
    popularity[order] = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float32) ** exponent
    trace = []
    for _ in range(batches):
        uniform = torch.rand(tokens, num_experts, generator=gen).clamp_min(1e-20)
        gumbel = -torch.log(-torch.log(uniform))
        trace.append((popularity.log() + gumbel).topk(top_k, dim=1).indices.to(torch.int32))
    return trace


def slots_per_rank(placement: Placement, trace: list[torch.Tensor], num_redundant: int) -> list[int]:
    """(token, expert) slots each rank computes under ``placement`` (N > 0: the layer's replica choice)."""
    ep, total = placement.ep_size, torch.zeros(placement.ep_size, dtype=torch.int64)
    balancers = [_balancer(placement, rank, num_redundant) for rank in range(ep)] if num_redundant else None
    owner = torch.tensor([slots[0] // placement.slots_per_rank for slots in placement.replicas()])
    for ids in trace:
        for rank, part in enumerate(ids.chunk(ep)):
            if balancers is None:
                ranks = owner[part.long()]
            else:
                b = balancers[rank]
                ranks = b.physical_rank[b.to_physical(TopK(part, torch.ones(part.shape))).ids.long()]
            total += torch.bincount(ranks.flatten(), minlength=ep)
    return total.tolist()


def _balancer(placement: Placement, rank: int, num_redundant: int) -> ExpertLoadBalancer:
    problem = MoEProblem.create(num_experts=placement.num_experts, top_k=1, hidden_size=128, intermediate_size=128,
                                parallel=ParallelConfig(placement.ep_size, rank, num_redundant_experts=num_redundant))
    balancer = ExpertLoadBalancer(problem, "cpu")
    balancer.install(placement)
    return balancer


def run(args: argparse.Namespace) -> list[str]:
    experts, k, ep, n = args.experts, args.top_k, args.ep, args.redundant
    seen = zipf_trace(experts, k, args.tokens, args.batches, args.zipf, args.seed, stream=0)
    held_out = zipf_trace(experts, k, args.tokens, args.batches, args.zipf, args.seed, stream=1)
    counts = torch.zeros(experts, dtype=torch.int64)
    for ids in seen:  # what the layer's counters add up over the ranks
        counts.index_add_(0, ids.flatten().long(), torch.ones(ids.numel(), dtype=torch.int64))
    loads = counts.tolist()
    start = time.perf_counter()
    initial = Placement.initial(experts, n, ep)
    rebalanced = Placement.balanced(loads, n, ep, previous=initial)
    host_ms = 1e3 * (time.perf_counter() - start)
    rows = [(f"EP{ep} without replicas, contiguous E/ep per rank", Placement(tuple(range(experts)), experts, ep), 0),
            ("packed by load, no replicas (N=0)", Placement.balanced(loads, 0, ep), 0),
            (f"EPLB N={n}: initial placement (before rebalance)", initial, n),
            (f"EPLB N={n}: after rebalance", rebalanced, n)]
    lines = [f"E={experts} k={k} ep={ep} redundant={n} zipf s={args.zipf} tokens={args.tokens} x "
             f"{args.batches} batches (seen) + {args.batches} held out, seed={args.seed}; synthetic trace",
             "", "| placement | max/mean seen | max/mean held out | max slots per rank (held out) |",
             "|---|---|---|---|"]
    for name, placement, redundant in rows:
        per_seen, per_held = (slots_per_rank(placement, t, redundant) for t in (seen, held_out))
        ratios = [max(c) * ep / sum(c) for c in (per_seen, per_held)]
        lines.append(f"| {name} | {ratios[0]:.3f} | {ratios[1]:.3f} | {max(per_held)} of {sum(per_held)} |")
    hottest = sorted(range(experts), key=lambda e: -loads[e])[:3]
    replicas = rebalanced.replicas()
    lines += ["", f"hottest experts {hottest} took {[round(100 * loads[e] / sum(loads), 1) for e in hottest]}% of "
              f"the slots and got {[len(replicas[e]) for e in hottest]} replicas; "
              f"{sum(len(r) > 1 for r in replicas)} experts replicated; placement computed in {host_ms:.1f} ms (host)"]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--ep", type=int, default=8)
    parser.add_argument("--redundant", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per batch, over all ranks")
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--zipf", type=float, default=1.0, help="the Zipf exponent s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--markdown", help="also append the table to this file")
    args = parser.parse_args()
    text = "\n".join(run(args))
    print(text)
    if args.markdown:
        with open(args.markdown, "a") as out:
            out.write(text + "\n\n")


if __name__ == "__main__":
    main()
