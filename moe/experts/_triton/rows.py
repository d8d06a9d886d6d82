"""Per-row helpers around the GEMMs: fp8 activation quantization and the weighted sum over k.

Both work on row-major ``[rows, K]`` buffers and take a row-validity rule, because some rows of a
workspace buffer hold nothing (slots whose expert is elsewhere; batched rows past an expert's
count) and must neither be read into a per-tensor amax nor be summed.

The quantization follows `moe.quant.fp8` exactly: ``scale = amax / 448`` (1.0 for an all-zero
group), ``q = e4m3(clamp(x / scale, -448, 448))``, rounding to nearest even.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from moe.experts._triton import kernels
from moe.quant import QuantFormat, QuantizedTensor, dequantize, quantize

FP8_MODES = {QuantFormat.FP8_TENSOR: 1, QuantFormat.FP8_ROW: 2, QuantFormat.FP8_BLOCK: 3}
GROUP = 128  # FP8_BLOCK activation group along K
_BLOCK_R = 16


@dataclass(frozen=True)
class RowValidity:
    """Which rows of a ``[rows, K]`` buffer hold data: all, ``local_ids[row] >= 0``, or batched."""

    local_ids: torch.Tensor | None = None  # int32 [rows]
    counts: torch.Tensor | None = None  # int32 [E]: rows e*T .. e*T + counts[e] - 1 hold data
    rows_per_expert: int = 1  # T, with counts

    def kernel_args(self, fallback: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        if self.local_ids is not None:
            return self.local_ids, self.rows_per_expert, 1
        if self.counts is not None:
            return self.counts, self.rows_per_expert, 2
        return fallback, 1, 0

    def mask(self, num_rows: int, device) -> torch.Tensor:
        """Bool ``[rows]``, for the twins."""
        if self.local_ids is not None:
            return self.local_ids[:num_rows] >= 0
        if self.counts is not None:
            rows = torch.arange(num_rows, device=device)
            return rows % self.rows_per_expert < self.counts.long()[rows // self.rows_per_expert]
        return torch.ones(num_rows, dtype=torch.bool, device=device)


def fp8_scale_shape(fmt: QuantFormat, rows: int, k: int) -> tuple[int, ...]:
    """Shape of the activation scales for ``[rows, k]`` in ``fmt`` (as `moe.quant.quantize` makes)."""
    if fmt is QuantFormat.FP8_TENSOR:
        return ()
    if fmt is QuantFormat.FP8_ROW:
        return (rows, 1)
    return (rows, triton.cdiv(k, GROUP))


def quantize_fp8_rows(
    x: torch.Tensor,
    fmt: QuantFormat,
    q: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor,
    validity: RowValidity = RowValidity(),
) -> QuantizedTensor:
    """``x [rows, K]`` -> e4m3 ``q [rows, K]`` and ``scale`` (see `fp8_scale_shape`), in place.

    ``amax`` is an fp32 scratch scalar (``[1]``), used by FP8_TENSOR only. Invalid rows of ``q`` and
    ``scale`` are left as they were.
    """
    _rows = kernels("rows")
    rows, k = x.shape
    mode = FP8_MODES[fmt]
    valid_ptr, rows_per_expert, valid_mode = validity.kernel_args(x)
    grid = (triton.cdiv(rows, _BLOCK_R),)
    block_k = GROUP if fmt is QuantFormat.FP8_BLOCK else min(256, triton.next_power_of_2(k))
    if fmt is QuantFormat.FP8_TENSOR:
        amax.zero_()
        _rows.amax_kernel[grid](x, amax, valid_ptr, rows, k, rows_per_expert, x.stride(0),
                                VALID=valid_mode, BLOCK_R=_BLOCK_R, BLOCK_K=block_k)
    s_strides = tuple(scale.stride()) + (0, 0)
    _rows.fp8_quant_kernel[grid](
        x, q, scale, amax, valid_ptr, rows, k, rows_per_expert,
        x.stride(0), q.stride(0), s_strides[0], s_strides[1],
        MODE=mode, VALID=valid_mode, BLOCK_R=_BLOCK_R, BLOCK_K=block_k,
    )
    return QuantizedTensor(data=q, scale=scale, fmt=fmt)


def quantize_fp8_rows_reference(
    x: torch.Tensor, fmt: QuantFormat, validity: RowValidity = RowValidity()
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin: float32 ``(dequantized valid rows, mask)``; invalid rows are zero."""
    mask = validity.mask(x.shape[0], x.device)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if mask.any():
        out[mask] = dequantize(quantize(x[mask], fmt, role="activation"), torch.float32)
    return out, mask


def combine_slots(
    y: torch.Tensor, topk_weights: torch.Tensor, local_ids: torch.Tensor | None, out: torch.Tensor
) -> torch.Tensor:
    """``out [M, H] = sum_j topk_weights[m, j] * y[m*k + j]`` over slots with ``local_ids >= 0``."""
    _rows = kernels("rows")
    num_tokens, top_k = topk_weights.shape
    hidden = out.shape[1]
    block_h = min(1024, triton.next_power_of_2(hidden))
    grid = (num_tokens, triton.cdiv(hidden, block_h))
    check = local_ids is not None
    _rows.combine_kernel[grid](
        y, topk_weights, local_ids if check else topk_weights, out, hidden, y.stride(0), out.stride(0),
        TOP_K=top_k, CHECK_LOCAL=check, BLOCK_H=block_h,
    )
    return out


def combine_slots_reference(
    y: torch.Tensor, topk_weights: torch.Tensor, local_ids: torch.Tensor | None
) -> torch.Tensor:
    """Torch twin of `combine_slots`, float32."""
    num_tokens, top_k = topk_weights.shape
    weights = topk_weights.float()
    if local_ids is not None:
        weights = torch.where(local_ids.view(num_tokens, top_k) >= 0, weights, 0.0)
    per_slot = y[: num_tokens * top_k].float().view(num_tokens, top_k, -1)
    per_slot = torch.where(weights.unsqueeze(-1) != 0, per_slot, 0.0)  # garbage rows never count
    return (weights.unsqueeze(-1) * per_slot).sum(1)
