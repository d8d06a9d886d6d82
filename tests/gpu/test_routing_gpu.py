"""The fused routing kernel on a CUDA GPU: compiled (not interpreted), against the reference on the same
device, at the model shapes it is used for, in float32 and bfloat16 logits; `Router` takes the kernel on
CUDA; routing inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from moe.router import Router
from moe.routing.fused import fused_pays, fused_route
from moe.routing.reference import route_reference

pytestmark = pytest.mark.gpu

# the keys of _routers(), which builds on CUDA (at test time, not collection)
NAMES = ["deepseek_v3", "qwen3", "qwen2_unnormalized", "gpt_oss", "deepseek_v4", "llama4", "longcat_flash"]


def _routers() -> dict[str, Router]:
    generator = torch.Generator().manual_seed(0)

    def bias(width: int, scale: float) -> torch.Tensor:
        return (torch.randn(width, generator=generator) * scale).cuda()

    return {
        "deepseek_v3": Router("deepseek_v3", 256, 8, n_group=8, topk_group=4, correction_bias=bias(256, 0.1),
                              routed_scaling_factor=2.5),
        "qwen3": Router("softmax", 128, 8),
        "qwen2_unnormalized": Router("softmax", 60, 4, renormalize=False),
        "gpt_oss": Router("gpt_oss", 128, 4),
        "deepseek_v4": Router("deepseek_v4", 256, 6, correction_bias=bias(256, 0.5), routed_scaling_factor=1.5),
        "llama4": Router("llama4", 128, 1),
        "longcat_flash": Router("longcat_flash", 512, 12, num_zero_experts=256, correction_bias=bias(768, 0.01),
                                routed_scaling_factor=6.0),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 257, 4096])
@pytest.mark.parametrize("name", NAMES)
def test_fused_matches_reference_on_gpu(name, tokens, dtype):
    router = _routers()[name]
    generator = torch.Generator().manual_seed(tokens)
    logits = (torch.randn(tokens, router.num_choices, generator=generator) * 3).to(dtype).cuda()
    logits[:, 9] = logits[:, 4]  # a tie the lower id must win
    fused, reference = fused_route(logits, router), route_reference(logits, router)
    assert fused.ids.device.type == "cuda"
    assert torch.equal(fused.ids, reference.ids)
    torch.testing.assert_close(fused.weights, reference.weights, rtol=2e-6, atol=1e-7)


def test_names_list_every_router():
    assert list(_routers()) == NAMES


def test_router_uses_the_fused_kernel_on_cuda():
    router = _routers()["deepseek_v3"]
    logits = torch.randn(64, 256, device="cuda")
    assert fused_pays(router, logits)
    assert torch.equal(router(logits).ids, route_reference(logits, router).ids)


def test_routing_in_a_cuda_graph():
    router = _routers()["deepseek_v3"]
    hash_router = Router("deepseek_v4_hash", 256, 6, hash_table=torch.randint(0, 256, (1000, 6), device="cuda"))
    logits = torch.randn(32, 256, device="cuda")
    input_ids = torch.randint(0, 1000, (32,), device="cuda")
    router(logits), hash_router(logits, input_ids)  # warm-up: compiles, and checks the ids eagerly
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        routed, hashed = router(logits), hash_router(logits, input_ids)
    logits.copy_(torch.randn(32, 256, device="cuda"))
    graph.replay()
    assert torch.equal(routed.ids, route_reference(logits, router).ids)
    assert torch.equal(hashed.ids, route_reference(logits, hash_router, input_ids).ids)
