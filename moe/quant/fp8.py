"""FP8 (e4m3) quantization with fp32 scales: per tensor, per row, per 2-D block, per 1-D group.

Also the pieces every quantizer shares: the input check, the e4m3 cast and the abs-max reduction.

Conventions (tested in tests/test_quant.py):

- The payload is ``torch.float8_e4m3fn``: no infinities, largest finite value ``E4M3_MAX = 448``.
- ``scale = amax / 448`` over each group, in fp32; an all-zero (or empty) group gets
  ``scale = 1.0``, so the scale is never 0 and dequantization never divides by it.
- ``q = e4m3(clamp(x / scale, -448, 448))``. The clamp keeps a quotient that rounds a hair above 448
  from becoming NaN; torch's cast rounds to nearest, ties to even.
- ``dequantize = float(q) * scale``.
- Partial blocks/groups at the right and bottom edges are allowed: they are scaled over the elements
  they hold (the padding is zero and never raises the amax).

Scale shapes for ``x [..., N, K]``::

    per tensor   quantize_fp8_per_tensor(x, batch_dims)   x.shape[:batch_dims]  ([E] for weights)
    per row      quantize_fp8_rowwise(x)                  [..., N, 1]
    per block    quantize_fp8_blockwise(x, (128, 128))    [..., ceil(N/128), ceil(K/128)]
    per group    quantize_fp8_groupwise(x, 128)           [..., N, ceil(K/128)]

Every quantizer returns ``(payload, scale)``. Every quantizer rejects NaN or infinity in its input
with `MoEConfigError` naming the argument; this costs one device sync on GPU.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from moe.errors import MoEConfigError

E4M3_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0
FP8_BLOCK_SHAPE = (128, 128)  # weight block of the FP8_BLOCK format (rows of N, columns of K)
FP8_GROUP_SIZE = 128  # activation group of the FP8_BLOCK format, along K

QUANTIZABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_quantize_input(
    x: torch.Tensor, argument: str = "x", min_dims: int = 0, finite: bool = True
) -> None:
    """Raise MoEConfigError unless ``x`` is a finite fp32/fp16/bf16 tensor of ``min_dims``+ dims.

    ``finite=False`` skips the NaN/inf scan, which reads a flag back to the host (a device sync):
    activations quantized on the hot path skip it, weights at load never do.
    """
    if not isinstance(x, torch.Tensor):
        raise MoEConfigError(f"{argument}: expected a torch.Tensor (got {type(x).__name__})")
    if x.dtype not in QUANTIZABLE_DTYPES:
        allowed = ", ".join(str(d) for d in QUANTIZABLE_DTYPES)
        raise MoEConfigError(f"{argument}: dtype must be one of {allowed} (got {x.dtype})")
    if x.dim() < min_dims:
        raise MoEConfigError(
            f"{argument}: needs at least {min_dims} dimensions (got shape {tuple(x.shape)})"
        )
    if finite and not bool(torch.isfinite(x).all()):
        what = "NaN" if bool(torch.isnan(x).any()) else "inf"
        raise MoEConfigError(
            f"{argument} contains {what}; quantization needs finite values "
            f"(find where the {what} was produced upstream)"
        )


def abs_max(x: torch.Tensor, dim: int | Sequence[int], keepdim: bool = False) -> torch.Tensor:
    """max |x| over ``dim`` in fp32; 0 where the reduced set is empty."""
    if x.numel() == 0:
        # torch.amax refuses empty reductions; a sum of nothing is 0 and has the same output shape.
        return x.float().abs().sum(dim=dim, keepdim=keepdim)
    return x.float().abs().amax(dim=dim, keepdim=keepdim)


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to e4m3, saturating at ±448 instead of producing NaN."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3_DTYPE)


def divide_by_constant(x: torch.Tensor, constant: float) -> torch.Tensor:
    """``x / constant``, correctly rounded on every device.

    On CUDA, torch computes ``tensor / python_float`` as ``tensor * (1 / python_float)``, which can
    differ from the true quotient in the last bit (seen on an H100: amax / 448). Dividing by a
    tensor of the constant keeps CPU and GPU results bit-identical.
    """
    return x / torch.full_like(x, constant)


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """The fp32 scale amax / 448; 1.0 where amax is 0."""
    return torch.where(amax > 0, divide_by_constant(amax, E4M3_MAX), torch.ones_like(amax))


# --- per tensor ---------------------------------------------------------------------------------


def quantize_fp8_per_tensor(
    x: torch.Tensor, batch_dims: int = 0, *, check_finite: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per index of the first ``batch_dims`` dims: scale ``x.shape[:batch_dims]``."""
    check_quantize_input(x, "x", min_dims=1, finite=check_finite)
    check_batch_dims(x, batch_dims)
    scale = fp8_scale(abs_max(x, tuple(range(batch_dims, x.dim()))))
    return to_e4m3(x.float() / broadcast_scale(scale, x.dim())), scale


def dequantize_fp8_per_tensor(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """float(q) * scale, with ``scale.shape == q.shape[:scale.dim()]``."""
    _check_payload(q, scale, expected_scale_shape=tuple(q.shape[: scale.dim()]))
    return (q.float() * broadcast_scale(scale, q.dim())).to(dtype)


# --- per row (per output channel of a weight, per token of an activation) -------------------------


def quantize_fp8_rowwise(
    x: torch.Tensor, *, check_finite: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per row (all leading indices): scale shape ``[..., N, 1]``."""
    check_quantize_input(x, "x", min_dims=1, finite=check_finite)
    scale = fp8_scale(abs_max(x, -1, keepdim=True))
    return to_e4m3(x.float() / scale), scale


def dequantize_fp8_rowwise(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """float(q) * scale, with ``scale`` of shape ``[..., N, 1]``."""
    _check_payload(q, scale, expected_scale_shape=(*q.shape[:-1], 1))
    return (q.float() * scale).to(dtype)


# --- per block of the last two dims / per group of the last dim -----------------------------------


def quantize_fp8_blockwise(
    x: torch.Tensor, block: tuple[int, int] = FP8_BLOCK_SHAPE, *, check_finite: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per ``block`` tile of the last two dims: ``[..., ceil(N/bn), ceil(K/bk)]``."""
    check_quantize_input(x, "x", min_dims=2, finite=check_finite)
    _check_block("block", block, 2)
    return _quantize_tiles(x, block)


def dequantize_fp8_blockwise(
    q: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] = FP8_BLOCK_SHAPE,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """float(q) * scale of its block; ``scale`` shaped ``[..., ceil(N/bn), ceil(K/bk)]``."""
    _check_block("block", block, 2)
    return _dequantize_tiles(q, scale, block, dtype)


def quantize_fp8_groupwise(
    x: torch.Tensor, group_size: int = FP8_GROUP_SIZE, *, check_finite: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per ``group_size`` consecutive elements of the last dim: ``[..., ceil(K/g)]``."""
    check_quantize_input(x, "x", min_dims=1, finite=check_finite)
    _check_block("group_size", (group_size,), 1)
    return _quantize_tiles(x, (group_size,))


def dequantize_fp8_groupwise(
    q: torch.Tensor,
    scale: torch.Tensor,
    group_size: int = FP8_GROUP_SIZE,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """float(q) * scale of its group; ``scale`` shaped ``[..., ceil(K/group_size)]``."""
    _check_block("group_size", (group_size,), 1)
    return _dequantize_tiles(q, scale, (group_size,), dtype)


def _quantize_tiles(x: torch.Tensor, block: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    tiled = _tile(x.float(), block)
    # In the tiled view [..., n1, b1, n2, b2] the within-tile dims are the odd ones from the end.
    within = tuple(-1 - 2 * i for i in range(len(block)))
    scale = fp8_scale(abs_max(tiled, within))
    return to_e4m3(x.float() / expand_tiles(scale, block, x.shape)), scale


def _dequantize_tiles(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    r = len(block)
    tiles = tuple(math.ceil(d / b) for d, b in zip(q.shape[-r:], block, strict=True))
    _check_payload(q, scale, expected_scale_shape=(*q.shape[:-r], *tiles))
    return (q.float() * expand_tiles(scale, block, q.shape)).to(dtype)


def _tile(x: torch.Tensor, block: tuple[int, ...]) -> torch.Tensor:
    """View the last len(block) dims [D1, D2] as [n1, b1, n2, b2], zero-padding the edge tiles."""
    r = len(block)
    trailing = x.shape[-r:]
    padding: list[int] = []  # F.pad lists (left, right) pairs from the last dim backwards
    for size, b in zip(reversed(trailing), reversed(block), strict=True):
        padding += [0, -size % b]
    padded = F.pad(x, padding)
    shape = list(x.shape[:-r])
    for size, b in zip(padded.shape[-r:], block, strict=True):
        shape += [size // b, b]
    return padded.reshape(shape)


def expand_tiles(
    scale: torch.Tensor, block: tuple[int, ...], shape: torch.Size | tuple[int, ...]
) -> torch.Tensor:
    """Repeat a per-tile ``scale [..., n1, n2]`` to one value per element of ``[..., D1, D2]``."""
    r = len(block)
    for i, (b, size) in enumerate(zip(block, shape[-r:], strict=True)):
        dim = i - r
        scale = scale.repeat_interleave(b, dim=dim).narrow(dim, 0, size)
    return scale


def broadcast_scale(scale: torch.Tensor, dims: int) -> torch.Tensor:
    """Append size-1 dims to a per-batch ``scale`` until it has ``dims`` dims."""
    return scale.reshape(*scale.shape, *([1] * (dims - scale.dim())))


def check_batch_dims(x: torch.Tensor, batch_dims: int) -> None:
    """Raise MoEConfigError unless 0 <= batch_dims < x.dim()."""
    if not 0 <= batch_dims < x.dim():
        raise MoEConfigError(
            f"batch_dims: must be in [0, {x.dim()}) for x of shape {tuple(x.shape)} "
            f"(got {batch_dims})"
        )


def _check_block(argument: str, block: Sequence[int], length: int) -> None:
    is_ints = isinstance(block, (tuple, list)) and all(
        isinstance(b, int) and not isinstance(b, bool) for b in block
    )
    if not is_ints or len(block) != length or any(b < 1 for b in block):
        shown = tuple(block) if isinstance(block, (tuple, list)) else block
        raise MoEConfigError(f"{argument}: must be {length} positive integer(s) (got {shown!r})")


def _check_payload(
    q: torch.Tensor, scale: torch.Tensor, expected_scale_shape: tuple[int, ...]
) -> None:
    if q.dtype != E4M3_DTYPE:
        raise MoEConfigError(f"q: dtype must be {E4M3_DTYPE} (got {q.dtype})")
    if scale.dtype != torch.float32 or tuple(scale.shape) != tuple(expected_scale_shape):
        raise MoEConfigError(
            f"scale: must be float32 of shape {tuple(expected_scale_shape)} for q of shape "
            f"{tuple(q.shape)} (got {scale.dtype} {tuple(scale.shape)})"
        )
