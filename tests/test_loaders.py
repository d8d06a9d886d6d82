"""Checkpoint layouts -> canonical ExpertWeights, on small hand-built checkpoints of every layout.

Expected canonical tensors are arranged here by explicit indexing, from the layout facts in
moe/loaders.py's docstring (taken from the transformers modeling code), never with the loader's
helpers.
"""

from __future__ import annotations

import pytest
import torch

from moe.errors import MoEConfigError
from moe.loaders import LAYOUTS, load_experts, requantize, to_layout
from moe.problem import MoEProblem
from moe.quant import QuantFormat

E, H, I = 3, 64, 32

# transformers.integrations.mxfp4.FP4_VALUES: the value of each e2m1 nibble.
FP4_LUT = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]

PER_EXPERT_NAMES = {
    "qwen3": ("gate_proj", "up_proj", "down_proj"),
    "deepseek": ("gate_proj", "up_proj", "down_proj"),
    "mixtral": ("w1", "w3", "w2"),
}
PREFIXES = {
    "qwen3": "model.layers.3.mlp.",
    "deepseek": "model.layers.7.mlp.",
    "mixtral": "model.layers.0.block_sparse_moe.",
}


def randn(*shape, seed, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def per_expert_checkpoint(layout, dtype=torch.bfloat16):
    """(tensors, gate [E, I, H], up [E, I, H], down [E, H, I]) in ``layout``'s keys."""
    gate, up, down = randn(E, I, H, seed=1, dtype=dtype), randn(E, I, H, seed=2, dtype=dtype), randn(
        E, H, I, seed=3, dtype=dtype
    )
    prefix, (gate_name, up_name, down_name) = PREFIXES[layout], PER_EXPERT_NAMES[layout]
    tensors = {"model.layers.3.mlp.gate.weight": randn(E, H, seed=4)}  # the router: not read
    for e in range(E):
        tensors[f"{prefix}experts.{e}.{gate_name}.weight"] = gate[e].clone()
        tensors[f"{prefix}experts.{e}.{up_name}.weight"] = up[e].clone()
        tensors[f"{prefix}experts.{e}.{down_name}.weight"] = down[e].clone()
    return tensors, gate, up, down


def canonical_w13(gate, up):
    expected = torch.empty(gate.shape[0], 2 * I, H, dtype=gate.dtype)
    expected[:, :I] = gate
    expected[:, I:] = up
    return expected


def gpt_oss_bf16_checkpoint(gate, up, w2, bias_gate, bias_up, b2, prefix="model.layers.5.mlp."):
    """HF GptOssExperts parameters from canonical pieces: gate/up interleaved along the last dim."""
    gate_up = torch.empty(E, H, 2 * I, dtype=gate.dtype)
    gate_up[:, :, 0::2] = gate.transpose(1, 2)
    gate_up[:, :, 1::2] = up.transpose(1, 2)
    gate_up_bias = torch.empty(E, 2 * I, dtype=bias_gate.dtype)
    gate_up_bias[:, 0::2] = bias_gate
    gate_up_bias[:, 1::2] = bias_up
    return {
        f"{prefix}experts.gate_up_proj": gate_up,
        f"{prefix}experts.gate_up_proj_bias": gate_up_bias,
        f"{prefix}experts.down_proj": w2.transpose(1, 2).contiguous(),  # [E, I, H]
        f"{prefix}experts.down_proj_bias": b2,
    }


def mxfp4_values(codes, exponents):
    """What transformers' convert_moe_packed_tensors decodes, before its final transpose."""
    lut = torch.tensor(FP4_LUT)
    scale = torch.exp2(exponents.float() - 127).repeat_interleave(32, dim=-1)
    return lut[codes.long()] * scale


def pack_blocks(codes):
    """[E, N, K] nibble codes -> [E, N, K/32, 16] bytes, element 2j in the low nibble of byte j."""
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.reshape(codes.shape[0], codes.shape[1], codes.shape[2] // 32, 16)


@pytest.fixture
def mxfp4_checkpoint():
    """(tensors, values13 [E, 2I, H] rows interleaved as stored, values2 [E, H, I], biases)."""
    g = torch.Generator().manual_seed(7)
    codes13 = torch.randint(0, 16, (E, 2 * I, H), generator=g, dtype=torch.uint8)
    codes2 = torch.randint(0, 16, (E, H, I), generator=g, dtype=torch.uint8)
    exponents13 = torch.randint(122, 133, (E, 2 * I, H // 32), generator=g, dtype=torch.uint8)
    exponents2 = torch.randint(122, 133, (E, H, I // 32), generator=g, dtype=torch.uint8)
    bias13, bias2 = randn(E, 2 * I, seed=8), randn(E, H, seed=9)
    prefix = "model.layers.5.mlp."
    tensors = {
        f"{prefix}experts.gate_up_proj_blocks": pack_blocks(codes13),
        f"{prefix}experts.gate_up_proj_scales": exponents13,
        f"{prefix}experts.gate_up_proj_bias": bias13,
        f"{prefix}experts.down_proj_blocks": pack_blocks(codes2),
        f"{prefix}experts.down_proj_scales": exponents2,
        f"{prefix}experts.down_proj_bias": bias2,
    }
    return tensors, mxfp4_values(codes13, exponents13), mxfp4_values(codes2, exponents2), bias13, bias2


def gpt_oss_dense_tensors(dtype=torch.bfloat16):
    """A gpt_oss bf16-form checkpoint without prefix."""
    gate, up = randn(E, I, H, seed=1, dtype=dtype), randn(E, I, H, seed=2, dtype=dtype)
    w2, b2 = randn(E, H, I, seed=3, dtype=dtype), randn(E, H, seed=6, dtype=dtype)
    bias_gate, bias_up = randn(E, I, seed=4, dtype=dtype), randn(E, I, seed=5, dtype=dtype)
    return gpt_oss_bf16_checkpoint(gate, up, w2, bias_gate, bias_up, b2, prefix="")


def poison(tensor, value):
    """A copy of ``tensor`` with one element (not the first) set to ``value``."""
    tensor = tensor.clone()
    tensor.view(-1)[tensor.numel() // 2 + 1] = value
    return tensor


def problem(**overrides):
    args = dict(num_experts=E, top_k=2, hidden_size=H, intermediate_size=I, quant="bf16")
    args.update(overrides)
    return MoEProblem.create(**args)


# --- qwen3 / deepseek / mixtral -------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["qwen3", "deepseek", "mixtral"])
def test_per_expert_layouts_load_exactly(layout):
    tensors, gate, up, down = per_expert_checkpoint(layout)
    weights = load_experts(tensors, layout, num_experts=E, prefix=PREFIXES[layout])
    assert weights.weight_format is QuantFormat.NONE and weights.w13.data.dtype == torch.bfloat16
    assert torch.equal(weights.w13.data, canonical_w13(gate, up))
    assert torch.equal(weights.w2.data, down)
    assert weights.b13 is None and weights.b2 is None
    weights.validate(problem())


def test_per_expert_layout_casts_to_dtype():
    tensors, gate, up, down = per_expert_checkpoint("qwen3")
    prefix = PREFIXES["qwen3"]
    weights = load_experts(tensors, "qwen3", num_experts=E, prefix=prefix, dtype=torch.float32)
    assert weights.w13.data.dtype == torch.float32
    assert torch.equal(weights.w13.data, canonical_w13(gate, up).float())


def test_mixtral_forward_matches_the_checkpoint_modules():
    """x -> w2(silu(w1 x) * w3 x), as MixtralBlockSparseTop2MLP computes it, per expert."""
    tensors, _, _, _ = per_expert_checkpoint("mixtral", dtype=torch.float32)
    prefix = PREFIXES["mixtral"]
    weights = load_experts(tensors, "mixtral", num_experts=E, prefix=prefix)
    x = randn(5, H, seed=11, dtype=torch.float32)
    for e in range(E):
        w1, w3, w2 = (tensors[f"{prefix}experts.{e}.{n}.weight"] for n in ("w1", "w3", "w2"))
        reference = torch.nn.functional.linear(torch.nn.functional.silu(x @ w1.T) * (x @ w3.T), w2)
        h = x @ weights.w13.data[e].T
        ours = (torch.nn.functional.silu(h[:, :I]) * h[:, I:]) @ weights.w2.data[e].T
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


# --- gpt_oss --------------------------------------------------------------------------------------


def test_gpt_oss_bf16_form_deinterleaves_and_transposes():
    gate, up, w2 = randn(E, I, H, seed=1), randn(E, I, H, seed=2), randn(E, H, I, seed=3)
    bias_gate, bias_up, b2 = randn(E, I, seed=4), randn(E, I, seed=5), randn(E, H, seed=6)
    tensors = gpt_oss_bf16_checkpoint(gate, up, w2, bias_gate, bias_up, b2)
    weights = load_experts(tensors, "gpt_oss", num_experts=E, prefix="model.layers.5.mlp.")
    assert weights.weight_format is QuantFormat.NONE and weights.w13.data.dtype == torch.bfloat16
    assert torch.equal(weights.w13.data, canonical_w13(gate, up))
    assert torch.equal(weights.w2.data, w2)
    expected_b13 = torch.empty(E, 2 * I)
    expected_b13[:, :I], expected_b13[:, I:] = bias_gate.float(), bias_up.float()
    assert torch.equal(weights.b13, expected_b13) and weights.b13.dtype == torch.float32
    assert torch.equal(weights.b2, b2.float())
    weights.validate(problem(activation="swiglu_oai", has_bias=True))


def test_gpt_oss_bf16_form_matches_the_transformers_forward():
    """GptOssExperts: gate_up = x @ gate_up_proj[e] + bias; gate, up = [..., ::2], [..., 1::2]."""
    tensors = gpt_oss_dense_tensors(dtype=torch.float32)
    weights = load_experts(tensors, "gpt_oss", num_experts=E)
    x = randn(5, H, seed=10, dtype=torch.float32)
    close = dict(rtol=1e-5, atol=1e-5)
    for e in range(E):
        hf = x @ tensors["experts.gate_up_proj"][e] + tensors["experts.gate_up_proj_bias"][e]
        ours = x @ weights.w13.data[e].T + weights.b13[e]
        torch.testing.assert_close(ours[:, :I], hf[..., ::2], **close)
        torch.testing.assert_close(ours[:, I:], hf[..., 1::2], **close)
        act = hf[..., ::2]
        hf_out = act @ tensors["experts.down_proj"][e] + tensors["experts.down_proj_bias"][e]
        torch.testing.assert_close(act @ weights.w2.data[e].T + weights.b2[e], hf_out, **close)


def test_gpt_oss_mxfp4_form_stays_mxfp4_and_dequantizes_to_the_lut_values(mxfp4_checkpoint):
    tensors, values13, values2, bias13, bias2 = mxfp4_checkpoint
    weights = load_experts(tensors, "gpt_oss", num_experts=E, prefix="model.layers.5.mlp.")
    assert weights.weight_format is QuantFormat.MXFP4
    assert weights.w13.data.shape == (E, 2 * I, H // 2)
    assert weights.w13.scale.shape == (E, 2 * I, H // 32)
    blocks = tensors["model.layers.5.mlp.experts.gate_up_proj_blocks"]
    scales = tensors["model.layers.5.mlp.experts.gate_up_proj_scales"]
    for i in range(I):  # canonical row i is stored row 2i (gate), row I + i is stored row 2i + 1 (up)
        assert torch.equal(weights.w13.data[:, i], blocks[:, 2 * i].reshape(E, H // 2))
        assert torch.equal(weights.w13.data[:, I + i], blocks[:, 2 * i + 1].reshape(E, H // 2))
        assert torch.equal(weights.w13.scale[:, i], scales[:, 2 * i])
        assert torch.equal(weights.w13.scale[:, I + i], scales[:, 2 * i + 1])
    expected13 = torch.empty(E, 2 * I, H)
    expected13[:, :I], expected13[:, I:] = values13[:, 0::2], values13[:, 1::2]
    got13, got2 = weights.dequantize()
    assert torch.equal(got13, expected13)
    assert torch.equal(got2, values2)
    expected_b13 = torch.cat([bias13[:, 0::2], bias13[:, 1::2]], dim=1).float()
    assert torch.equal(weights.b13, expected_b13) and torch.equal(weights.b2, bias2.float())
    weights.validate(problem(quant="mxfp4", activation="swiglu_oai", has_bias=True))


def test_gpt_oss_bf16_and_mxfp4_forms_agree(mxfp4_checkpoint):
    tensors, values13, values2, bias13, bias2 = mxfp4_checkpoint
    # The bf16 form, as transformers dequantizes it: [E, 2I, H] -> transpose(1, 2) -> [E, H, 2I].
    dense = {
        "experts.gate_up_proj": values13.transpose(1, 2).to(torch.bfloat16),
        "experts.gate_up_proj_bias": bias13,
        "experts.down_proj": values2.transpose(1, 2).to(torch.bfloat16),
        "experts.down_proj_bias": bias2,
    }
    from_mxfp4 = load_experts(tensors, "gpt_oss", num_experts=E, prefix="model.layers.5.mlp.")
    from_bf16 = load_experts(dense, "gpt_oss", num_experts=E)
    for got, want in zip(from_mxfp4.dequantize(), from_bf16.dequantize()):
        assert torch.equal(got, want)
    assert torch.equal(from_mxfp4.b13, from_bf16.b13) and torch.equal(from_mxfp4.b2, from_bf16.b2)


# --- errors ---------------------------------------------------------------------------------------


def test_unknown_layout_lists_the_layouts():
    message = r"unknown checkpoint layout 'llama4'; choose one of \('qwen3'"
    with pytest.raises(MoEConfigError, match=message):
        load_experts({}, "llama4", num_experts=E)
    assert LAYOUTS == ("qwen3", "deepseek", "mixtral", "gpt_oss", "nemotron_h", "transformers_fused",
                       "transformers_fused_transposed", "transformers_transposed")


@pytest.mark.parametrize("num_experts", [0, -1, 2.0, True])
def test_num_experts_must_be_a_positive_int(num_experts):
    with pytest.raises(MoEConfigError, match="num_experts must be a positive int"):
        load_experts({}, "qwen3", num_experts=num_experts)


@pytest.mark.parametrize("layout", ["qwen3", "deepseek", "mixtral"])
def test_missing_expert_key_is_named_with_its_layout(layout):
    tensors, _, _, _ = per_expert_checkpoint(layout)
    up = PER_EXPERT_NAMES[layout][1]
    key = f"{PREFIXES[layout]}experts.1.{up}.weight"
    del tensors[key]
    with pytest.raises(MoEConfigError, match=f"missing key '{key}', which the {layout} layout expects"):
        load_experts(tensors, layout, num_experts=E, prefix=PREFIXES[layout])


def test_wrong_prefix_reports_the_first_missing_key():
    tensors, _, _, _ = per_expert_checkpoint("qwen3")
    message = "missing key 'model.layers.4.mlp.experts.0.gate_proj.weight'"
    with pytest.raises(MoEConfigError, match=message):
        load_experts(tensors, "qwen3", num_experts=E, prefix="model.layers.4.mlp.")


def test_gpt_oss_without_either_form_names_both_keys():
    message = "missing key 'p.experts.gate_up_proj' or 'p.experts.gate_up_proj_blocks', which the gpt_oss"
    with pytest.raises(MoEConfigError, match=message):
        load_experts({"p.experts.down_proj": torch.zeros(1)}, "gpt_oss", num_experts=E, prefix="p.")


@pytest.mark.parametrize("key", ["down_proj_scales", "down_proj_blocks", "gate_up_proj_bias"])
def test_gpt_oss_mxfp4_missing_key(mxfp4_checkpoint, key):
    tensors = dict(mxfp4_checkpoint[0])
    full = f"model.layers.5.mlp.experts.{key}"
    del tensors[full]
    message = f"missing key '{full}', which the gpt_oss \\(MXFP4 form\\) layout expects"
    with pytest.raises(MoEConfigError, match=message):
        load_experts(tensors, "gpt_oss", num_experts=E, prefix="model.layers.5.mlp.")


def test_inconsistent_experts_name_key_expected_and_got():
    tensors, _, _, _ = per_expert_checkpoint("qwen3")
    key = "model.layers.3.mlp.experts.2.gate_proj.weight"
    tensors[key] = tensors[key][:16]
    message = (
        rf"'{key}': expected shape \[I, H\] = \(32, 64\) "
        r"\(as 'model.layers.3.mlp.experts.0.gate_proj.weight': every expert has the same sizes "
        r"and dtype\) \(got \(16, 64\)\)"
    )
    with pytest.raises(MoEConfigError, match=message):
        load_experts(tensors, "qwen3", num_experts=E, prefix="model.layers.3.mlp.")


@pytest.mark.parametrize(
    "key, change, message",
    [
        ("experts.1.w2.weight", lambda t: t.T, r"shape \[H, I\] = \(64, 32\) .*got \(32, 64\)"),
        ("experts.0.w1.weight", lambda t: t[None], r"shape \[I, H\] = \(\*, \*\) \(got \(1, 32, 64\)\)"),
        ("experts.0.w1.weight", lambda t: t.int(), r"dtype must be one of .*mixtral layout \(got torch.int32"),
        ("experts.2.w3.weight", lambda t: t.float(), r"dtype must be one of \(torch.bfloat16,\) for the"),
        ("experts.1.w3.weight", lambda t: t.to(torch.float8_e4m3fn), "dequantize fp8 checkpoints first"),
        ("experts.1.w2.weight", lambda t: poison(t, float("nan")), "contains NaN at load"),
        ("experts.2.w1.weight", lambda t: poison(t, float("inf")), "contains inf at load"),
    ],
)
def test_per_expert_bad_tensor_is_named(key, change, message):
    tensors, _, _, _ = per_expert_checkpoint("mixtral")
    full = PREFIXES["mixtral"] + key
    tensors[full] = change(tensors[full])
    with pytest.raises(MoEConfigError, match=f"'{full}'.*{message}"):
        load_experts(tensors, "mixtral", num_experts=E, prefix=PREFIXES["mixtral"])


def test_experts_beyond_num_experts_are_an_error():
    tensors, _, _, _ = per_expert_checkpoint("deepseek")
    message = r"found key 'model.layers.7.mlp.experts.2.gate_proj.weight' but num_experts=2"
    with pytest.raises(MoEConfigError, match=message):
        load_experts(tensors, "deepseek", num_experts=2, prefix=PREFIXES["deepseek"])





@pytest.mark.parametrize(
    "key, change, message",
    [
        ("experts.down_proj", lambda t: t.transpose(1, 2), r"\[E, I, H\] = \(3, 32, 64\) \(got \(3, 64, 32\)\)"),
        ("experts.gate_up_proj", lambda t: t[1:], r"\[E, H, 2I\] = \(3, \*, \*\) \(got \(2, 64, 64\)\)"),
        ("experts.gate_up_proj", lambda t: t[:, :, :63], "the gate/up dimension 2I=63 must be even"),
        ("experts.down_proj_bias", lambda t: t[:, :32], r"expected shape \[E, H\] = \(3, 64\)"),
        ("experts.gate_up_proj", lambda t: t.to(torch.int8), "dtype must be one of"),
        ("experts.gate_up_proj_bias", lambda t: poison(t, float("nan")), "contains NaN"),
    ],
)
def test_gpt_oss_bf16_bad_tensor_is_named(key, change, message):
    tensors = gpt_oss_dense_tensors()
    tensors[key] = change(tensors[key])
    with pytest.raises(MoEConfigError, match=f"'{key}'.*{message}"):
        load_experts(tensors, "gpt_oss", num_experts=E)


@pytest.mark.parametrize(
    "key, change, message",
    [
        ("gate_up_proj_blocks", lambda t: t[..., :8], r"shape \[E, 2I, H/32, 16\] = \(3, \*, \*, 16\)"),
        ("gate_up_proj_blocks", lambda t: t.float(), r"dtype must be one of \(torch.uint8,\)"),
        ("down_proj_scales", lambda t: t.to(torch.int8), r"dtype must be one of \(torch.uint8,\)"),
        ("down_proj_blocks", lambda t: t[:, :32], r"\[E, H, I/32, 16\] = \(3, 64, 1, 16\) \(got \(3, 32, 1, 16"),
        ("gate_up_proj_scales", lambda t: poison(t, 0xFF), r"contains NaN at load \(e8m0 byte 0xFF\)"),
        ("gate_up_proj_bias", lambda t: poison(t, float("inf")), "contains inf at load"),
    ],
)
def test_gpt_oss_mxfp4_bad_tensor_is_named(mxfp4_checkpoint, key, change, message):
    tensors = dict(mxfp4_checkpoint[0])
    full = f"model.layers.5.mlp.experts.{key}"
    tensors[full] = change(tensors[full])
    with pytest.raises(MoEConfigError, match=f"'{full}'.*{message}"):
        load_experts(tensors, "gpt_oss", num_experts=E, prefix="model.layers.5.mlp.")


def test_gpt_oss_mxfp4_needs_i_a_multiple_of_32(mxfp4_checkpoint):
    tensors = dict(mxfp4_checkpoint[0])
    key = "model.layers.5.mlp.experts.gate_up_proj_blocks"
    tensors[key] = tensors[key][:, :48]  # 2I = 48: I = 24
    with pytest.raises(MoEConfigError, match="2I=48 must be even, with I a multiple of 32"):
        load_experts(tensors, "gpt_oss", num_experts=E, prefix="model.layers.5.mlp.")


def test_gated_checkpoint_with_a_non_gated_activation_fails_validate():
    tensors, _, _, _ = per_expert_checkpoint("qwen3")
    weights = load_experts(tensors, "qwen3", num_experts=E, prefix=PREFIXES["qwen3"])
    with pytest.raises(MoEConfigError, match="w13 has 2I=64 rows .* but activation relu2 is not gated"):
        weights.validate(problem(activation="relu2"))


# --- requantize -----------------------------------------------------------------------------------


def test_requantize_is_a_no_op_when_the_format_matches(mxfp4_checkpoint):
    mxfp4 = load_experts(mxfp4_checkpoint[0], "gpt_oss", num_experts=E, prefix="model.layers.5.mlp.")
    assert requantize(mxfp4, "mxfp4") is mxfp4
    tensors, _, _, _ = per_expert_checkpoint("qwen3")
    bf16 = load_experts(tensors, "qwen3", num_experts=E, prefix=PREFIXES["qwen3"])
    assert requantize(bf16, "bf16") is bf16
    assert requantize(bf16, QuantFormat.NONE) is bf16


def test_requantize_mxfp4_to_bf16_is_exact(mxfp4_checkpoint):
    mxfp4 = load_experts(mxfp4_checkpoint[0], "gpt_oss", num_experts=E, prefix="model.layers.5.mlp.")
    bf16 = requantize(mxfp4, "bf16")
    assert bf16.weight_format is QuantFormat.NONE and bf16.w13.data.dtype == torch.bfloat16
    for got, want in zip(bf16.dequantize(), mxfp4.dequantize()):
        assert torch.equal(got, want)  # fp4 values times powers of two are exact in bf16
    assert torch.equal(bf16.b13, mxfp4.b13)


def test_requantize_bf16_to_fp8_and_to_fp32():
    tensors, _, _, _ = per_expert_checkpoint("qwen3")
    bf16 = load_experts(tensors, "qwen3", num_experts=E, prefix=PREFIXES["qwen3"])
    fp8 = requantize(bf16, "fp8")
    assert fp8.weight_format is QuantFormat.FP8_TENSOR
    for got, want in zip(fp8.dequantize(), bf16.dequantize()):
        assert float((got - want).norm() / want.norm()) <= 1 / 16
    fp32 = requantize(bf16, "fp32")
    assert fp32.w13.data.dtype == torch.float32 and torch.equal(fp32.w13.data, bf16.w13.data.float())


# --- transformers' layouts: nemotron_h as saved, the fused forms as held in memory ------------------------
def test_nemotron_h_loads_non_gated_up_and_down():
    up, down = randn(E, I, H, seed=1), randn(E, H, I, seed=2)
    prefix = "backbone.layers.0.mixer."
    tensors = {f"{prefix}experts.{e}.{n}.weight": t[e].clone() for e in range(E) for n, t in (("up_proj", up),
                                                                                              ("down_proj", down))}
    weights = load_experts(tensors, "nemotron_h", num_experts=E, prefix=prefix)
    assert torch.equal(weights.w13.data, up) and torch.equal(weights.w2.data, down)  # w13 [E, I, H]: non-gated
    with pytest.raises(MoEConfigError, match="keys look like the 'nemotron_h' layout"):
        load_experts(tensors, "qwen3", num_experts=E, prefix=prefix)


def test_transformers_fused_is_the_canonical_layout_without_a_copy():
    gate_up, down = randn(E, 2 * I, H, seed=1), randn(E, H, I, seed=2)
    tensors = {"mlp.experts.gate_up_proj": gate_up, "mlp.experts.down_proj": down}
    weights = load_experts(tensors, "transformers_fused", num_experts=E, prefix="mlp.")
    assert weights.w13.data.data_ptr() == gate_up.data_ptr() and weights.w2.data.data_ptr() == down.data_ptr()
    assert weights.b13 is None and weights.b2 is None
    non_gated = load_experts({"experts.up_proj": gate_up[:, :I].contiguous(), "experts.down_proj": down},
                             "transformers_fused", num_experts=E)
    assert torch.equal(non_gated.w13.data, gate_up[:, :I])
    with pytest.raises(MoEConfigError, match=r"'experts.down_proj': expected shape \[E, H, I\]"):
        load_experts({"experts.gate_up_proj": gate_up, "experts.down_proj": down.transpose(1, 2)},
                     "transformers_fused", num_experts=E)


@pytest.mark.parametrize("with_bias", [True, False])
def test_transformers_fused_transposed_deinterleaves_and_writes_back(with_bias):
    gate, up, w2 = randn(E, I, H, seed=1), randn(E, I, H, seed=2), randn(E, H, I, seed=3)
    bias_gate, bias_up, b2 = randn(E, I, seed=4), randn(E, I, seed=5), randn(E, H, seed=6)
    tensors = gpt_oss_bf16_checkpoint(gate, up, w2, bias_gate, bias_up, b2, prefix="")
    if not with_bias:
        tensors = {k: v for k, v in tensors.items() if not k.endswith("_bias")}
    weights = load_experts(tensors, "transformers_fused_transposed", num_experts=E)
    assert torch.equal(weights.w13.data, canonical_w13(gate, up)) and torch.equal(weights.w2.data, w2)
    assert (weights.b13 is not None) is with_bias
    back = to_layout(weights, "transformers_fused_transposed", dtype=torch.bfloat16)
    assert back.keys() == tensors.keys()
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)


@pytest.mark.parametrize("gated", [True, False])
def test_transformers_transposed_reads_x_at_w_halves_and_writes_back(gated):
    """OpenAI's privacy filter ([gate | up] halves) and Ergo (no gate): the canonical tensors, transposed."""
    rows = 2 * I if gated else I
    w13, w2, b13, b2 = randn(E, rows, H, seed=1), randn(E, H, I, seed=2), randn(E, rows, seed=3), randn(E, H, seed=4)
    first = "experts.gate_up_proj" if gated else "experts.up_proj"
    tensors = {first: w13.transpose(1, 2).contiguous(), "experts.down_proj": w2.transpose(1, 2).contiguous(),
               first + "_bias": b13, "experts.down_proj_bias": b2}
    weights = load_experts(tensors, "transformers_transposed", num_experts=E)
    assert torch.equal(weights.w13.data, w13) and torch.equal(weights.w2.data, w2)  # no interleaving undone
    assert torch.equal(weights.b13, b13) and torch.equal(weights.b2, b2)
    back = to_layout(weights, "transformers_transposed", dtype=torch.float32)
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)
    with pytest.raises(MoEConfigError, match=r"'experts.down_proj': expected shape \[E, I, H\]"):
        load_experts({**tensors, "experts.down_proj": w2}, "transformers_transposed", num_experts=E)


def test_to_layout_names_the_layouts_it_writes():
    weights = load_experts({"experts.up_proj": randn(E, I, H, seed=1), "experts.down_proj": randn(E, H, I, seed=2)},
                           "transformers_fused", num_experts=E)
    assert set(to_layout(weights, "transformers_fused", dtype=torch.float32)) == {"experts.up_proj",
                                                                                   "experts.down_proj"}
    with pytest.raises(MoEConfigError, match="to_layout writes"):
        to_layout(weights, "mixtral", dtype=torch.float32)
