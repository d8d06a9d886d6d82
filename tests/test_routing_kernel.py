"""The fused Triton routing kernel against the reference, on CPU under TRITON_INTERPRET=1 (float32 logits).

Same ids exactly (ties towards the lower index) and weights within float32 rounding, for every routing
kind the kernel serves, M in (0, 1, 3, 33), with ties planted across the top-k boundary.
"""

from __future__ import annotations

import os
import shutil

if not shutil.which("nvidia-smi"):  # a CPU machine: the interpreter, before triton decorates any kernel
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("CPU-interpreter tests (TRITON_INTERPRET=1); on a GPU, tests/gpu/test_routing_gpu.py runs",
                allow_module_level=True)

from moe.router import Router  # noqa: E402
from moe.routing import ROUTING_KINDS  # noqa: E402
from moe.routing.fused import fused_pays, fused_route, fused_supports  # noqa: E402
from moe.routing.reference import route_reference  # noqa: E402


def _bias(width: int, seed: int, scale: float) -> torch.Tensor:
    return torch.randn(width, generator=torch.Generator().manual_seed(seed)) * scale


# One router per kind the kernel serves (all but the table selection), with the options that change its math.
ROUTERS = {
    "softmax": Router("softmax", 16, 4),
    "softmax-unnormalized": Router("softmax", 12, 3, renormalize=False, routed_scaling_factor=2.0),
    "gpt_oss": Router("gpt_oss", 16, 4),
    "deepseek_v3": Router("deepseek_v3", 32, 4, n_group=4, topk_group=2, correction_bias=_bias(32, 1, 0.1),
                          routed_scaling_factor=2.5),
    "deepseek_v3-unnormalized": Router("deepseek_v3", 24, 3, n_group=3, topk_group=1, renormalize=False),
    "deepseek_v4": Router("deepseek_v4", 20, 6, correction_bias=_bias(20, 2, 0.5), routed_scaling_factor=1.5),
    "llama4": Router("llama4", 16, 1),
    "llama4-k2": Router("llama4", 16, 2),
    "longcat_flash": Router("longcat_flash", 12, 4, num_zero_experts=6, correction_bias=_bias(18, 3, 0.01),
                            routed_scaling_factor=6.0),
}


def test_every_fusable_kind_is_covered():
    fusable = {name for name, kind in ROUTING_KINDS.items() if kind.selection != "table"}
    assert {router.routing for router in ROUTERS.values()} == fusable
    assert all(fused_supports(router) for router in ROUTERS.values())


def _logits_with_ties(router: Router, num_tokens: int, seed: int) -> torch.Tensor:
    """Random float32 logits; columns 1/2 and 5/9 equal (a tie of two experts the routing sees as equal
    wherever they share a bias, so the lower id must win), and one all-equal row."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, router.num_choices, generator=generator) * 3
    logits[:, 2] = logits[:, 1]
    logits[:, 9] = logits[:, 5]
    logits[num_tokens // 2] = 0.25
    return logits


@pytest.mark.parametrize("num_tokens", [1, 3, 33])
@pytest.mark.parametrize("name", list(ROUTERS))
def test_fused_matches_reference(name, num_tokens):
    router = ROUTERS[name]
    logits = _logits_with_ties(router, num_tokens, seed=num_tokens)
    fused, reference = fused_route(logits, router), route_reference(logits, router)
    assert fused.ids.tolist() == reference.ids.tolist()
    torch.testing.assert_close(fused.weights, reference.weights, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["deepseek_v3", "softmax"])
def test_fused_ties_take_the_lower_index(name):
    router = ROUTERS[name]
    topk = fused_route(torch.zeros(2, router.num_choices), router)
    # all equal: the first k experts (deepseek_v3's bias breaks the equality, so compare with the reference)
    assert topk.ids.tolist() == route_reference(torch.zeros(2, router.num_choices), router).ids.tolist()
    if name == "softmax":
        assert topk.ids.tolist() == [[0, 1, 2, 3]] * 2


def test_fused_tied_groups_take_the_lower_group():
    router = Router("deepseek_v3", 8, 2, n_group=4, topk_group=1)
    logits = torch.tensor([[1.0, 0.0, 0.0, 1.0, -1.0, -1.0, -2.0, -2.0]])  # g0 and g1 tie; g0 wins
    assert fused_route(logits, router).ids.tolist() == [[0, 1]]


def test_fused_sqrtsoftplus_keeps_tiny_scores():
    # softplus(-30) = 9.4e-14: a log(1 + e^x) without log1p care would give 0 and reorder the experts
    router = Router("deepseek_v4", 4, 2, renormalize=False)
    logits = torch.tensor([[-30.0, -31.0, -40.0, 25.0]])
    fused, reference = fused_route(logits, router), route_reference(logits, router)
    assert fused.ids.tolist() == reference.ids.tolist() == [[3, 0]]
    torch.testing.assert_close(fused.weights, reference.weights, rtol=2e-6, atol=0)


def test_fused_zero_tokens_and_strided_logits():
    router = ROUTERS["deepseek_v3"]
    assert fused_route(torch.empty(0, 32), router).ids.shape == (0, 4)
    wide = torch.randn(5, 64, generator=torch.Generator().manual_seed(4))[:, :32]  # row stride 64
    assert fused_route(wide, router).ids.tolist() == route_reference(wide, router).ids.tolist()


def test_router_uses_the_kernel_on_cuda_only():
    assert not fused_pays(ROUTERS["softmax"], torch.zeros(1, 16))  # CPU logits: the reference
    hash_router = Router("deepseek_v4_hash", 8, 2, hash_table=torch.zeros(4, 2, dtype=torch.long).add_(1))
    assert not fused_supports(hash_router)  # a table lookup: nothing to fuse
    assert not fused_supports(Router("softmax", 2048, 8))  # a row wider than one tile
