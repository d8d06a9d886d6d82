"""EPLB's per-forward steps on a CUDA GPU: counting logical ids and mapping them to replicas never
synchronize with the host (``set_sync_debug_mode("error")``), replay in a CUDA graph, and see a new
placement installed in place after capture."""

from __future__ import annotations

import pytest
import torch

from moe.eplb import ExpertLoadBalancer, Placement
from moe.problem import MoEProblem, ParallelConfig
from moe.router import TopK
from moe.testing import cuda_checks

pytestmark = pytest.mark.gpu

# DeepSeek-V3 routing at EP8 with 32 redundant experts, seen from rank 3
PROBLEM = MoEProblem.create(num_experts=256, top_k=8, hidden_size=7168, intermediate_size=2048, quant="bf16",
                            parallel=ParallelConfig(8, 3, num_redundant_experts=32))


def _routing(tokens: int, seed: int) -> TopK:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(tokens, 256, generator=gen).argsort(dim=1)[:, :8].to(torch.int32)
    return TopK(ids.cuda(), torch.rand(tokens, 8, generator=gen).cuda())


def _step(balancer: ExpertLoadBalancer, topk: TopK) -> torch.Tensor:
    balancer.record(topk.ids)
    return balancer.to_physical(topk).ids


@pytest.mark.parametrize("tokens", [1, 4096])
def test_counting_and_replica_choice_do_not_sync(tokens):
    balancer = ExpertLoadBalancer(PROBLEM, "cuda")
    topk = _routing(tokens, 0)
    _step(balancer, topk)  # warm up outside the check
    physical, error = cuda_checks.host_syncs(lambda: _step(balancer, topk))
    assert error is None, f"EPLB's forward step synchronizes with the host: {error}"
    expected = 2 * torch.bincount(topk.ids.flatten().long().cpu(), minlength=256)
    assert torch.equal(balancer.tokens_per_expert.cpu(), expected)
    slots = torch.tensor(balancer.placement.physical_to_logical)
    assert torch.equal(slots[physical.long().cpu()], topk.ids.long().cpu())  # every slot holds the routed expert


def test_replays_in_a_cuda_graph_and_follows_a_new_placement():
    balancer = ExpertLoadBalancer(PROBLEM, "cuda")
    topk = _routing(256, 1)
    physical, error = cuda_checks.capture_and_replay(lambda: _step(balancer, topk), lambda: None)
    assert error is None, f"capture or replay failed: {error}"
    loads = torch.bincount(topk.ids.flatten().long().cpu(), minlength=256).tolist()
    new = Placement.balanced(loads, 32, 8, previous=balancer.placement)
    balancer.install(new)  # in place: the captured graph reads the new tables
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = balancer.to_physical(topk).ids
    balancer.install(Placement.initial(256, 32, 8))
    graph.replay()
    torch.cuda.synchronize()
    slots = torch.tensor(Placement.initial(256, 32, 8).physical_to_logical)
    assert torch.equal(slots[captured.long().cpu()], topk.ids.long().cpu())
    assert torch.equal(captured.cpu(), balancer.to_physical(topk).ids.cpu())
