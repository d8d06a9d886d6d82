"""moe.quant numerics: bit-exact against hand-computed vectors, error bounds, shapes and errors.

Every expected value below was worked out by hand from the conventions in the module docstrings;
none is produced by the code under test.
"""

from __future__ import annotations

import pytest
import torch

from moe.errors import MoEConfigError
from moe.quant import (
    SCHEME_PAIRS,
    QuantFormat,
    QuantizedTensor,
    decode_e2m1,
    dequantize,
    dequantize_fp8_blockwise,
    dequantize_fp8_groupwise,
    dequantize_fp8_rowwise,
    dequantize_mxfp4,
    dequantize_mxfp8,
    dequantize_nvfp4,
    e8m0_from_exponent,
    e8m0_to_float,
    encode_e2m1,
    mx_scale_bytes,
    nvfp4_global_scale,
    pack_e2m1,
    quantize,
    quantize_fp8_blockwise,
    quantize_fp8_groupwise,
    quantize_fp8_per_tensor,
    quantize_fp8_rowwise,
    quantize_mxfp4,
    quantize_mxfp8,
    quantize_nvfp4,
    unpack_e2m1,
)

F = QuantFormat
E4M3 = torch.float8_e4m3fn
QUANTIZED_FORMATS = [f for f in QuantFormat if f is not F.NONE]


def assert_exact(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same dtype, shape and values (NaN == NaN; the sign of zero is checked where it matters)."""
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


def u8(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8)


def f32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


# --- e2m1 ---------------------------------------------------------------------------------------

E2M1_CASES = [
    # (input, code) — the eight magnitudes, then each tie (to the even code), then just past it
    (0.0, 0x0),
    (0.5, 0x1),
    (1.0, 0x2),
    (1.5, 0x3),
    (2.0, 0x4),
    (3.0, 0x5),
    (4.0, 0x6),
    (6.0, 0x7),
    (0.25, 0x0),
    (0.75, 0x2),
    (1.25, 0x2),
    (1.75, 0x4),
    (2.5, 0x4),
    (3.5, 0x6),
    (5.0, 0x6),
    (0.2501, 0x1),
    (0.7499, 0x1),
    (1.2501, 0x3),
    (1.7499, 0x3),
    (2.5001, 0x5),
    (3.4999, 0x5),
    (5.0001, 0x7),
    (0.1, 0x0),
    (6.5, 0x7),
    (1000.0, 0x7),  # saturation
    (-0.0, 0x8),
    (-0.5, 0x9),
    (-0.75, 0xA),
    (-2.5, 0xC),
    (-5.0, 0xE),
    (-6.0, 0xF),
    (-7.0, 0xF),
]


def test_encode_e2m1_hand_table():
    inputs = f32([value for value, _ in E2M1_CASES])
    assert_exact(encode_e2m1(inputs), u8([code for _, code in E2M1_CASES]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_encode_e2m1_half_inputs(dtype):
    inputs = torch.tensor([0.25, 0.75, 2.5, 5.0, -0.0, -6.0], dtype=dtype)
    assert_exact(encode_e2m1(inputs), u8([0x0, 0x2, 0x4, 0x6, 0x8, 0xF]))


def test_decode_e2m1_all_codes():
    expected = f32([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    decoded = decode_e2m1(torch.arange(16, dtype=torch.uint8))
    assert_exact(decoded, expected)
    assert torch.signbit(decoded[8]) and not torch.signbit(decoded[0])


def test_pack_e2m1_low_nibble_is_even_element():
    codes = u8([[0x1, 0x2, 0x3, 0x4], [0xF, 0x0, 0x8, 0x7]])
    packed = pack_e2m1(codes)
    assert_exact(packed, u8([[0x21, 0x43], [0x0F, 0x78]]))
    assert_exact(unpack_e2m1(packed), codes)


def test_pack_e2m1_rejects_odd_length_and_big_codes():
    with pytest.raises(MoEConfigError, match="codes: last dimension must be even"):
        pack_e2m1(u8([1, 2, 3]))
    with pytest.raises(MoEConfigError, match=r"codes: e2m1 codes are 0\.\.15"):
        pack_e2m1(u8([1, 16]))


# --- e8m0 / MX ----------------------------------------------------------------------------------

# amax -> byte. e4m3 (elem max 448 = 0.875 * 2**9), e2m1 (elem max 6 = 0.75 * 2**3).
E8M0_CASES = [
    # amax,   e4m3 byte, e2m1 byte
    (1.0, 127 - 8, 127 - 2),  # 1 * 2**8 = 256 <= 448 < 512;     1 * 2**2 = 4 <= 6 < 8
    (6.0, 127 - 6, 127 + 0),  # 6 * 2**6 = 384 <= 448 < 768;     6 fits exactly
    (7.0, 127 - 6, 127 + 1),  # 7 * 2**6 = 448 exactly;           7 / 2 = 3.5
    (448.0, 127 + 0, 127 + 7),  # 448 fits exactly;                448 / 2**7 = 3.5, / 2**6 = 7
    (449.0, 127 + 1, 127 + 7),  # 449 / 2 = 224.5;                 449 / 2**7 = 3.51
    (2.0**-10, 127 - 18, 127 - 12),  # 2**-10 * 2**18 = 256;      2**-10 * 2**12 = 4
    (0.0, 0, 0),  # all-zero block: byte 0 by convention
]


@pytest.mark.parametrize("amax, e4m3_byte, e2m1_byte", E8M0_CASES)
def test_mx_scale_bytes_hand_values(amax, e4m3_byte, e2m1_byte):
    assert int(mx_scale_bytes(f32([amax]), 448.0)) == e4m3_byte
    assert int(mx_scale_bytes(f32([amax]), 6.0)) == e2m1_byte


def test_mx_scale_bytes_exact_at_powers_of_two():
    # amax == elem_max * 2**n must give exactly n, never n + 1 from a float log2.
    n = torch.arange(-100, 101)
    for elem_max in (6.0, 448.0):
        amax = elem_max * torch.pow(2.0, n.double())
        assert_exact(mx_scale_bytes(amax.float(), elem_max), (n + 127).to(torch.uint8))
        just_above = torch.nextafter(amax.float(), torch.tensor(float("inf")))
        assert_exact(mx_scale_bytes(just_above, elem_max), (n + 128).to(torch.uint8))


def test_mx_scale_bytes_clamp_to_byte_range():
    assert int(mx_scale_bytes(f32([2.0**-140]), 6.0)) == 0  # n = -142, clamped to byte 0
    assert int(e8m0_from_exponent(torch.tensor([200]))) == 254  # 255 is NaN, never produced


def test_e8m0_to_float_exact():
    decoded = e8m0_to_float(u8([0, 1, 126, 127, 128, 254, 255]))
    expected = torch.tensor([2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127, float("nan")])
    assert_exact(decoded, expected)


def test_quantize_mxfp4_hand_block():
    # amax 7 -> n = 1 (scale 2): 7/2 = 3.5 -> 4 (code 6), 1/2 -> 0.5 (1),
    # -2.5/2 = -1.25 -> -1 (0xA), 0.3/2 = 0.15 -> 0 (0); the second row is all zeros -> byte 0.
    x = torch.zeros(2, 32)
    x[0, :4] = f32([7.0, 1.0, -2.5, 0.3])
    data, scale = quantize_mxfp4(x)
    expected_data = torch.zeros(2, 16, dtype=torch.uint8)
    expected_data[0, 0] = 0x6 | 0x1 << 4
    expected_data[0, 1] = 0xA | 0x0 << 4
    assert_exact(data, expected_data)
    assert_exact(scale, u8([[128], [0]]))
    expected = torch.zeros(2, 32)
    expected[0, :4] = f32([8.0, 1.0, -2.0, 0.0])
    assert_exact(dequantize_mxfp4(data, scale), expected)


def test_quantize_mxfp8_hand_block():
    # amax 449 -> n = 1: 449/2 = 224.5 -> 224 (e4m3 step 16 there), 3/2 = 1.5, -1/2 = -0.5.
    x = torch.zeros(1, 64)
    x[0, :3] = f32([449.0, 3.0, -1.0])
    x[0, 32] = 1.0  # second block: amax 1 -> n = -8, 1 * 256 = 256
    data, scale = quantize_mxfp8(x)
    expected_payload = torch.zeros(1, 64)
    expected_payload[0, :3] = f32([224.0, 1.5, -0.5])
    expected_payload[0, 32] = 256.0
    assert_exact(data.float(), expected_payload)
    assert_exact(scale, u8([[128, 119]]))
    expected = torch.zeros(1, 64)
    expected[0, :3] = f32([448.0, 3.0, -1.0])
    expected[0, 32] = 1.0
    assert_exact(dequantize_mxfp8(data, scale), expected)


@pytest.mark.parametrize("quantize_mx", [quantize_mxfp8, quantize_mxfp4])
def test_mx_rejects_k_not_multiple_of_32(quantize_mx):
    with pytest.raises(
        MoEConfigError, match=r"x: last dimension must be a multiple of 32 .*\(got 40\)"
    ):
        quantize_mx(torch.ones(2, 40))


def test_mx_dequantize_rejects_nan_scale_byte():
    with pytest.raises(MoEConfigError, match="255"):
        dequantize_mxfp8(torch.zeros(1, 32, dtype=E4M3), u8([[255]]))


# --- FP8 ----------------------------------------------------------------------------------------


def test_fp8_per_tensor_activation():
    x = f32([[0.5, -2.0], [1.0, 4.0]])  # amax 4 -> scale 4/448 = 1/112
    q, scale = quantize_fp8_per_tensor(x)
    assert scale.shape == () and scale.dtype == torch.float32
    assert_exact(scale, torch.tensor(4.0 / 448.0))
    assert_exact(q.float(), f32([[56.0, -224.0], [112.0, 448.0]]))


def test_fp8_per_tensor_per_expert_with_zero_expert():
    x = torch.zeros(3, 2, 2)
    x[1] = f32([[896.0, 3.0], [-1.0, 0.0]])  # amax 896 -> scale 2
    x[2] = f32(
        [[0.5, 224.0], [0.0, -17.0]]
    )  # amax 224 -> scale 0.5; -17/0.5 = -34, a tie in [32, 64) (step 4) -> -32
    q, scale = quantize_fp8_per_tensor(x, batch_dims=1)
    assert_exact(scale, f32([1.0, 2.0, 0.5]))  # all-zero expert -> 1.0
    expected = torch.zeros(3, 2, 2)
    expected[1] = f32([[448.0, 1.5], [-0.5, 0.0]])
    expected[2] = f32([[1.0, 448.0], [0.0, -32.0]])
    assert_exact(q.float(), expected)


def test_fp8_rowwise_rounds_half_to_even():
    # Row 0: scale 1; 17 and 19 are ties in e4m3's [16, 32) (step 2): 17 -> 16, 19 -> 20.
    x = f32([[448.0, 17.0, 19.0], [0.0, 0.0, 0.0], [-896.0, 3.0, 1.0]])
    q, scale = quantize_fp8_rowwise(x)
    assert_exact(scale, f32([[1.0], [1.0], [2.0]]))
    assert_exact(q.float(), f32([[448.0, 16.0, 20.0], [0.0, 0.0, 0.0], [-448.0, 1.5, 0.5]]))
    assert_exact(dequantize_fp8_rowwise(q, scale), f32([[448, 16, 20], [0, 0, 0], [-896, 3, 1]]))


def test_fp8_blockwise_partial_edge_blocks():
    # 3x3 in 2x2 blocks: top-left {1,2,4,-448} -> 1, top-right {224,0} -> 0.5,
    # bottom-left {896,8} -> 2, bottom-right {0} -> 1 (all zero).
    x = f32([[[1.0, 2.0, 224.0], [4.0, -448.0, 0.0], [896.0, 8.0, 0.0]]])
    q, scale = quantize_fp8_blockwise(x, block=(2, 2))
    assert_exact(scale, f32([[[1.0, 0.5], [2.0, 1.0]]]))
    assert_exact(q.float(), f32([[[1.0, 2.0, 448.0], [4.0, -448.0, 0.0], [448.0, 4.0, 0.0]]]))
    assert_exact(dequantize_fp8_blockwise(q, scale, block=(2, 2)), x)


def test_fp8_groupwise_partial_edge_group():
    x = f32([[448.0, 1.0, 224.0, 2.0, 896.0], [0.0, 0.0, 112.0, -56.0, 0.0]])
    q, scale = quantize_fp8_groupwise(x, group_size=2)
    assert_exact(scale, f32([[1.0, 0.5, 2.0], [1.0, 0.25, 1.0]]))
    assert_exact(q.float(), f32([[448.0, 1.0, 448.0, 4.0, 448.0], [0.0, 0.0, 448.0, -224.0, 0.0]]))
    assert_exact(dequantize_fp8_groupwise(q, scale, group_size=2), x)


def test_fp8_block_default_shapes_with_partial_blocks():
    q = quantize(torch.randn(2, 130, 257), F.FP8_BLOCK, "weight")
    assert q.scale.shape == (2, 2, 3)
    q = quantize(torch.randn(3, 257), F.FP8_BLOCK, "activation")
    assert q.scale.shape == (3, 3)


# --- NVFP4 --------------------------------------------------------------------------------------


def test_nvfp4_activation_hand_example():
    # amax 2688 = 448 * 6 -> global scale 1.0, so block scale = e4m3(amax_block / 6).
    x = torch.zeros(1, 48)
    x[0, :4] = f32([2688.0, 448.0, -1344.0, 100.0])  # s = 448: x/448 = 6, 1, -3, 0.22
    x[0, 16:20] = f32([30.0, -7.5, 12.5, 2.5])  # s = 5: x/5 = 6, -1.5, 2.5 (tie -> 2), 0.5
    x[0, 32:34] = f32([26.0, 9.0])  # 26/6 = 4.33 -> s = 4.5: 5.78 -> 6, 2 -> 2
    data, block_scale, global_scale = quantize_nvfp4(x)
    assert_exact(global_scale, torch.tensor(1.0))
    assert_exact(block_scale.float(), f32([[448.0, 5.0, 4.5]]))
    expected_data = torch.zeros(1, 24, dtype=torch.uint8)
    expected_data[0, 0:2] = u8([0x7 | 0x2 << 4, 0xD | 0x0 << 4])
    expected_data[0, 8:10] = u8([0x7 | 0xB << 4, 0x4 | 0x1 << 4])
    expected_data[0, 16] = 0x7 | 0x4 << 4
    assert_exact(data, expected_data)
    expected = torch.zeros(1, 48)
    expected[0, :4] = f32([2688.0, 448.0, -1344.0, 0.0])
    expected[0, 16:20] = f32([30.0, -7.5, 10.0, 2.5])
    expected[0, 32:34] = f32([27.0, 9.0])
    assert_exact(dequantize_nvfp4(data, block_scale, global_scale), expected)


def test_nvfp4_weight_per_expert_global_scale():
    # Expert 0: amax 1344 -> global 0.5; block scale 1344 / 6 / 0.5 = 448; x / 224.
    # Expert 1: all zero -> global 1.0, block scale 0, payload 0.
    x = torch.zeros(2, 1, 16)
    x[0, 0, :3] = f32([1344.0, 224.0, -672.0])
    data, block_scale, global_scale = quantize_nvfp4(x, batch_dims=1)
    assert_exact(global_scale, f32([0.5, 1.0]))
    assert_exact(block_scale.float(), f32([[[448.0]], [[0.0]]]))
    expected_data = torch.zeros(2, 1, 8, dtype=torch.uint8)
    expected_data[0, 0, :2] = u8([0x7 | 0x2 << 4, 0xD])
    assert_exact(data, expected_data)
    assert_exact(dequantize_nvfp4(data, block_scale, global_scale), x)


def test_nvfp4_given_global_scale_and_zero_block_scale():
    # Global scale 2 given: s = 96 / 6 / 2 = 8, elements x / 16. The second block's scale
    # 1e-6 / 6 / 2 rounds to 0 in e4m3, so it is stored as zeros (no NaN).
    x = torch.zeros(1, 32)
    x[0, :2] = f32([96.0, -24.0])
    x[0, 16] = 1e-6
    data, block_scale, global_scale = quantize_nvfp4(x, global_scale=2.0)
    assert_exact(global_scale, torch.tensor(2.0))
    assert_exact(block_scale.float(), f32([[8.0, 0.0]]))
    expected = torch.zeros(1, 32)
    expected[0, :2] = f32([96.0, -24.0])
    assert_exact(dequantize_nvfp4(data, block_scale, global_scale), expected)
    assert_exact(nvfp4_global_scale(x), torch.tensor(96.0 / 2688.0))


def test_nvfp4_rejects_bad_global_scale_and_k():
    with pytest.raises(MoEConfigError, match="global_scale: must be finite and positive"):
        quantize_nvfp4(torch.ones(1, 16), global_scale=0.0)
    with pytest.raises(MoEConfigError, match="global_scale: shape"):
        quantize_nvfp4(torch.ones(2, 1, 16), batch_dims=1, global_scale=torch.ones(3))
    with pytest.raises(MoEConfigError, match=r"multiple of 16 for nvfp4 \(got 24\)"):
        quantize_nvfp4(torch.ones(1, 24))


# --- generic dispatch: shapes, round trips, errors -----------------------------------------------

# fmt -> (payload shape, scale shape, global scale shape) for weight [E=2, N=3, K=64]
WEIGHT_SHAPES = {
    F.NONE: ((2, 3, 64), None, None),
    F.FP8_TENSOR: ((2, 3, 64), (2,), None),
    F.FP8_ROW: ((2, 3, 64), (2, 3, 1), None),
    F.FP8_BLOCK: ((2, 3, 64), (2, 1, 1), None),
    F.MXFP8: ((2, 3, 64), (2, 3, 2), None),
    F.MXFP4: ((2, 3, 32), (2, 3, 2), None),
    F.NVFP4: ((2, 3, 32), (2, 3, 4), (2,)),
}
# ... and for activation [M=5, K=64]
ACTIVATION_SHAPES = {
    F.NONE: ((5, 64), None, None),
    F.FP8_TENSOR: ((5, 64), (), None),
    F.FP8_ROW: ((5, 64), (5, 1), None),
    F.FP8_BLOCK: ((5, 64), (5, 1), None),
    F.MXFP8: ((5, 64), (5, 2), None),
    F.MXFP4: ((5, 32), (5, 2), None),
    F.NVFP4: ((5, 32), (5, 4), ()),
}


def _shapes(q: QuantizedTensor):
    return (
        tuple(q.data.shape),
        None if q.scale is None else tuple(q.scale.shape),
        None if q.global_scale is None else tuple(q.global_scale.shape),
    )


@pytest.mark.parametrize("fmt", list(QuantFormat))
def test_scale_shapes_by_role(fmt):
    weight = quantize(torch.randn(2, 3, 64), fmt, "weight")
    activation = quantize(torch.randn(5, 64), fmt, "activation")
    assert _shapes(weight) == WEIGHT_SHAPES[fmt]
    assert _shapes(activation) == ACTIVATION_SHAPES[fmt]
    assert weight.shape == (2, 3, 64) and activation.shape == (5, 64)
    assert dequantize(weight).shape == (2, 3, 64)
    assert dequantize(activation, torch.bfloat16).dtype == torch.bfloat16


def test_none_format_returns_the_tensor():
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    q = quantize(x, F.NONE, "activation")
    assert q.data is x and q.scale is None
    assert_exact(dequantize(q, torch.bfloat16), x)


@pytest.mark.parametrize("fmt", list(QuantFormat))
@pytest.mark.parametrize("m", [0, 1, 7])
def test_zero_one_and_odd_token_counts(fmt, m):
    x = torch.randn(m, 96)
    y = dequantize(quantize(x, fmt, "activation"))
    assert y.shape == (m, 96)
    assert torch.isfinite(y).all()


def _half_step(values: torch.Tensor) -> torch.Tensor:
    """Half the e2m1 spacing around |values| (already divided by the scale)."""
    magnitude = values.abs()
    step = torch.where(magnitude < 2, 0.5, torch.where(magnitude < 4, 1.0, 2.0))
    return step / 2


def _expanded_scale(q: QuantizedTensor) -> torch.Tensor:
    """The dequantization multiplier of each element, from the stored scales."""
    if q.fmt in (F.MXFP8, F.MXFP4):
        return e8m0_to_float(q.scale).repeat_interleave(32, dim=-1)
    if q.fmt is F.NVFP4:
        per_block = q.scale.float() * q.global_scale.reshape(-1, *[1] * (q.scale.dim() - 1))
        return per_block.repeat_interleave(16, dim=-1)
    raise AssertionError(q.fmt)


@pytest.mark.parametrize("fmt", [F.FP8_TENSOR, F.FP8_ROW, F.FP8_BLOCK, F.MXFP8])
@pytest.mark.parametrize("role, shape", [("weight", (3, 130, 160)), ("activation", (9, 288))])
def test_fp8_round_trip_relative_error(fmt, role, shape):
    torch.manual_seed(0)
    x = torch.randn(shape) * torch.logspace(-3, 3, shape[-1])  # wide dynamic range along K
    q = quantize(x, fmt, role)
    error = (dequantize(q) - x).abs()
    # e4m3 keeps 3 mantissa bits: half an ulp is 1/16 of the value; below 2**-6 (subnormals) the
    # spacing is 2**-9, so the absolute error is at most 2**-10 times the scale.
    if fmt is F.MXFP8:
        subnormal = 2.0**-10 * e8m0_to_float(q.scale).repeat_interleave(32, dim=-1)
    else:
        subnormal = 2.0**-10 * q.scale.max()
    assert (error <= x.abs() / 16 + subnormal).all()


@pytest.mark.parametrize("fmt", [F.MXFP4, F.NVFP4])
@pytest.mark.parametrize("role, shape", [("weight", (3, 5, 64)), ("activation", (9, 128))])
def test_fp4_round_trip_within_half_step(fmt, role, shape):
    torch.manual_seed(1)
    x = torch.randn(shape) * 10
    q = quantize(x, fmt, role)
    scale = _expanded_scale(q)
    error = (dequantize(q) - x).abs()
    assert (error <= _half_step(x / scale) * scale * (1 + 1e-6)).all()


def test_dequantize_dtype_and_quantize_half_inputs():
    x = torch.randn(4, 64, dtype=torch.float16)
    for fmt in QUANTIZED_FORMATS:
        y = dequantize(quantize(x, fmt, "activation"), torch.float16)
        assert y.dtype == torch.float16 and y.shape == x.shape


# --- bad input ----------------------------------------------------------------------------------

QUANTIZERS = {
    "per_tensor": quantize_fp8_per_tensor,
    "rowwise": quantize_fp8_rowwise,
    "blockwise": quantize_fp8_blockwise,
    "groupwise": quantize_fp8_groupwise,
    "mxfp8": quantize_mxfp8,
    "mxfp4": quantize_mxfp4,
    "nvfp4": quantize_nvfp4,
    "encode_e2m1": encode_e2m1,
}


@pytest.mark.parametrize(
    "bad, word", [(float("nan"), "NaN"), (float("inf"), "inf"), (-float("inf"), "inf")]
)
@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_quantizers_reject_non_finite(name, bad, word):
    x = torch.ones(2, 32)
    x[1, 5] = bad
    with pytest.raises(MoEConfigError, match=f"^x contains {word}"):
        QUANTIZERS[name](x)


@pytest.mark.parametrize("fmt", list(QuantFormat))
def test_quantize_rejects_non_finite_for_every_format(fmt):
    x = torch.ones(3, 32)
    x[0, 0] = float("nan")
    with pytest.raises(MoEConfigError, match=r"^x contains NaN"):
        quantize(x, fmt, "activation")


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_quantizers_reject_integer_input(name):
    with pytest.raises(MoEConfigError, match=r"x: dtype must be one of .* \(got torch.int32\)"):
        QUANTIZERS[name](torch.ones(2, 32, dtype=torch.int32))


def test_quantize_rejects_wrong_rank_role_and_format():
    with pytest.raises(MoEConfigError, match=r"x: a weight must be \[E, N, K\].*\(got \(4, 32\)\)"):
        quantize(torch.ones(4, 32), F.FP8_ROW, "weight")
    with pytest.raises(MoEConfigError, match=r"x: a activation must be \[M, K\]"):
        quantize(torch.ones(2, 4, 32), F.FP8_ROW, "activation")
    with pytest.raises(MoEConfigError, match="role: must be one of weight, activation"):
        quantize(torch.ones(4, 32), F.FP8_ROW, "bias")
    with pytest.raises(MoEConfigError, match="fmt: 'int3' is not a QuantFormat"):
        quantize(torch.ones(4, 32), "int3", "activation")


def test_quantized_tensor_checks_storage_dtypes():
    with pytest.raises(MoEConfigError, match="data/scale"):
        QuantizedTensor(
            data=torch.ones(2, 32), scale=torch.ones(2, 1), fmt=F.FP8_ROW, role="activation"
        )
    with pytest.raises(MoEConfigError, match=r"global_scale: QuantFormat\.NVFP4 needs"):
        QuantizedTensor(
            data=torch.zeros(2, 8, dtype=torch.uint8),
            scale=torch.zeros(2, 1, dtype=E4M3),
            fmt=F.NVFP4,
            role="activation",
        )
    with pytest.raises(MoEConfigError, match="scale: must be None"):
        QuantizedTensor(data=torch.ones(2), scale=torch.ones(1), fmt=F.NONE, role="activation")


def test_role_defaults_to_activation_and_a_wrong_role_fails_loudly():
    weight = quantize(torch.randn(2, 256, 128), F.FP8_BLOCK, "weight")  # scale [2, 2, 1]
    as_activation = QuantizedTensor(data=weight.data, scale=weight.scale, fmt=F.FP8_BLOCK)
    assert as_activation.role == "activation"
    with pytest.raises(MoEConfigError, match=r"scale: must be float32 of shape \(2, 256, 1\)"):
        dequantize(as_activation)


def test_dequantize_rejects_mismatched_scale_shape():
    q, _ = quantize_fp8_rowwise(torch.ones(4, 8))
    with pytest.raises(MoEConfigError, match=r"scale: must be float32 of shape \(4, 1\)"):
        dequantize_fp8_rowwise(q, torch.ones(4, 2))
    data, block_scale, _ = quantize_nvfp4(torch.ones(2, 3, 32), batch_dims=1)
    with pytest.raises(MoEConfigError, match="global_scale: must be float32 shaped like"):
        dequantize_nvfp4(data, block_scale, torch.ones(3))
    with pytest.raises(MoEConfigError, match="block_scale: must have shape"):
        dequantize_nvfp4(data, block_scale[..., :1], torch.ones(2))


@pytest.mark.parametrize("fmt", sorted({a for _, a in SCHEME_PAIRS} - {QuantFormat.NONE}))
def test_quantize_check_finite_false_skips_the_scan(fmt):
    """The hot path (activations) skips the host-syncing NaN scan; the result still carries the NaN."""
    x = torch.ones(2, 32)
    x[0, 0] = float("nan")
    q = quantize(x, fmt, "activation", check_finite=False)
    assert not torch.isfinite(dequantize(q)).all()


@pytest.mark.parametrize("fmt", ["fp8_tensor", "fp8_row", "fp8_block", "mxfp8", "mxfp4", "nvfp4"])
def test_weights_quantized_in_chunks_of_experts_equal_the_whole(fmt, monkeypatch):
    """Big weights are quantized a few experts at a time (bounded temporaries); every weight scale is per
    expert or finer, so the chunks must give exactly the bytes and scales of one call over all experts."""
    from moe.quant import tensor as qt

    torch.manual_seed(0)
    x = torch.randn(5, 256, 128) * torch.logspace(-2, 2, 5).view(5, 1, 1)  # experts of very different scale
    whole = qt.quantize(x, fmt, "weight")
    monkeypatch.setattr(qt, "WEIGHT_CHUNK_ELEMENTS", 2 * 256 * 128)  # 2 experts a chunk: 3 uneven chunks
    chunked = qt.quantize(x, fmt, "weight")
    for name in ("data", "scale", "global_scale"):
        want, got = getattr(whole, name), getattr(chunked, name)
        assert (want is None) == (got is None), name
        if want is not None:
            assert got.shape == want.shape and got.dtype == want.dtype, name
            assert torch.equal(got.view(torch.uint8) if got.dtype.itemsize == 1 else got,
                               want.view(torch.uint8) if want.dtype.itemsize == 1 else want), name


def test_chunked_weight_quantization_still_refuses_a_nan_in_a_later_chunk(monkeypatch):
    from moe.quant import tensor as qt

    x = torch.randn(4, 32, 64)
    x[3, 5, 7] = float("nan")
    monkeypatch.setattr(qt, "WEIGHT_CHUNK_ELEMENTS", 32 * 64)
    with pytest.raises(MoEConfigError, match="x contains NaN"):
        qt.quantize(x, "mxfp4", "weight")
