"""ExpertWeights: construction from dense tensors, round trips per format, validation, subsets."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe.errors import MoEConfigError
from moe.problem import MoEProblem, ParallelConfig
from moe.quant import QuantFormat, QuantScheme
from moe.weights import ExpertWeights

E, H, I = 3, 64, 32

# Normwise relative error ||dequantize(quantize(w)) - w|| / ||w|| allowed per weight format, for
# Gaussian weights: e4m3 keeps 3 mantissa bits (relative step 1/8, so error <= 1/16 per element);
# e2m1 keeps 1 (the grid 0, .5, 1, 1.5, 2, 3, 4, 6), so fp4 is allowed 1/5. Measured on these
# shapes: fp8 formats 0.024-0.027, nvfp4 0.096, mxfp4 0.115.
ROUND_TRIP_TOLERANCE = {
    QuantFormat.FP8_TENSOR: 1 / 16,
    QuantFormat.FP8_ROW: 1 / 16,
    QuantFormat.FP8_BLOCK: 1 / 16,
    QuantFormat.MXFP8: 1 / 16,
    QuantFormat.MXFP4: 1 / 5,
    QuantFormat.NVFP4: 1 / 5,
}


def dense(experts=E, hidden=H, inter=I, rows=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = 2 * inter if rows is None else rows
    w13 = torch.randn(experts, rows, hidden, generator=g).to(dtype)
    w2 = torch.randn(experts, hidden, inter, generator=g).to(dtype)
    b13 = torch.randn(experts, rows, generator=g)
    b2 = torch.randn(experts, hidden, generator=g)
    return w13, w2, b13, b2


def problem(**overrides):
    args = dict(num_experts=E, top_k=2, hidden_size=H, intermediate_size=I, quant="fp32")
    args.update(overrides)
    return MoEProblem.create(**args)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


# --- from_dense -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_unquantized_round_trip_is_bit_exact(dtype):
    w13, w2, b13, b2 = dense(dtype=dtype)
    weights = ExpertWeights.from_dense(w13, w2, b13, b2)
    assert weights.weight_format is QuantFormat.NONE
    assert weights.w13.data.dtype == dtype and weights.w13.scale is None
    got13, got2 = weights.dequantize(dtype)
    assert torch.equal(got13, w13) and torch.equal(got2, w2)
    assert torch.equal(weights.b13, b13) and torch.equal(weights.b2, b2)
    assert weights.b13.dtype == torch.float32


def test_properties():
    w13, w2, b13, b2 = dense()
    weights = ExpertWeights.from_dense(w13, w2, b13, b2, quant="mxfp4")
    assert weights.w13.data.shape == (E, 2 * I, H // 2)  # packed: H halved
    assert (weights.num_experts, weights.hidden_size, weights.w13_rows) == (E, H, 2 * I)
    assert weights.intermediate_size == I  # unpacked, although w2.data is [E, H, I/2]
    assert weights.weight_format is QuantFormat.MXFP4
    assert weights.device == torch.device("cpu")
    assert weights.has_bias and not ExpertWeights.from_dense(w13, w2).has_bias


@pytest.mark.parametrize("fmt", list(ROUND_TRIP_TOLERANCE))
def test_quantized_round_trip_within_format_tolerance(fmt):
    w13, w2, b13, b2 = dense()
    weights = ExpertWeights.from_dense(w13, w2, b13, b2, quant=fmt)
    assert weights.weight_format is fmt and weights.w2.fmt is fmt
    got13, got2 = weights.dequantize()
    assert got13.shape == w13.shape and got2.shape == w2.shape
    assert relative_error(got13, w13) <= ROUND_TRIP_TOLERANCE[fmt]
    assert relative_error(got2, w2) <= ROUND_TRIP_TOLERANCE[fmt]
    assert torch.equal(weights.b13, b13)  # biases are never quantized


@pytest.mark.parametrize(
    "quant, fmt",
    [
        ("fp8", QuantFormat.FP8_TENSOR),
        ("fp8_token", QuantFormat.FP8_ROW),
        ("fp8_block", QuantFormat.FP8_BLOCK),
        ("mxfp8", QuantFormat.MXFP8),
        ("mxfp4", QuantFormat.MXFP4),
        ("nvfp4", QuantFormat.NVFP4),
        (QuantScheme.from_name("mxfp4", act_quant="mxfp8"), QuantFormat.MXFP4),
        ("fp8_row", QuantFormat.FP8_ROW),  # a format name works too
    ],
)
def test_quant_argument_picks_the_weight_format(quant, fmt):
    w13, w2, _, _ = dense()
    assert ExpertWeights.from_dense(w13, w2, quant=quant).weight_format is fmt


def test_dtype_names_and_dtype_argument():
    w13, w2, _, _ = dense()
    assert ExpertWeights.from_dense(w13, w2, quant="bf16").w13.data.dtype == torch.bfloat16
    assert ExpertWeights.from_dense(w13, w2, dtype=torch.float16).w2.data.dtype == torch.float16
    with pytest.raises(MoEConfigError, match="quant='bf16'.*dtype=torch.float16"):
        ExpertWeights.from_dense(w13, w2, quant="bf16", dtype=torch.float16)
    with pytest.raises(MoEConfigError, match="quant: 'int4'"):
        ExpertWeights.from_dense(w13, w2, quant="int4")
    with pytest.raises(MoEConfigError, match="dtype must be one of"):
        ExpertWeights.from_dense(w13, w2, dtype=torch.int8)


def test_non_gated_weights_have_i_rows():
    w13, w2, _, _ = dense(rows=I)
    weights = ExpertWeights.from_dense(w13, w2)
    assert weights.w13_rows == I
    weights.validate(problem(activation="relu2"))


def test_tiny_shapes():
    w13, w2, b13, b2 = dense(experts=1, hidden=32, inter=32)
    for fmt in ROUND_TRIP_TOLERANCE:
        weights = ExpertWeights.from_dense(w13, w2, b13, b2, quant=fmt)
        assert weights.num_experts == 1 and weights.intermediate_size == 32


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t: {**t, "w13": t["w13"][0]}, r"w13: must be 3-D \(got shape \(64, 64\)\)"),
        (lambda t: {**t, "w2": t["w2"][:2]}, r"w2: expected shape \[E=3, H=64, I\]"),
        (lambda t: {**t, "w2": t["w2"][:, :32]}, r"w2: expected shape \[E=3, H=64, I\]"),
        (lambda t: {**t, "w13": t["w13"][:, :40]}, r"w13: rows R must be 2I=64 .* or I=32 .*got R=40"),
        (lambda t: {**t, "b13": t["b13"][:, :32]}, r"b13: expected shape \[3, 64\] \(got \[3, 32\]\)"),
        (lambda t: {**t, "b2": t["b2"][None]}, r"b2: must be 2-D"),
        (lambda t: {**t, "w2": t["w2"].to(torch.int32)}, r"w2: dtype must be one of .*got torch.int32"),
        (lambda t: {**t, "w13": t["w13"].double()}, r"w13: dtype must be one of .*got torch.float64"),
        (lambda t: {**t, "w13": "weights"}, r"w13: expected a torch.Tensor \(got str\)"),
    ],
)
def test_from_dense_rejects_bad_shapes_and_dtypes(change, message):
    w13, w2, b13, b2 = dense()
    tensors = change({"w13": w13, "w2": w2, "b13": b13, "b2": b2})
    with pytest.raises(MoEConfigError, match=message):
        ExpertWeights.from_dense(**tensors)


@pytest.mark.parametrize("name", ["w13", "w2", "b13", "b2"])
@pytest.mark.parametrize("value, what", [(float("nan"), "NaN"), (float("inf"), "inf")])
def test_from_dense_rejects_nan_and_inf_naming_the_tensor(name, value, what):
    tensors = dict(zip(("w13", "w2", "b13", "b2"), dense()))
    tensors[name].view(-1)[5] = value
    with pytest.raises(MoEConfigError, match=f"^{name} contains {what} at load"):
        ExpertWeights.from_dense(**tensors, quant="mxfp4")


def test_from_dense_rejects_k_not_a_multiple_of_the_scale_block():
    w13, w2, _, _ = dense(hidden=48)
    with pytest.raises(MoEConfigError, match="hidden_size H must be a multiple of 32 .*mxfp4 .*got 48"):
        ExpertWeights.from_dense(w13, w2, quant="mxfp4")
    w13, w2, _, _ = dense(inter=24)
    with pytest.raises(MoEConfigError, match="intermediate_size I must be a multiple of 16 .*nvfp4"):
        ExpertWeights.from_dense(w13, w2, quant="nvfp4")


def test_constructor_checks_formats_and_types():
    w13, w2, _, _ = dense()
    fp8 = ExpertWeights.from_dense(w13, w2, quant="fp8")
    mx = ExpertWeights.from_dense(w13, w2, quant="mxfp4")
    with pytest.raises(MoEConfigError, match="w13 and w2 must share one format"):
        ExpertWeights(fp8.w13, mx.w2)
    with pytest.raises(MoEConfigError, match="w13: expected a QuantizedTensor .*from_dense"):
        ExpertWeights(w13, mx.w2)
    with pytest.raises(MoEConfigError, match="b2: must be a float32 tensor"):
        ExpertWeights(mx.w13, mx.w2, None, torch.zeros(E, H, dtype=torch.bfloat16))


# --- validate -------------------------------------------------------------------------------------


def test_validate_accepts_matching_weights():
    w13, w2, b13, b2 = dense()
    ExpertWeights.from_dense(w13, w2).validate(problem())
    ExpertWeights.from_dense(w13, w2, b13, b2, quant="mxfp4").validate(
        problem(quant="mxfp4", activation="swiglu_oai", has_bias=True)
    )
    ExpertWeights.from_dense(w13, w2, quant="nvfp4").validate(problem(quant="nvfp4"))


def test_validate_rejects_gated_rows_for_a_non_gated_activation():
    w13, w2, _, _ = dense()  # 2I rows [gate; up]
    message = r"w13 has 2I=64 rows \(\[gate; up\]\) but activation relu2 is not gated"
    with pytest.raises(MoEConfigError, match=message):
        ExpertWeights.from_dense(w13, w2).validate(problem(activation="relu2"))


def test_validate_rejects_i_rows_for_a_gated_activation():
    w13, w2, _, _ = dense(rows=I)
    message = r"w13 has I=32 rows but activation silu is gated and needs 2I=64"
    with pytest.raises(MoEConfigError, match=message):
        ExpertWeights.from_dense(w13, w2).validate(problem())


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(num_experts=4), r"num_experts \(local\): the weights have 3, the problem 4"),
        (dict(hidden_size=128), "hidden_size H: the weights have 64, the problem 128"),
        (dict(intermediate_size=16), "intermediate_size I: the weights have 32, the problem 16"),
        (dict(has_bias=True), "biases: problem.has_bias=True needs both b13 and b2 .*have none"),
        (dict(quant="fp8"), "weight format: the weights are none but problem.quant.weight is fp8_t"),
        (dict(quant="bf16"), "weights are torch.float32 but problem.dtype is torch.bfloat16"),
        (dict(num_experts=6, parallel=ParallelConfig(ep_size=3, ep_rank=1)), "have 3, the problem 2"),
    ],
)
def test_validate_names_each_mismatch(overrides, message):
    w13, w2, _, _ = dense()
    with pytest.raises(MoEConfigError, match=message):
        ExpertWeights.from_dense(w13, w2).validate(problem(**overrides))


def test_validate_lists_every_mismatch_at_once():
    w13, w2, b13, b2 = dense()
    with pytest.raises(MoEConfigError) as error:
        ExpertWeights.from_dense(w13, w2, b13, b2).validate(problem(hidden_size=128, quant="fp8"))
    text = str(error.value)
    assert "hidden_size H" in text and "weight format" in text and "has_bias=False" in text


def test_validate_rejects_wrong_scale_shapes():
    w13, w2, _, _ = dense()
    weights = ExpertWeights.from_dense(w13, w2, quant="mxfp4")
    bad_scale = dataclasses.replace(weights.w2, scale=weights.w2.scale[:, :, :0])
    message = r"w2.scale: expected shape \(3, 64, 1\) for mxfp4 \(got \(3, 64, 0\)\)"
    with pytest.raises(MoEConfigError, match=message):
        dataclasses.replace(weights, w2=bad_scale).validate(problem(quant="mxfp4"))


# --- to / select_experts --------------------------------------------------------------------------


def test_to_device_keeps_everything():
    w13, w2, b13, b2 = dense()
    weights = ExpertWeights.from_dense(w13, w2, b13, b2, quant="nvfp4")
    moved = weights.to("cpu")
    assert moved.device == torch.device("cpu")
    for name in ("data", "scale", "global_scale"):
        assert torch.equal(getattr(moved.w13, name).float(), getattr(weights.w13, name).float())
    assert torch.equal(moved.b2, b2)


@pytest.mark.parametrize("quant", ["fp32", "fp8", "fp8_token", "fp8_block", "mxfp8", "mxfp4", "nvfp4"])
def test_select_experts_equals_selecting_the_dense_experts(quant):
    w13, w2, b13, b2 = dense()
    weights = ExpertWeights.from_dense(w13, w2, b13, b2, quant=quant)
    subset = weights.select_experts([2, 0])
    assert subset.num_experts == 2 and subset.weight_format is weights.weight_format
    full13, full2 = weights.dequantize()
    got13, got2 = subset.dequantize()
    assert torch.equal(got13, full13[[2, 0]]) and torch.equal(got2, full2[[2, 0]])
    assert torch.equal(subset.b13, b13[[2, 0]]) and torch.equal(subset.b2, b2[[2, 0]])


def test_select_no_experts():
    w13, w2, _, _ = dense()
    empty = ExpertWeights.from_dense(w13, w2, quant="mxfp4").select_experts([])
    assert empty.num_experts == 0 and empty.w13.scale.shape == (0, 2 * I, H // 32)


@pytest.mark.parametrize(
    "ids, message",
    [
        ([0, 3], r"in \[0, 3\) \(got \[3\]\)"),
        ([-1], r"got \[-1\]"),
        ([1, 1], "selected once"),
        ([True], r"got \[True\]"),
    ],
)
def test_select_experts_rejects_bad_ids(ids, message):
    w13, w2, _, _ = dense()
    with pytest.raises(MoEConfigError, match=message):
        ExpertWeights.from_dense(w13, w2).select_experts(ids)
