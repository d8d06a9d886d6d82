"""NVFP4's packed bf16x2 dequantization in the decode kernels (`_triton/_decode.py`), checked on the CPU:
the interpreter runs no PTX, so its arithmetic is emulated here bit for bit, for every e4m3 scale byte x
every e2m1 code; and the launcher's choice of it (`decode.packed_dequantization`). The kernels themselves
run in tests/gpu/test_triton_decode_gpu.py."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from moe.experts._triton._decode_mma import _E4M3_SCALED_TO_BIASED, NVFP4_ASM_UNBIAS, NVFP4_SCALE_BIAS  # noqa: E402
from moe.experts._triton.decode import packed_dequantization  # noqa: E402
from moe.experts.triton import TritonExperts  # noqa: E402
from moe.quant import QuantFormat  # noqa: E402
from tests.test_triton import make_problem, make_weights  # noqa: E402

BYTES = torch.arange(256)
CODES = torch.arange(16)
BF16_MIN_NORMAL = 2.0**-126


def _bits_as(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """16-bit patterns (0 .. 0xFFFF, any integer dtype) read as ``dtype``."""
    return torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16).view(dtype)


def biased_scales() -> torch.Tensor:
    """`_decode_mma.e4m3_bf16_biased` of every byte: `_gemm._e4m3_scaled`'s float16 bits (the scale times
    2**-8), in float32 times the kernel's constant, rounded to bfloat16."""
    half = _bits_as(((BYTES & 0x80) << 8) | ((BYTES & 0x7F) << 7), torch.float16)
    return (half.float() * _E4M3_SCALED_TO_BIASED.value).to(torch.bfloat16)


def e2m1_times_2_pow_minus_126() -> torch.Tensor:
    """What `_E2M1_PTX` builds of each code before its fma: magnitude bits at bf16 bits 6..8, sign at 15."""
    return _bits_as(((CODES & 8) << 12) | ((CODES & 7) << 6), torch.bfloat16)


def e4m3_values() -> torch.Tensor:
    """Every byte's e4m3 value in float64; 0x7F/0xFF (NaN) as +-480, as `_gemm._e4m3_scaled` reads them."""
    values = BYTES.to(torch.uint8).view(torch.float8_e4m3fn).double()
    return torch.where(values.isnan(), torch.where(BYTES < 128, 480.0, -480.0).double(), values)


E2M1_VALUES = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)


def test_the_bias_leaves_the_rest_to_the_global_scale():
    assert NVFP4_ASM_UNBIAS.value == 2.0 ** (126 - NVFP4_SCALE_BIAS) == 256.0


def test_every_biased_scale_is_a_normal_finite_bf16_equal_to_the_scale_times_the_bias():
    scales = biased_scales().double()
    want = e4m3_values() * 2.0**NVFP4_SCALE_BIAS
    assert torch.equal(scales, want)  # exact, every byte
    nonzero = want != 0
    assert nonzero.sum() == 254  # only +-0 are 0
    assert scales.isfinite().all() and (scales[nonzero].abs() >= BF16_MIN_NORMAL).all()
    assert scales.abs().max() == 480 * 2.0**NVFP4_SCALE_BIAS < 2.0**128  # 448, and the unused NaN codes' 480


def test_the_mma_tiles_build_each_biased_scale_from_its_byte_by_bits_and_two_fmas():
    """`_decode_mma._e4m3_pairs_ptx`, emulated: the byte's sign at bf16 bit 15 and its other seven bits at 4..10 read
    as the value * 2**-120 (e4m3 subnormals as bf16 subnormals); two fmas by 0x7B00 (2**119), each exact, give
    `e4m3_bf16_biased`'s value for every byte. The GPU runs the PTX itself in tests/gpu/test_triton_decode_gpu.py."""
    placed = _bits_as(((BYTES & 0x80) << 8) | ((BYTES & 0x7F) << 4), torch.bfloat16)
    assert torch.equal(placed.double(), e4m3_values() * 2.0**-120)
    two_119 = _bits_as(torch.tensor([0x7B00]), torch.bfloat16)
    assert two_119.item() == 2.0**119
    once = (placed.double() * 2.0**119).float().to(torch.bfloat16)
    assert torch.equal(once.double(), placed.double() * 2.0**119)  # exact: no rounding, no flush
    twice = (once.double() * 2.0**119).float().to(torch.bfloat16)
    assert torch.equal(twice.view(torch.int16), biased_scales().view(torch.int16))


def test_the_e2m1_bit_placement_is_the_value_times_2_pow_minus_126():
    assert torch.equal(e2m1_times_2_pow_minus_126().double(), E2M1_VALUES * 2.0**-126)


def test_every_code_pair_dequantizes_exactly_to_a_normal_bf16():
    """fma.rn.bf16x2 rounds e2m1 * scale (+ -0) once: for all 16 x 256 pairs the exact product is a bf16
    (then the rounding changes nothing), normal or zero, finite, and equal to value * scale / NVFP4_ASM_UNBIAS."""
    exact = e2m1_times_2_pow_minus_126().double()[:, None] * biased_scales().double()[None, :]  # [16, 256]
    rounded = exact.float().to(torch.bfloat16).double()  # float64 -> float32 is exact here (<= 6 bits)
    assert torch.equal(rounded, exact)
    assert rounded.isfinite().all()
    assert ((rounded == 0) | (rounded.abs() >= BF16_MIN_NORMAL)).all()  # no subnormal: no flush, no loss
    want = E2M1_VALUES[:, None] * e4m3_values()[None, :] / NVFP4_ASM_UNBIAS.value
    assert torch.equal(rounded, want)
    assert (rounded != 0).sum() == 14 * 254  # the nonzero codes x the nonzero scales all survive


def _fake(fmt: QuantFormat, small_scales: bool = False):
    return SimpleNamespace(w13=SimpleNamespace(fmt=fmt), small_scales=small_scales)


@pytest.mark.parametrize("fmt,small,dtype,cuda,want", [
    (QuantFormat.NVFP4, False, torch.bfloat16, True, True),  # any e4m3 scale
    (QuantFormat.NVFP4, False, torch.float16, True, False),  # the PTX makes bf16
    (QuantFormat.NVFP4, False, torch.bfloat16, False, False),  # no PTX in the interpreter
    (QuantFormat.MXFP4, False, torch.bfloat16, True, False),  # e8m0 scales > 2 overflow the bias
    (QuantFormat.MXFP4, True, torch.bfloat16, True, True),
])
def test_packed_dequantization_choice(fmt, small, dtype, cuda, want):
    assert packed_dequantization(_fake(fmt, small), SimpleNamespace(dtype=dtype, is_cuda=cuda)) is want


def test_prepared_nvfp4_weights_take_the_packed_path_in_bf16_on_a_gpu():
    """Real prepared NVFP4 weights: not `small_scales` (an MXFP4 notion), still the PTX path."""
    p = make_problem("nvfp4", "silu", E=8, k=2, H=64, I=96)
    prepared = TritonExperts(p).prepare_weights(make_weights(p))
    assert prepared.w13.fmt is QuantFormat.NVFP4 and not prepared.small_scales
    assert packed_dequantization(prepared, SimpleNamespace(dtype=torch.bfloat16, is_cuda=True))
