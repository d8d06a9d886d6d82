"""FP4 (e2m1): encode/decode one value per 4-bit code, and packing two codes per byte.

Conventions (tested in tests/test_quant.py):

- The magnitudes are ``E2M1_VALUES = (0, 0.5, 1, 1.5, 2, 3, 4, 6)``; code ``c`` (0..7) is the
  index into that tuple and bit 3 is the sign, so a code is ``sign << 3 | magnitude``.
- Encoding rounds to the nearest value; a tie goes to the even code. The ties and where they go::

      0.25 -> 0 (code 0)   0.75 -> 1 (code 2)   1.25 -> 1 (code 2)   1.75 -> 2 (code 4)
      2.5  -> 2 (code 4)   3.5  -> 4 (code 6)   5    -> 4 (code 6)

- Magnitudes above 6 saturate to 6 (code 7); callers scale first, so this only clips values the
  scale was chosen not to cover.
- The sign is kept for zero: -0.0 encodes as 0x8 and decodes as -0.0.
- Packing: ``byte = code[2j] | code[2j + 1] << 4`` (low nibble holds the even element), so a
  packed tensor has the last dimension halved.
"""

from __future__ import annotations

import torch

from moe.errors import MoEConfigError
from moe.quant.fp8 import check_quantize_input

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0

# Midpoints between neighbouring magnitudes, split by where a tie goes. A tie rounds up when the
# lower code is odd (so the upper, even code wins) and down when the lower code is even.
_TIE_DOWN_MIDPOINTS = (0.25, 1.25, 2.5, 5.0)  # lower codes 0, 2, 4, 6
_TIE_UP_MIDPOINTS = (0.75, 1.75, 3.5)  # lower codes 1, 3, 5


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """One uint8 code (0..15) per element of finite fp32/fp16/bf16 ``x``; same shape."""
    check_quantize_input(x, "x")
    return e2m1_codes(x)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """`encode_e2m1` without the input check, for callers that checked already."""
    magnitude = x.float().abs()
    # The magnitude code is the number of midpoints the value has passed: strictly for the
    # tie-down midpoints (bucketize right=False counts boundaries < v), inclusively for the
    # tie-up ones (right=True counts boundaries <= v).
    tie_down = torch.tensor(_TIE_DOWN_MIDPOINTS, device=x.device)
    tie_up = torch.tensor(_TIE_UP_MIDPOINTS, device=x.device)
    code = torch.bucketize(magnitude, tie_down, right=False) + torch.bucketize(
        magnitude, tie_up, right=True
    )
    sign = torch.signbit(x).to(torch.uint8) << 3
    return code.to(torch.uint8) | sign


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """The fp32 value of each uint8 code (0..15); same shape. Code 0x8 decodes as -0.0."""
    _check_codes(codes)
    positive = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    table = torch.cat([positive, -positive])  # -positive[0] is -0.0, the value of code 0x8
    return table[codes.long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes ``[..., K]`` (K even) two per byte into ``[..., K/2]``, even element low."""
    _check_codes(codes)
    if codes.dim() == 0 or codes.shape[-1] % 2:
        raise MoEConfigError(
            "codes: last dimension must be even to pack two per byte "
            f"(got shape {tuple(codes.shape)})"
        )
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Unpack uint8 bytes ``[..., K/2]`` into codes ``[..., K]``; inverse of `pack_e2m1`."""
    if packed.dtype != torch.uint8 or packed.dim() == 0:
        raise MoEConfigError(
            f"packed: must be a uint8 tensor of at least 1 dimension (got {packed.dtype} "
            f"{tuple(packed.shape)})"
        )
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def _check_codes(codes: torch.Tensor) -> None:
    if codes.dtype != torch.uint8:
        raise MoEConfigError(f"codes: dtype must be torch.uint8 (got {codes.dtype})")
    if codes.numel() and int(codes.max()) > 15:
        raise MoEConfigError(
            f"codes: e2m1 codes are 0..15 (got a maximum of {int(codes.max())}); "
            "unpack packed bytes with unpack_e2m1 first"
        )
