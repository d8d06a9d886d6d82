"""`QuantizedTensor` and the generic `quantize` / `dequantize` that dispatch on its `QuantFormat`;
`quantize_activations` (the hot path's form of `quantize`) and `row_layout` (one activation row's
columns and dtypes in a format, computed without quantizing anything).

The numerics live in the per-format modules (fp8.py, mx.py, nvfp4.py, fp4.py); this module only
picks one by format and role and records the result. Scale shapes by role::

    format       weight x [E, N, K]                     activation x [M, K]
    NONE         scale None                             scale None
    FP8_TENSOR   fp32 [E]                               fp32 []  (0-dim)
    FP8_ROW      fp32 [E, N, 1]                         fp32 [M, 1]
    FP8_BLOCK    fp32 [E, ceil(N/128), ceil(K/128)]     fp32 [M, ceil(K/128)]
    MXFP8        uint8 e8m0 [E, N, K/32]                uint8 e8m0 [M, K/32]
    MXFP4        uint8 e8m0 [E, N, K/32]                uint8 e8m0 [M, K/32]
    NVFP4        e4m3 [E, N, K/16], global fp32 [E]     e4m3 [M, K/16], global fp32 []

Example::

    >>> w = torch.randn(8, 256, 128)                   # E=8 experts, N=256, K=128
    >>> q = quantize(w, QuantFormat.MXFP4, "weight")
    >>> q.data.shape, q.scale.shape, q.shape           # payload halved, logical shape kept
    (torch.Size([8, 256, 64]), torch.Size([8, 256, 4]), torch.Size([8, 256, 128]))
    >>> dequantize(q).shape
    torch.Size([8, 256, 128])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from moe.errors import MoEConfigError
from moe.quant import fp8, mx, nvfp4
from moe.quant.fp8 import E4M3_DTYPE, check_quantize_input
from moe.quant.scheme import QuantFormat

Role = Literal["weight", "activation"]
ROLES: tuple[str, ...] = ("weight", "activation")
_RANK = {"weight": 3, "activation": 2}  # weights are [E, N, K], activations [M, K]
_RANK_LAYOUT = {"weight": "[E, N, K]", "activation": "[M, K]"}

# (payload dtype, scale dtype) of each quantized format; global_scale is fp32 and NVFP4-only.
_STORAGE_DTYPES = {
    QuantFormat.FP8_TENSOR: (E4M3_DTYPE, torch.float32),
    QuantFormat.FP8_ROW: (E4M3_DTYPE, torch.float32),
    QuantFormat.FP8_BLOCK: (E4M3_DTYPE, torch.float32),
    QuantFormat.MXFP8: (E4M3_DTYPE, torch.uint8),
    QuantFormat.MXFP4: (torch.uint8, torch.uint8),
    QuantFormat.NVFP4: (torch.uint8, E4M3_DTYPE),
}
# An activation row's scales: one per group of this many elements along K (the last group may be
# short), or one for the whole row (None). FP8_TENSOR has none per row: its scale covers the batch.
_ROW_SCALE_GROUP = {
    QuantFormat.FP8_ROW: None,
    QuantFormat.FP8_BLOCK: fp8.FP8_GROUP_SIZE,
    QuantFormat.MXFP8: mx.MX_BLOCK,
    QuantFormat.MXFP4: mx.MX_BLOCK,
    QuantFormat.NVFP4: nvfp4.NVFP4_BLOCK,
}
# Formats with a scale computed over the whole batch: FP8_TENSOR's only scale, NVFP4's global one.
_BATCH_SCALED = frozenset({QuantFormat.FP8_TENSOR, QuantFormat.NVFP4})


@dataclass(frozen=True, kw_only=True)
class QuantizedTensor:
    """One tensor in a `QuantFormat`, with the scales needed to dequantize it (table above)."""

    data: torch.Tensor  # payload: e4m3, uint8 packed e2m1 (last dim halved), or x itself for NONE
    scale: torch.Tensor | None  # fp32 (FP8_*), uint8 e8m0 (MX*), e4m3 (NVFP4); None for NONE
    global_scale: torch.Tensor | None = None  # NVFP4 only: fp32 dequant multiplier, [E] or 0-dim
    fmt: QuantFormat  # how data and scale are stored
    # "weight" ([E, N, K]) or "activation" ([M, K], or [E, T, K] batched). Only FP8_BLOCK reads it
    # (128x128 blocks vs 1x128 groups); a wrong role there fails dequantize's scale-shape check.
    role: Role = "activation"

    def __post_init__(self) -> None:
        object.__setattr__(self, "fmt", QuantFormat.parse(self.fmt))
        _check_role(self.role)
        if self.fmt is QuantFormat.NONE:
            if self.scale is not None or self.global_scale is not None:
                raise MoEConfigError("scale: must be None for QuantFormat.NONE (got a tensor)")
            return
        data_dtype, scale_dtype = _STORAGE_DTYPES[self.fmt]
        if self.data.dtype != data_dtype or self.scale is None or self.scale.dtype != scale_dtype:
            got = None if self.scale is None else self.scale.dtype
            raise MoEConfigError(
                f"data/scale: {self.fmt!r} stores {data_dtype} data with {scale_dtype} scales "
                f"(got {self.data.dtype} data with {got} scales)"
            )
        needs_global = self.fmt is QuantFormat.NVFP4
        if needs_global != (self.global_scale is not None):
            raise MoEConfigError(
                f"global_scale: {self.fmt!r} {'needs' if needs_global else 'takes no'} global scale"
            )

    @property
    def shape(self) -> torch.Size:
        """The logical (dequantized) shape: the payload's, with the last dim doubled for fp4."""
        if not self.fmt.is_packed_fp4:
            return self.data.shape
        return torch.Size((*self.data.shape[:-1], 2 * self.data.shape[-1]))


# Weights are quantized this many elements at a time (whole experts): the quantizers hold a few float32
# and int64 copies of their input, which for a whole GPT-OSS-120B w13 (2.1 G elements) is ~60 GB.
WEIGHT_CHUNK_ELEMENTS = 1 << 27


def quantize(
    x: torch.Tensor, fmt: QuantFormat, role: Role, *, check_finite: bool = True
) -> QuantizedTensor:
    """Store ``x`` (weight ``[E, N, K]`` or activation ``[M, K]``) in ``fmt``; see the table.

    ``check_finite=False`` skips the NaN/inf scan (a host sync on GPU); for the hot path only.
    Weights are quantized a few experts at a time (every weight scale is per expert or finer, so
    the result is the same) to bound the temporaries' memory.
    """
    fmt = QuantFormat.parse(fmt)
    _check_role(role)
    _check_rank(x, role)
    per_chunk = max(1, WEIGHT_CHUNK_ELEMENTS // max(1, x[0].numel())) if role == "weight" and len(x) else 0
    if fmt is QuantFormat.NONE or not per_chunk or len(x) <= per_chunk:
        return _quantize_whole(x, fmt, role, check_finite)
    parts = [_quantize_whole(x[i : i + per_chunk], fmt, role, check_finite) for i in range(0, len(x), per_chunk)]
    joined = {name: None if getattr(parts[0], name) is None else torch.cat([getattr(q, name) for q in parts])
              for name in ("data", "scale", "global_scale")}
    return QuantizedTensor(**joined, fmt=fmt, role=role)


def _quantize_whole(x: torch.Tensor, fmt: QuantFormat, role: Role, check_finite: bool) -> QuantizedTensor:
    finite = dict(check_finite=check_finite)
    batch_dims = 1 if role == "weight" else 0  # weights get per-expert tensor/global scales
    global_scale = None
    if fmt is QuantFormat.NONE:
        check_quantize_input(x, "x", finite=check_finite)
        data, scale = x, None
    elif fmt is QuantFormat.FP8_TENSOR:
        data, scale = fp8.quantize_fp8_per_tensor(x, batch_dims, **finite)
    elif fmt is QuantFormat.FP8_ROW:
        data, scale = fp8.quantize_fp8_rowwise(x, **finite)
    elif fmt is QuantFormat.FP8_BLOCK and role == "weight":
        data, scale = fp8.quantize_fp8_blockwise(x, fp8.FP8_BLOCK_SHAPE, **finite)
    elif fmt is QuantFormat.FP8_BLOCK:
        data, scale = fp8.quantize_fp8_groupwise(x, fp8.FP8_GROUP_SIZE, **finite)
    elif fmt is QuantFormat.MXFP8:
        data, scale = mx.quantize_mxfp8(x, **finite)
    elif fmt is QuantFormat.MXFP4:
        data, scale = mx.quantize_mxfp4(x, **finite)
    else:
        assert fmt is QuantFormat.NVFP4, fmt
        data, scale, global_scale = nvfp4.quantize_nvfp4(x, batch_dims, **finite)
    return QuantizedTensor(data=data, scale=scale, global_scale=global_scale, fmt=fmt, role=role)


def quantize_activations(hidden: torch.Tensor, fmt: QuantFormat) -> QuantizedTensor:
    """``hidden [M, H]`` in ``fmt`` (unchanged for NONE); M = 0 gives empty data and scales."""
    if fmt is QuantFormat.NONE:
        return QuantizedTensor(data=hidden, scale=None, global_scale=None, fmt=fmt)
    # no NaN scan here: it would sync the host on every call, and a NaN still shows in the output
    return quantize(hidden, fmt, role="activation", check_finite=False)


@dataclass(frozen=True)
class RowLayout:
    """How `quantize_activations` stores one row of H activations: what a buffer of rows needs.

    Example: FP8_BLOCK at H=4096 -> 4096 e4m3 data columns, 32 float32 scale columns; NVFP4 at H=4096
    -> 2048 uint8 data columns (two e2m1 per byte), 256 e4m3 scale columns and ``batch_scale`` (its
    fp32 global scale is computed over the whole batch); FP8_TENSOR -> no per-row scale columns.
    """

    data_columns: int  # payload elements per row: H, or H/2 for packed fp4
    data_dtype: torch.dtype  # the activations' own dtype for NONE
    scale_columns: int  # per-row scale elements; 0 when the format keeps no scale per row
    scale_dtype: torch.dtype | None  # None exactly when scale_columns == 0
    batch_scale: bool  # a scale taken over the whole batch (FP8_TENSOR's, NVFP4's global scale)

    @property
    def row_scaled(self) -> bool:
        """True when quantized with scales of single rows only: a row's bytes do not depend on the
        other rows of its batch, so a row can be quantized anywhere (fp8 per token or group, MX)."""
        return self.scale_columns > 0 and not self.batch_scale


def row_layout(fmt: QuantFormat, hidden_size: int, dtype: torch.dtype) -> RowLayout:
    """The `RowLayout` of ``[M, hidden_size]`` activations of ``dtype`` in ``fmt``, computed from the
    format's declaration alone. Raises `MoEConfigError` where `quantize` would refuse the row size."""
    fmt = QuantFormat.parse(fmt)
    if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size <= 0:
        raise MoEConfigError(f"hidden_size must be a positive int (got {hidden_size!r})")
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise MoEConfigError(f"dtype: activations must have a floating-point torch.dtype (got {dtype!r})")
    if hidden_size % fmt.k_multiple:
        raise MoEConfigError(
            f"hidden_size: {fmt.value} stores rows of a multiple of {fmt.k_multiple} elements "
            f"(got {hidden_size}); pad H to a multiple of {fmt.k_multiple}"
        )
    if fmt is QuantFormat.NONE:
        return RowLayout(hidden_size, dtype, 0, None, batch_scale=False)
    data_dtype, scale_dtype = _STORAGE_DTYPES[fmt]
    data_columns = hidden_size // 2 if fmt.is_packed_fp4 else hidden_size
    if fmt not in _ROW_SCALE_GROUP:
        return RowLayout(data_columns, data_dtype, 0, None, batch_scale=fmt in _BATCH_SCALED)
    group = _ROW_SCALE_GROUP[fmt] or hidden_size
    return RowLayout(data_columns, data_dtype, -(-hidden_size // group), scale_dtype, fmt in _BATCH_SCALED)


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values ``q`` stands for, in ``dtype``, shaped like the tensor that was quantized."""
    fmt = q.fmt
    if fmt is QuantFormat.NONE:
        return q.data.to(dtype)
    if fmt is QuantFormat.FP8_TENSOR:
        return fp8.dequantize_fp8_per_tensor(q.data, q.scale, dtype)
    if fmt is QuantFormat.FP8_ROW:
        return fp8.dequantize_fp8_rowwise(q.data, q.scale, dtype)
    if fmt is QuantFormat.FP8_BLOCK and q.role == "weight":
        return fp8.dequantize_fp8_blockwise(q.data, q.scale, fp8.FP8_BLOCK_SHAPE, dtype)
    if fmt is QuantFormat.FP8_BLOCK:
        return fp8.dequantize_fp8_groupwise(q.data, q.scale, fp8.FP8_GROUP_SIZE, dtype)
    if fmt is QuantFormat.MXFP8:
        return mx.dequantize_mxfp8(q.data, q.scale, dtype)
    if fmt is QuantFormat.MXFP4:
        return mx.dequantize_mxfp4(q.data, q.scale, dtype)
    assert fmt is QuantFormat.NVFP4, fmt
    return nvfp4.dequantize_nvfp4(q.data, q.scale, q.global_scale, dtype)


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise MoEConfigError(f"role: must be one of {', '.join(ROLES)} (got {role!r})")


def _check_rank(x: torch.Tensor, role: Role) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != _RANK[role]:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise MoEConfigError(
            f"x: a {role} must be {_RANK_LAYOUT[role]} ({_RANK[role]} dims) for quantize "
            f"(got {got})"
        )
