"""NVFP4: e2m1 elements, one e4m3 scale per 16 along K, and one fp32 global scale.

For ``x [..., K]`` with ``K % 16 == 0`` and ``batch_dims`` leading dims that each get their own
global scale (1 for weights ``[E, N, K]``: one per expert; 0 for activations ``[M, K]``)::

    payload       uint8 [..., K/2]      e2m1 codes packed two per byte, low nibble = even element
    block_scale   float8_e4m3fn [..., K/16]
    global_scale  float32 x.shape[:batch_dims]

Conventions (tested in tests/test_quant.py):

- ``global_scale`` is the dequantization multiplier ``amax / (448 * 6)`` over everything that
  shares it; an all-zero tensor gets 1.0. A caller may pass its own (a calibrated activation
  scale); it must be finite and positive.
  FlashInfer and ModelOpt kernels take the reciprocal, ``448 * 6 / amax``, as their "global scale"
  argument, so a backend passes ``1 / global_scale`` to them.
- ``block_scale = e4m3(amax_block / 6 / global_scale)``, rounded to nearest by the cast and
  saturated at 448 (it only saturates when a passed-in global scale is smaller than the data
  needs).
- ``elements = e2m1(x / (float(block_scale) * global_scale))``; a block whose scale rounds to 0 is
  stored as zeros.
- ``dequantize = e2m1 * float(block_scale) * global_scale``, evaluated left to right (the first
  product is exact in fp32, so there is one rounding).
"""

from __future__ import annotations

import torch

from moe.errors import MoEConfigError
from moe.quant.fp4 import E2M1_MAX, decode_e2m1, e2m1_codes, pack_e2m1, unpack_e2m1
from moe.quant.fp8 import (
    E4M3_DTYPE,
    E4M3_MAX,
    abs_max,
    broadcast_scale,
    check_batch_dims,
    check_quantize_input,
    divide_by_constant,
    to_e4m3,
)

NVFP4_BLOCK = 16


def nvfp4_global_scale(x: torch.Tensor, batch_dims: int = 0) -> torch.Tensor:
    """amax / (448 * 6) over all but the first ``batch_dims`` dims; 1.0 where that amax is 0."""
    check_quantize_input(x, "x", min_dims=1)
    check_batch_dims(x, batch_dims)
    return _global_scale_from(x, batch_dims)


def quantize_nvfp4(
    x: torch.Tensor,
    batch_dims: int = 0,
    global_scale: torch.Tensor | float | None = None,
    *,
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [..., K]`` -> (packed e2m1 ``[..., K/2]``, e4m3 block scale ``[..., K/16]``, global).

    The global scale is computed from ``x`` unless given; a given one is broadcast to
    ``x.shape[:batch_dims]`` and returned as fp32.
    """
    check_quantize_input(x, "x", min_dims=1, finite=check_finite)
    check_batch_dims(x, batch_dims)
    k = x.shape[-1]
    if k % NVFP4_BLOCK:
        raise MoEConfigError(
            f"x: last dimension must be a multiple of {NVFP4_BLOCK} for nvfp4 (got {k}); "
            f"pad K to a multiple of {NVFP4_BLOCK}"
        )
    if global_scale is None:
        global_scale = _global_scale_from(x, batch_dims)
    else:
        global_scale = _checked_global_scale(global_scale, x, batch_dims)
    blocks = x.float().reshape(*x.shape[:-1], k // NVFP4_BLOCK, NVFP4_BLOCK)
    per_block_global = broadcast_scale(global_scale, blocks.dim() - 1)  # [..., K/16]
    block_scale = to_e4m3(divide_by_constant(abs_max(blocks, -1), E2M1_MAX) / per_block_global)
    step = (block_scale.float() * per_block_global).unsqueeze(-1)
    scaled = torch.where(step > 0, blocks / step, torch.zeros_like(blocks))
    payload = pack_e2m1(e2m1_codes(scaled).reshape(x.shape))
    return payload, block_scale, global_scale


def dequantize_nvfp4(
    q: torch.Tensor,
    block_scale: torch.Tensor,
    global_scale: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """e2m1(unpack(q)) * float(block_scale) * global_scale; result ``[..., 2 * q.shape[-1]]``."""
    values = decode_e2m1(unpack_e2m1(q))
    if values.shape[-1] % NVFP4_BLOCK:
        raise MoEConfigError(
            f"q: holds K={values.shape[-1]} nvfp4 elements per row (shape {tuple(values.shape)} unpacked), "
            f"but K must be a multiple of {NVFP4_BLOCK}, one e4m3 scale per {NVFP4_BLOCK}"
        )
    expected = (*values.shape[:-1], values.shape[-1] // NVFP4_BLOCK)
    if tuple(block_scale.shape) != expected:
        raise MoEConfigError(
            f"block_scale: must have shape {expected} for nvfp4 elements of shape "
            f"{tuple(values.shape)} (got {tuple(block_scale.shape)})"
        )
    if block_scale.dtype != E4M3_DTYPE:
        raise MoEConfigError(f"block_scale: dtype must be {E4M3_DTYPE} (got {block_scale.dtype})")
    batch_shape = tuple(values.shape[: global_scale.dim()])
    is_batch_shaped = global_scale.dim() < values.dim() and global_scale.shape == batch_shape
    if global_scale.dtype != torch.float32 or not is_batch_shaped:
        raise MoEConfigError(
            f"global_scale: must be float32 shaped like the leading dims of the values "
            f"{tuple(values.shape)}, e.g. [E] or [] (got {global_scale.dtype} "
            f"{tuple(global_scale.shape)})"
        )
    blocks = values.reshape(*expected, NVFP4_BLOCK)
    blocks = blocks * block_scale.float().unsqueeze(-1)
    blocks = blocks * broadcast_scale(global_scale, blocks.dim())
    return blocks.reshape(values.shape).to(dtype)


def _global_scale_from(x: torch.Tensor, batch_dims: int) -> torch.Tensor:
    amax = abs_max(x, tuple(range(batch_dims, x.dim())))
    global_scale = divide_by_constant(amax, E4M3_MAX * E2M1_MAX)
    return torch.where(amax > 0, global_scale, torch.ones_like(amax))


def _checked_global_scale(
    global_scale: torch.Tensor | float, x: torch.Tensor, batch_dims: int
) -> torch.Tensor:
    batch_shape = tuple(x.shape[:batch_dims])
    value = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
    if not _broadcasts_to(tuple(value.shape), batch_shape):
        raise MoEConfigError(
            f"global_scale: shape {tuple(value.shape)} does not broadcast to {batch_shape} "
            f"(x.shape[:batch_dims] for x {tuple(x.shape)}, batch_dims={batch_dims})"
        )
    value = value.expand(batch_shape).contiguous()
    if not bool((torch.isfinite(value) & (value > 0)).all()):
        raise MoEConfigError(f"global_scale: must be finite and positive (got {_preview(value)})")
    return value


def _broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    if len(shape) > len(target):
        return False
    return all(
        size in (1, want) for size, want in zip(reversed(shape), reversed(target), strict=True)
    )


def _preview(values: torch.Tensor, limit: int = 8) -> str:
    shown = values.flatten()[:limit].tolist()
    return f"{shown} (first {limit} of {values.numel()})" if values.numel() > limit else str(shown)
