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

from moe.experts._triton import cdiv, kernels, next_power_of_2
from moe.formats import OutputKind
from moe.prepare_finalize.combine import sum_over_k
from moe.quant import QuantFormat, QuantizedTensor, dequantize, quantize

FP8_MODES = {QuantFormat.FP8_TENSOR: 1, QuantFormat.FP8_ROW: 2, QuantFormat.FP8_BLOCK: 3}
GROUP = 128  # FP8_BLOCK activation group along K
_BLOCK_R = 16
# FP8_BLOCK with fewer row blocks than this gives each (row block, 128-column group) its own program; with more,
# each row block's program loops over K (benchmarks/results/fp8_quant_grid_nvidia-h200.json, H200: the DeepSeek
# slice's intermediate at M = 1024, 640 row blocks, 30.5 -> 23.0 us; at M = 16384, 8448 row blocks, the loop
# 218.7 against 235.3 us; GPT-OSS's at 16384, 4608 row blocks, 176.2 against 192.2 us)
LOOP_ROW_BLOCKS = 4096


@dataclass(frozen=True)
class RowValidity:
    """Which rows of a ``[rows, K]`` buffer hold data: all; the slots whose expert is on this rank
    (``expert_map[topk_ids[row]] >= 0``); or batched rows (``row % T < counts[row // T]``)."""

    topk_ids: torch.Tensor | None = None  # int32 [rows]: flattened [M, k] global ids
    expert_map: torch.Tensor | None = None  # int32 [E]: global -> local id, -1 elsewhere
    counts: torch.Tensor | None = None  # int32 [E]: rows e*T .. e*T + counts[e] - 1 hold data
    rows_per_expert: int = 1  # T, with counts

    @classmethod
    def slots_here(cls, topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> "RowValidity":
        """Slot rows of the standard format; all of them without an expert map."""
        return cls(topk_ids.reshape(-1), expert_map) if expert_map is not None else cls()

    def kernel_args(self, fallback: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """(valid_ptr, map_ptr, rows_per_expert, VALID mode) for the kernels."""
        if self.expert_map is not None:
            return self.topk_ids, self.expert_map, 1, 1
        if self.counts is not None:
            return self.counts, self.counts, self.rows_per_expert, 2
        return fallback, fallback, 1, 0

    def mask(self, num_rows: int, device) -> torch.Tensor:
        """Bool ``[rows]``, for the twins."""
        if self.expert_map is not None:
            return self.expert_map.long()[self.topk_ids[:num_rows].long()] >= 0
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
    return (rows, cdiv(k, GROUP))


def fp8_group_programs(fmt: QuantFormat, rows: int, k: int) -> int:
    """Programs per row block of `quantize_fp8_rows`' kernel: one per 128-column group (FP8_BLOCK while
    row blocks are few, `LOOP_ROW_BLOCKS`), else one looping over K."""
    if fmt is QuantFormat.FP8_BLOCK and cdiv(rows, _BLOCK_R) < LOOP_ROW_BLOCKS:
        return cdiv(k, GROUP)
    return 1


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
    valid_ptr, map_ptr, rows_per_expert, valid_mode = validity.kernel_args(x)
    grid = (cdiv(rows, _BLOCK_R),)
    block_k = GROUP if fmt is QuantFormat.FP8_BLOCK else min(256, next_power_of_2(k))
    quant_grid = (grid[0], fp8_group_programs(fmt, rows, k))
    if fmt is QuantFormat.FP8_TENSOR:
        amax.zero_()
        _rows.amax_kernel[grid](x, amax, valid_ptr, map_ptr, rows, k, rows_per_expert, x.stride(0),
                                VALID=valid_mode, BLOCK_R=_BLOCK_R, BLOCK_K=block_k)
    s_strides = tuple(scale.stride()) + (0, 0)
    _rows.fp8_quant_kernel[quant_grid](
        x, q, scale, amax, valid_ptr, map_ptr, rows, k, rows_per_expert,
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


def combine_slots_kernel(
    y: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor | None,
    out: torch.Tensor, slot_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out [M, H] = sum_j topk_weights[m, j] * y[m*k + j]`` over the slots whose expert is here
    (``expert_map[topk_ids] >= 0``; all of them without a map). ``slot_rows`` (int32 ``[M*k]``, a `BlockLayout`'s):
    ``y`` holds the rows in sorted order, slot s's at ``y[slot_rows[s]]``."""
    _rows = kernels("rows")
    num_tokens, top_k = topk_weights.shape
    hidden = out.shape[1]
    block_h = min(1024, next_power_of_2(hidden))
    grid = (num_tokens, cdiv(hidden, block_h))
    check = expert_map is not None
    sorted_rows = slot_rows is not None
    _rows.combine_kernel[grid](
        y, topk_weights, topk_ids, expert_map if check else topk_ids, slot_rows if sorted_rows else topk_ids, out,
        hidden, y.stride(0), out.stride(0), TOP_K=top_k, CHECK_LOCAL=check, SORTED=sorted_rows, BLOCK_H=block_h,
    )
    return out


def combine_slots_reference(
    y: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor | None
) -> torch.Tensor:
    """Torch twin of `combine_slots_kernel`, float32: `sum_over_k` of the slots whose expert is here."""
    num_tokens, top_k = topk_weights.shape
    here = None if expert_map is None else expert_map.long()[topk_ids.long()] >= 0  # others hold garbage
    per_slot = y[: num_tokens * top_k].view(num_tokens, top_k, -1)
    return sum_over_k(per_slot, topk_weights, OutputKind.PER_SLOT, valid=here)
