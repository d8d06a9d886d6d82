"""A torch.compile'd FusedMoE on a CUDA GPU: captured in a CUDA graph (torch.cuda.graph) and under
``mode="reduce-overhead"``, replays equal eager on new inputs, for the bf16 Triton layer and the default
plan; precomputed routing with validate=True captures too (the host read is skipped while capturing)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from moe import FusedMoE
from moe.custom_op import mark_tokens_dynamic
from moe.testing import assert_close_moe, cuda_checks

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_dynamo")]

# Qwen3-30B-A3B's k and activation, smaller E, H and I so a test compiles and runs in seconds
E, K, H, I, MAX_TOKENS = 32, 8, 1024, 384, 256
PLANS = {"triton": "triton", "default": None}


def make_layer(experts: str | None) -> FusedMoE:
    layer = FusedMoE(E, K, H, I, dtype=torch.bfloat16, device="cuda", max_tokens=MAX_TOKENS, experts=experts)
    gen = torch.Generator().manual_seed(0)
    layer.load_weights(w13=(torch.randn(E, 2 * I, H, generator=gen) / H**0.5).cuda(),
                       w2=(torch.randn(E, H, I, generator=gen) / I**0.5).cuda())
    return layer


def inputs(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, H, generator=gen).to("cuda", torch.bfloat16),
            torch.randn(tokens, E, generator=gen).cuda())


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("tokens", [1, 16, 200])
def test_compiled_layer_replays_in_a_cuda_graph_equal_to_eager(plan, tokens):
    layer = make_layer(PLANS[plan])
    compiled = torch.compile(layer, fullgraph=True)
    x, logits = inputs(tokens, seed=0)
    mark_tokens_dynamic(x, logits)
    assert_close_moe(compiled(x, logits).float(), layer(x, logits).float(), "bf16", context=f"{plan}, M={tokens}")

    def new_inputs():  # the graph reads the same tensors: new values in place
        fresh_x, fresh_logits = inputs(tokens, seed=1)
        x.copy_(fresh_x)
        logits.copy_(fresh_logits)

    replayed, error = cuda_checks.capture_and_replay(lambda: compiled(x, logits), new_inputs)
    assert error is None, f"capture or replay of the compiled layer failed: {error}"
    expected = layer(x, logits)
    assert_close_moe(replayed.float(), expected.float(), "bf16", context=f"{plan}, M={tokens}")
    assert not torch.equal(replayed, compiled(*inputs(tokens, seed=0)))  # the replay really used the new inputs


@pytest.mark.parametrize("plan", list(PLANS))
def test_precomputed_routing_with_validate_captures(plan):
    layer = make_layer(PLANS[plan])
    compiled = torch.compile(layer, fullgraph=True)
    x, logits = inputs(16, seed=0)
    topk = layer.router(logits)
    ids, weights = topk.ids.long(), topk.weights
    call = lambda: compiled(x, topk_ids=ids, topk_weights=weights, validate=True)  # noqa: E731

    def new_inputs():
        fresh = layer.router(inputs(16, seed=1)[1])
        ids.copy_(fresh.ids)
        weights.copy_(fresh.weights)

    replayed, error = cuda_checks.capture_and_replay(call, new_inputs)
    assert error is None, f"capture with validate=True failed: {error}"
    assert_close_moe(replayed.float(), layer(x, topk_ids=ids, topk_weights=weights).float(), "bf16")


@pytest.mark.parametrize("plan", list(PLANS))
def test_reduce_overhead_mode_matches_eager_without_recompiling(plan):
    layer = make_layer(PLANS[plan])
    compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
    for i, tokens in enumerate((1, 16, 200, 16, 1)):
        x, logits = inputs(tokens, seed=i)
        if i == 0:
            mark_tokens_dynamic(x, logits)
        out = compiled(x, logits).clone()  # cudagraph trees reuse the output's memory on the next replay
        assert_close_moe(out.float(), layer(x, logits).float(), "bf16", context=f"{plan}, M={tokens}")
    assert counters["stats"]["unique_graphs"] == 1
