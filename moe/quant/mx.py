"""OCP microscaling (MX): e8m0 scale helpers, MXFP8 (e4m3 elements) and MXFP4 (e2m1 elements).

Every block of ``MX_BLOCK = 32`` consecutive elements along K (the last dimension) shares one
e8m0 scale byte, so ``x [..., K]`` needs ``K % 32 == 0`` and gets a ``uint8`` scale ``[..., K/32]``.

Conventions (tested in tests/test_quant.py):

- e8m0: byte ``b`` means ``2**(b - 127)``; byte 255 is NaN and is never produced. Decoding builds
  the fp32 bit pattern directly, so it is exact for every byte, including byte 0 (2**-127, an fp32
  subnormal).
- The block exponent is ``n = ceil(log2(amax / elem_max))`` with ``elem_max = 448`` (e4m3) or
  ``6`` (e2m1): the smallest power of two that fits every element of the block without clipping.
  It is computed exactly from ``torch.frexp`` (no float log2), so ``amax == elem_max * 2**n`` gives
  exactly ``n``. The byte is ``clamp(n + 127, 0, 254)``.
  (This is not the OCP reference's ``floor(log2(amax)) - emax_elem``, which can clip: for e2m1 and
  amax = 7 it picks 2**0 and stores 7 as 6; here n = 1 and 7 is stored as 3.5 -> 4, times 2.)
- An all-zero block gets byte 0 (scale 2**-127): every power of two represents it, and byte 0 is
  the smallest. Its elements are stored as zeros.
- Elements are ``x / 2**n`` cast to e4m3 (MXFP8) or encoded to e2m1 and packed two per byte,
  low nibble first (MXFP4, see moe/quant/fp4.py). Dequantize = element * 2**n.

Every quantizer returns ``(payload, scale_bytes)`` and rejects NaN/inf input.
"""

from __future__ import annotations

import math

import torch

from moe.errors import MoEConfigError
from moe.quant.fp4 import E2M1_MAX, decode_e2m1, e2m1_codes, pack_e2m1, unpack_e2m1
from moe.quant.fp8 import E4M3_DTYPE, E4M3_MAX, abs_max, check_quantize_input, to_e4m3

MX_BLOCK = 32
E8M0_BIAS = 127
E8M0_MAX_BYTE = 254  # 255 is NaN
E8M0_ZERO_BLOCK_BYTE = 0  # the byte an all-zero block gets

_FP32_MANTISSA_BITS = 23
_FP32_BITS_OF_2_POW_MINUS_127 = 0x00400000  # the one e8m0 value below fp32's normal range
_FP32_BITS_OF_NAN = 0x7FC00000


# --- e8m0 ---------------------------------------------------------------------------------------


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """The fp32 value 2**(b - 127) of each uint8 byte; byte 255 decodes as NaN."""
    if scale.dtype != torch.uint8:
        raise MoEConfigError(f"scale: e8m0 bytes must be torch.uint8 (got {scale.dtype})")
    byte = scale.to(torch.int32)
    # A byte b >= 1 is exactly the fp32 whose biased exponent field is b and mantissa is 0.
    bits = byte << _FP32_MANTISSA_BITS
    bits = torch.where(byte == 0, _FP32_BITS_OF_2_POW_MINUS_127, bits)
    bits = torch.where(byte == 255, _FP32_BITS_OF_NAN, bits)
    return bits.view(torch.float32)


def e8m0_from_exponent(exponent: torch.Tensor) -> torch.Tensor:
    """The uint8 byte of 2**exponent, clamped to the finite range [2**-127, 2**127]."""
    return (exponent.to(torch.int32) + E8M0_BIAS).clamp(0, E8M0_MAX_BYTE).to(torch.uint8)


def mx_scale_exponent(amax: torch.Tensor, elem_max: float) -> torch.Tensor:
    """Exactly ceil(log2(amax / elem_max)) as int32, for amax > 0 (-127 where amax == 0).

    With amax = m * 2**e and elem_max = m0 * 2**e0 (m, m0 in [0.5, 1)), amax <= elem_max * 2**n
    holds first at n = e - e0 when m <= m0, else at n = e - e0 + 1.
    """
    mantissa, exponent = torch.frexp(amax.float())
    elem_mantissa, elem_exponent = math.frexp(elem_max)
    n = exponent - elem_exponent + (mantissa > elem_mantissa).to(exponent.dtype)
    return torch.where(amax > 0, n, -E8M0_BIAS).to(torch.int32)


def mx_scale_bytes(amax: torch.Tensor, elem_max: float) -> torch.Tensor:
    """The e8m0 byte of each block given its amax; `E8M0_ZERO_BLOCK_BYTE` for all-zero blocks."""
    byte = e8m0_from_exponent(mx_scale_exponent(amax, elem_max))
    return torch.where(amax > 0, byte, E8M0_ZERO_BLOCK_BYTE).to(torch.uint8)


# --- MXFP8 / MXFP4 ------------------------------------------------------------------------------


def quantize_mxfp8(x: torch.Tensor, *, check_finite: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., K]`` -> (e4m3 ``[..., K]``, e8m0 uint8 ``[..., K/32]``)."""
    blocks, scale_bytes = _scaled_blocks(x, E4M3_MAX, "mxfp8", check_finite)
    return to_e4m3(blocks).reshape(x.shape), scale_bytes


def dequantize_mxfp8(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """float(q) * 2**(scale - 127) per block of 32 along the last dimension."""
    if q.dtype != E4M3_DTYPE:
        raise MoEConfigError(f"q: dtype must be {E4M3_DTYPE} for mxfp8 (got {q.dtype})")
    return _apply_block_scales(q.float(), scale, "mxfp8").to(dtype)


def quantize_mxfp4(x: torch.Tensor, *, check_finite: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., K]`` -> (packed e2m1 uint8 ``[..., K/2]``, e8m0 uint8 ``[..., K/32]``)."""
    blocks, scale_bytes = _scaled_blocks(x, E2M1_MAX, "mxfp4", check_finite)
    return pack_e2m1(e2m1_codes(blocks).reshape(x.shape)), scale_bytes


def dequantize_mxfp4(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """e2m1(unpack(q)) * 2**(scale - 127) per block of 32; result ``[..., 2 * q.shape[-1]]``."""
    values = decode_e2m1(unpack_e2m1(q))
    return _apply_block_scales(values, scale, "mxfp4").to(dtype)


def _scaled_blocks(
    x: torch.Tensor, elem_max: float, fmt: str, check_finite: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """x as fp32 blocks ``[..., K/32, 32]`` divided by their power-of-two scale, and the bytes."""
    check_quantize_input(x, "x", min_dims=1, finite=check_finite)
    k = x.shape[-1]
    if k % MX_BLOCK:
        raise MoEConfigError(
            f"x: last dimension must be a multiple of {MX_BLOCK} for {fmt} (got {k}); "
            f"pad K to a multiple of {MX_BLOCK}"
        )
    blocks = x.float().reshape(*x.shape[:-1], k // MX_BLOCK, MX_BLOCK)
    scale_bytes = mx_scale_bytes(abs_max(blocks, -1), elem_max)
    # Dividing by a power of two is exact, so the only rounding is the element encoding.
    return blocks / e8m0_to_float(scale_bytes).unsqueeze(-1), scale_bytes


def _apply_block_scales(values: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """values ``[..., K]`` times the decoded scale ``[..., K/32]`` of each block."""
    if values.shape[-1] % MX_BLOCK:
        raise MoEConfigError(
            f"q: holds K={values.shape[-1]} {fmt} elements per row (shape {tuple(values.shape)} unpacked), "
            f"but K must be a multiple of {MX_BLOCK}, one e8m0 scale per {MX_BLOCK}"
        )
    expected = (*values.shape[:-1], values.shape[-1] // MX_BLOCK)
    if tuple(scale.shape) != expected:
        raise MoEConfigError(
            f"scale: must have shape {expected} for {fmt} elements of shape "
            f"{tuple(values.shape)} (got {tuple(scale.shape)})"
        )
    factor = e8m0_to_float(scale)
    if bool(torch.isnan(factor).any()):
        raise MoEConfigError("scale contains the e8m0 NaN byte 255; the scales are corrupt")
    blocks = values.reshape(*expected, MX_BLOCK) * factor.unsqueeze(-1)
    return blocks.reshape(values.shape)
