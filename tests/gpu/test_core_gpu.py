"""The core path on a CUDA GPU: torch_grouped (torch._grouped_mm on SM90+) and the batched
prepare/finalize against reference, in bfloat16 at a real model's shape; torch_grouped with no host
sync and through CUDA-graph capture and replay."""

from __future__ import annotations

import pytest
import torch

from moe import BatchedPrepareFinalize, FusedMoE, LocalPrepareFinalize, ModularKernel, ReferenceExperts
from moe.experts.torch_grouped import TorchGroupedExperts
from moe.formats import ActivationFormat, Dispatched, DispatchShape
from moe.platform import Platform
from moe.problem import MoEProblem, ParallelConfig
from moe.quant import QuantFormat, QuantizedTensor
from moe.testing import assert_close_moe, cuda_checks
from moe.testing.inputs import random_inputs, random_weights
from moe.workspace import WorkspaceManager

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("tokens", [1, 37, 512])
@pytest.mark.parametrize("activation", ["silu", "swiglu_oai", "relu2"])
def test_torch_grouped_matches_reference_qwen3_shape(tokens, activation):
    layer = FusedMoE(128, 8, 2048, 768, activation=activation, device="cuda", max_tokens=512,
                     experts="torch_grouped", has_bias=activation == "swiglu_oai")
    p = layer.problem
    gen = torch.Generator().manual_seed(0)
    dense = dict(w13=torch.randn(128, p.w13_rows, 2048, generator=gen) / 45,
                 w2=torch.randn(128, 2048, 768, generator=gen) / 28)
    if p.has_bias:
        dense.update(b13=0.1 * torch.randn(128, p.w13_rows, generator=gen), b2=0.1 * torch.randn(128, 2048, generator=gen))
    layer.load_weights(**dense)
    hidden = torch.randn(tokens, 2048, generator=gen).to("cuda", torch.bfloat16)
    logits = torch.randn(tokens, 128, generator=gen).cuda()
    out = layer(hidden, logits)
    truth = ModularKernel(LocalPrepareFinalize(p), ReferenceExperts(p), device="cuda")
    truth.load(layer.weights)
    ref = truth(hidden, layer.router(logits))
    assert_close_moe(out.float(), ref.float(), "bf16")


def test_batched_prepare_finalize_on_gpu():
    layer = FusedMoE(16, 4, 256, 128, device="cuda", max_tokens=64, experts="reference")
    p = layer.problem
    layer.load_weights(w13=torch.randn(16, 256, 256) / 16, w2=torch.randn(16, 256, 128) / 11)
    hidden, logits = torch.randn(64, 256).to("cuda", torch.bfloat16), torch.randn(64, 16).cuda()
    batched = ModularKernel(BatchedPrepareFinalize(p), ReferenceExperts(p), device="cuda")
    batched.load(layer.weights)
    out = batched(hidden, layer.router(logits))
    assert_close_moe(out.float(), layer(hidden, logits).float(), "fp32")


# Qwen3-30B-A3B's H, I and k, with fewer experts; "half": every other expert lives on this rank
HALF_HERE = tuple(e // 2 if e % 2 == 0 else -1 for e in range(32))


@pytest.mark.skipif(not Platform.detect().capability_at_least(9), reason="torch._grouped_mm's kernels need SM90+")
@pytest.mark.parametrize("tokens", [1, 64])
@pytest.mark.parametrize("expert_map", [None, HALF_HERE], ids=["all_here", "half_here"])
def test_torch_grouped_runs_without_host_sync_and_replays_in_a_cuda_graph(tokens, expert_map):
    parallel = ParallelConfig(expert_map=expert_map) if expert_map else ParallelConfig()
    p = MoEProblem.create(num_experts=32, top_k=8, hidden_size=2048, intermediate_size=768, quant="bf16",
                          max_tokens=tokens, parallel=parallel)
    experts = TorchGroupedExperts(p)
    weights = random_weights(p, device="cuda")
    prepared = experts.prepare_weights(weights)
    assert prepared.grouped_mm
    hidden, topk = random_inputs(p, tokens, device="cuda")
    dispatched = Dispatched(ActivationFormat.STANDARD, QuantizedTensor(data=hidden, scale=None, fmt=QuantFormat.NONE),
                            topk)
    shapes = experts.workspace_shapes(DispatchShape(ActivationFormat.STANDARD, tokens))
    workspace = WorkspaceManager("cuda").take(shapes)
    apply = lambda: experts.apply(dispatched, prepared, workspace).out  # noqa: E731
    apply()  # warm up (cuBLAS / CUTLASS handles) before the sync check
    eager, error = cuda_checks.host_syncs(apply)
    assert error is None, f"apply synchronizes with the host: {error}"
    truth = ModularKernel(LocalPrepareFinalize(p), ReferenceExperts(p), device="cuda")
    truth.load(weights)
    ref = truth(hidden, topk)
    assert_close_moe(eager.float(), ref.float(), "bf16")

    def new_inputs():  # the graph reads the same tensors: new routing and activations in place
        fresh_hidden, fresh_topk = random_inputs(p, tokens, torch.Generator().manual_seed(1), device="cuda")
        hidden.copy_(fresh_hidden)
        topk.ids.copy_(fresh_topk.ids)
        topk.weights.copy_(fresh_topk.weights)

    replayed, error = cuda_checks.capture_and_replay(apply, new_inputs)
    assert error is None, f"capture or replay failed: {error}"
    eager_again = experts.apply(dispatched, prepared, WorkspaceManager("cuda").take(shapes)).out
    assert torch.equal(replayed, eager_again)  # deterministic: replay == eager on the new inputs, bit for bit
