"""The core path on a CUDA GPU: torch_grouped (torch._grouped_mm on SM90+) and the batched
prepare/finalize against reference, in bfloat16 at a real model's shape."""

from __future__ import annotations

import pytest
import torch

from moe import BatchedPrepareFinalize, FusedMoE, LocalPrepareFinalize, ModularKernel, ReferenceExperts
from moe.testing import assert_close_moe

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
    ref = truth(hidden, layer.router(logits), truth.experts.prepare_weights(layer.weights))
    assert_close_moe(out.float(), ref.float(), "bf16")


def test_batched_prepare_finalize_on_gpu():
    layer = FusedMoE(16, 4, 256, 128, device="cuda", max_tokens=64, experts="reference")
    p = layer.problem
    layer.load_weights(w13=torch.randn(16, 256, 256) / 16, w2=torch.randn(16, 256, 128) / 11)
    hidden, logits = torch.randn(64, 256).to("cuda", torch.bfloat16), torch.randn(64, 16).cuda()
    batched = ModularKernel(BatchedPrepareFinalize(p), ReferenceExperts(p), device="cuda")
    out = batched(hidden, layer.router(logits), batched.experts.prepare_weights(layer.weights))
    assert_close_moe(out.float(), layer(hidden, logits).float(), "fp32")
