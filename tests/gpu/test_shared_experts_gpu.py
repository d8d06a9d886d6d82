"""Shared experts on a second CUDA stream: equal to the sequential result, with the stream order right
(the side stream waits for its input, finalize waits for the side stream), no host sync, and the layer
captured in a CUDA graph and replayed."""

from __future__ import annotations

import pytest
import torch

from moe import FusedMoE, SharedExpertsConfig
from moe.testing import cuda_checks

pytestmark = pytest.mark.gpu

E, K, H, I, SHARED_I = 16, 4, 1024, 512, 1024
SLEEP_CYCLES = 50_000_000  # ~25 ms at 2 GHz: far longer than the layer, so a missing wait shows as garbage


def _layers(tokens: int):
    """A layer with its own shared experts, and one without them given the same weights."""
    def build(shared):
        return FusedMoE(E, K, H, I, dtype=torch.bfloat16, device="cuda", max_tokens=tokens, renormalize=True,
                        routed_scaling_factor=2.5, shared_experts=shared, experts="torch_grouped")
    with_shared, plain = build(SharedExpertsConfig(SHARED_I)), build(None)
    routed = dict(w13=torch.randn(E, 2 * I, H, device="cuda") / 32, w2=torch.randn(E, H, I, device="cuda") / 32)
    with_shared.load_weights(**routed)
    plain.load_weights(**routed)
    with_shared.shared_experts.load_weights(w13=torch.randn(2 * SHARED_I, H, device="cuda") / 32,
                                            w2=torch.randn(H, SHARED_I, device="cuda") / 32)
    return with_shared, plain


def _sequential(with_shared, plain, x, logits):
    return plain(x, logits, shared_output=with_shared.shared_experts(x))


@pytest.mark.parametrize("tokens", [1, 64, 1024])
def test_overlapped_equals_sequential_and_the_streams_wait_for_each_other(tokens):
    layer, plain = _layers(tokens)
    x, logits = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16), torch.randn(tokens, E, device="cuda")
    want = _sequential(layer, plain, x, logits)
    assert torch.equal(layer(x, logits), want)
    side = layer._shared_stream.stream
    assert side != torch.cuda.current_stream()
    # finalize must wait for the shared output: hold the side stream back; without the wait the layer
    # would add torch.empty's leftovers
    for _ in range(3):
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)
        assert torch.equal(layer(x, logits), want)
    # the side stream must wait for its input: produce the input after a long sleep on the layer's stream
    source = x.clone()
    for _ in range(3):
        torch.cuda._sleep(SLEEP_CYCLES)
        late = source * 1  # written only after the sleep
        assert torch.equal(layer(late, logits), want)


def test_no_host_sync_and_cuda_graph_capture():
    tokens = 64
    layer, plain = _layers(tokens)
    x, logits = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16), torch.randn(tokens, E, device="cuda")
    layer(x, logits)  # warm up (cuBLAS handles on both streams)
    out, error = cuda_checks.host_syncs(lambda: layer(x, logits))
    assert error is None, f"the layer with shared experts synchronizes with the host: {error}"

    def new_inputs():
        x.copy_(torch.randn_like(x))
        logits.copy_(torch.randn_like(logits))

    replayed, error = cuda_checks.capture_and_replay(lambda: layer(x, logits), new_inputs)
    assert error is None, f"capture or replay failed: {error}"
    assert torch.equal(replayed, _sequential(layer, plain, x, logits))  # the replay computed the new inputs
    assert not torch.equal(replayed, out)
