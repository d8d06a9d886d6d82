"""FusedMoE end to end: loading, forward against independent float32 math, and its errors."""

from __future__ import annotations

import pytest
import torch

from moe import FusedMoE, MoEConfigError, UnsupportedError
from moe.testing import assert_close_moe

E, K, H, I = 4, 2, 64, 32

# e2m1 magnitudes by 3-bit code (the OCP MX table); bit 3 is the sign
FP4_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_forward_matches_direct_float32_math():
    layer = FusedMoE(E, K, H, I, dtype=torch.float32, quant="fp32")
    w13, w2 = torch.randn(E, 2 * I, H) / 8, torch.randn(E, H, I) / 6
    layer.load_weights(w13=w13, w2=w2)
    x, logits = torch.randn(5, H), torch.randn(5, E)
    out = layer(x, logits)
    probs = logits.softmax(-1)
    expected = torch.zeros(5, H)
    for t in range(5):
        weights, ids = probs[t].topk(K)
        weights = weights / weights.sum()
        for w, e in zip(weights, ids):
            gate, up = (w13[e] @ x[t]).chunk(2)
            expected[t] += w * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    assert_close_moe(out, expected, "fp32")


def test_precomputed_routing_is_used_as_given():
    """Model code that routes itself: its ids and weights (int64, low precision, not summing to 1,
    repeated experts) drive the experts exactly; the same as the TopK form and as a hand loop."""
    layer = FusedMoE(E, K, H, I, dtype=torch.float32, quant="fp32", routed_scaling_factor=2.5)
    w13, w2 = torch.randn(E, 2 * I, H) / 8, torch.randn(E, H, I) / 6
    layer.load_weights(w13=w13, w2=w2)
    x = torch.randn(4, H)
    ids = torch.tensor([[3, 0], [1, 1], [2, 3], [0, 2]])  # int64, as transformers' routers return them
    weights = torch.tensor([[0.7, 0.1], [0.5, 0.25], [1.5, -0.5], [0.0, 1.0]], dtype=torch.float16)
    out = layer(x, topk_ids=ids, topk_weights=weights)
    expected = torch.zeros(4, H)
    for t in range(4):
        for e, w in zip(ids[t].tolist(), weights[t].float()):
            gate, up = (w13[e] @ x[t]).chunk(2)
            expected[t] += w * (w2[e] @ (torch.nn.functional.silu(gate) * up))  # no routed scaling factor
    assert_close_moe(out, expected, "fp32")
    from moe import TopK
    same = layer(x, topk=TopK(ids.to(torch.int32), weights.float()))
    torch.testing.assert_close(same, out, rtol=0, atol=0)


def test_precomputed_routing_of_the_layer_router_equals_routing_logits():
    layer = FusedMoE(E, K, H, I, dtype=torch.float32, quant="fp32", routing="deepseek_v3", n_group=2, topk_group=1)
    layer.load_weights(w13=torch.randn(E, 2 * I, H) / 8, w2=torch.randn(E, H, I) / 6)
    x, logits = torch.randn(7, H), torch.randn(7, E)
    topk = layer.router(logits)
    torch.testing.assert_close(layer(x, topk=topk), layer(x, logits), rtol=0, atol=0)
    torch.testing.assert_close(layer(x, topk_ids=topk.ids, topk_weights=topk.weights, validate=False),
                               layer(x, logits), rtol=0, atol=0)


def _fp4_dequant_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """GPT-OSS ``*_blocks [E, R, G, 16]`` + ``*_scales [E, R, G]`` -> float32 ``[E, R, G*32]``, by the table."""
    lut = torch.tensor(FP4_VALUES + [-v for v in FP4_VALUES])
    lo, hi = (blocks & 0xF).long(), (blocks >> 4).long()
    values = torch.stack([lut[lo], lut[hi]], dim=-1).flatten(-2)  # element 2j = low nibble
    values = values * torch.exp2(scales.float() - 127).unsqueeze(-1)
    return values.flatten(-2)


def test_gpt_oss_shaped_layer_mxfp4_bias_swiglu_oai():
    """A GPT-OSS checkpoint (MXFP4 blocks, interleaved gate/up rows, biases) through load_checkpoint,
    against float32 math written here from the checkpoint's own conventions."""
    g = torch.Generator().manual_seed(1)
    blocks13 = torch.randint(0, 256, (E, 2 * I, H // 32, 16), dtype=torch.uint8, generator=g)
    scales13 = torch.randint(120, 124, (E, 2 * I, H // 32), dtype=torch.uint8, generator=g)
    blocks2 = torch.randint(0, 256, (E, H, I // 32, 16), dtype=torch.uint8, generator=g)
    scales2 = torch.randint(120, 124, (E, H, I // 32), dtype=torch.uint8, generator=g)
    bias13, bias2 = 0.1 * torch.randn(E, 2 * I, generator=g), 0.1 * torch.randn(E, H, generator=g)
    checkpoint = {
        "mlp.experts.gate_up_proj_blocks": blocks13, "mlp.experts.gate_up_proj_scales": scales13,
        "mlp.experts.gate_up_proj_bias": bias13, "mlp.experts.down_proj_blocks": blocks2,
        "mlp.experts.down_proj_scales": scales2, "mlp.experts.down_proj_bias": bias2,
    }
    layer = FusedMoE(E, K, H, I, activation="swiglu_oai", quant="mxfp4", routing="gpt_oss", has_bias=True)
    layer.load_checkpoint(checkpoint, "gpt_oss", prefix="mlp.")
    x = torch.randn(7, H, generator=g).to(torch.bfloat16)
    logits = torch.randn(7, E, generator=g)
    out = layer(x, logits)

    w13, w2 = _fp4_dequant_blocks(blocks13, scales13), _fp4_dequant_blocks(blocks2, scales2)
    expected = torch.zeros(7, H)
    for t in range(7):
        top, ids = logits[t].topk(K)
        for w, e in zip(top.softmax(-1), ids):
            h = w13[e] @ x[t].float() + bias13[e]
            gate, up = h[0::2].clamp(max=7.0), h[1::2].clamp(-7.0, 7.0)  # interleaved rows
            a = gate * torch.sigmoid(1.702 * gate) * (up + 1.0)
            expected[t] += w * (w2[e] @ a + bias2[e])
    assert layer.weights.weight_format.value == "mxfp4"
    assert_close_moe(out.float(), expected, "bf16")


@pytest.mark.parametrize("layout,names", [("qwen3", ("gate_proj", "up_proj", "down_proj")), ("mixtral", ("w1", "w3", "w2"))])
def test_load_checkpoint_equals_load_weights(layout, names):
    w13, w2 = torch.randn(E, 2 * I, H) / 8, torch.randn(E, H, I) / 6
    tensors = {}
    for e in range(E):
        tensors[f"experts.{e}.{names[0]}.weight"] = w13[e, :I]
        tensors[f"experts.{e}.{names[1]}.weight"] = w13[e, I:]
        tensors[f"experts.{e}.{names[2]}.weight"] = w2[e]
    a, b = FusedMoE(E, K, H, I), FusedMoE(E, K, H, I)
    a.load_weights(w13=w13, w2=w2)
    b.load_checkpoint(tensors, layout)
    x, logits = torch.randn(6, H).to(torch.bfloat16), torch.randn(6, E)
    assert torch.equal(a(x, logits), b(x, logits))


def test_quantized_layer_runs_on_cpu_through_reference():
    layer = FusedMoE(E, K, H, I, quant="fp8_block")
    layer.load_weights(w13=torch.randn(E, 2 * I, H) / 8, w2=torch.randn(E, H, I) / 6)
    assert layer.kernel.experts.name == "reference"
    assert layer(torch.randn(3, H).to(torch.bfloat16), torch.randn(3, E)).shape == (3, H)


def test_layer_picks_torch_grouped_for_bf16_on_cpu_and_reports_it():
    layer = FusedMoE(E, K, H, I)
    assert repr(layer.kernel) == "ModularKernel(local + torch_grouped)"
    assert "kernel=ModularKernel(local + torch_grouped)" in repr(layer)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(activation="swish"), MoEConfigError, "activation must be one of"),
        (dict(quant="int2"), MoEConfigError, "int2"),
        (dict(routing="hash"), MoEConfigError, "hash"),
        (dict(top_k=5), MoEConfigError, "top_k must be <= num_experts"),
        (dict(routing="softmax", n_group=2), MoEConfigError, "n_group"),
        (dict(experts="nonexistent"), MoEConfigError, "unknown experts backend 'nonexistent'"),
        (dict(experts="torch_grouped", quant="fp8"), UnsupportedError, "quant fp8_tensor"),
    ],
)
def test_construction_errors(kwargs, error, match):
    args = dict(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        FusedMoE(**args)


def test_load_errors():
    layer = FusedMoE(E, K, H, I, dtype=torch.float32, quant="fp32")
    with pytest.raises(MoEConfigError, match="no weights"):
        layer(torch.randn(2, H), torch.randn(2, E))
    bad = torch.randn(E, 2 * I, H)
    bad[1, 2, 3] = float("nan")
    with pytest.raises(MoEConfigError, match="w13.*NaN"):
        layer.load_weights(w13=bad, w2=torch.randn(E, H, I))
    relu2 = FusedMoE(E, K, H, I, activation="relu2", dtype=torch.float32, quant="fp32")
    with pytest.raises(MoEConfigError, match="relu2|non-gated|rows"):
        relu2.load_weights(w13=torch.randn(E, 2 * I, H), w2=torch.randn(E, H, I))
    with pytest.raises(MoEConfigError, match="w2"):
        layer.load_weights(w13=torch.randn(E, 2 * I, H), w2=torch.randn(E, H, I + 1))
    with pytest.raises(MoEConfigError, match="experts.0.gate_proj.weight"):
        layer.load_checkpoint({}, "qwen3")


def test_forward_errors():
    layer = FusedMoE(E, K, H, I, dtype=torch.float32, quant="fp32")
    layer.load_weights(w13=torch.randn(E, 2 * I, H), w2=torch.randn(E, H, I))
    with pytest.raises(MoEConfigError, match=r"router_logits must be \[M, num_experts\]"):
        layer(torch.randn(3, H), torch.randn(2, E))
    with pytest.raises(MoEConfigError, match="num_experts|last dim"):
        layer(torch.randn(3, H), torch.randn(3, E + 1))
    with pytest.raises(MoEConfigError, match=r"hidden_states must be torch.float32.*\(got torch.float16\)"):
        layer(torch.randn(3, H).half(), torch.randn(3, E))


def test_non_gated_relu2_layer():
    layer = FusedMoE(E, K, H, I, activation="relu2", dtype=torch.float32, quant="fp32")
    w13, w2 = torch.randn(E, I, H) / 8, torch.randn(E, H, I) / 6
    layer.load_weights(w13=w13, w2=w2)
    x, logits = torch.randn(1, H), torch.randn(1, E)
    weights, ids = logits[0].softmax(-1).topk(K)
    weights = weights / weights.sum()
    expected = sum(w * (w2[e] @ torch.relu(w13[e] @ x[0]).square()) for w, e in zip(weights, ids))
    assert_close_moe(layer(x, logits)[0], expected, "fp32")


def test_workspace_is_reserved_at_load_and_does_not_grow():
    layer = FusedMoE(E, K, H, I, max_tokens=32)
    layer.load_weights(w13=torch.randn(E, 2 * I, H) / 8, w2=torch.randn(E, H, I) / 6)
    reserved = layer.kernel.workspace.reserved_bytes
    assert reserved == layer.kernel.workspace_bytes(32) > 0
    for m in (1, 7, 32):
        layer(torch.randn(m, H).to(torch.bfloat16), torch.randn(m, E))
    assert layer.kernel.workspace.reserved_bytes == reserved


def test_what_each_bucket_runs_is_decided_at_construction(monkeypatch):
    """Whether a bucket's kernel routes from the logits is decided once, not asked on every forward."""
    from moe.kernel import ModularKernel

    layer = FusedMoE(E, K, H, I, dtype=torch.float32, quant="fp32")
    layer.load_weights(w13=torch.randn(E, 2 * I, H) / 8, w2=torch.randn(E, H, I) / 6)
    x, logits = torch.randn(3, H), torch.randn(3, E)
    before = layer(x, logits)
    monkeypatch.setattr(ModularKernel, "routes_in_kernel", lambda self, router: pytest.fail("asked per forward"))
    torch.testing.assert_close(layer(x, logits), before)


def test_each_kernel_owns_its_prepared_weights():
    layer = FusedMoE(E, K, H, I, dtype=torch.float32, quant="fp32", experts="reference")
    with pytest.raises(MoEConfigError, match=r"has no weights: call kernel.load\(weights\)"):
        layer.kernel.prepared_weights
    layer.load_weights(w13=torch.randn(E, 2 * I, H) / 8, w2=torch.randn(E, H, I) / 6)
    assert isinstance(layer.kernel.prepared_weights, layer.kernel.experts.prepared_type)
    assert not hasattr(layer, "_prepared")
