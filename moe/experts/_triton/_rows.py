"""Triton code of the per-row helpers (see rows.py for the contracts and the torch twins)."""

import triton
import triton.language as tl

from moe.experts._triton._lang import max_

E4M3_MAX = tl.constexpr(448.0)

# quantization modes (rows.FP8_MODES)
_TENSOR = tl.constexpr(1)
_ROW = tl.constexpr(2)
_GROUP = tl.constexpr(3)

# which rows hold data (rows.VALID_*)
_ALL = tl.constexpr(0)
_HERE = tl.constexpr(1)  # slot rows whose expert is on this rank: map_ptr[valid_ptr[row]] >= 0
_BATCHED = tl.constexpr(2)  # row = e * T + m with m < counts[e]


@triton.jit
def _valid_rows(rows, num_rows, valid_ptr, map_ptr, rows_per_expert, VALID: tl.constexpr):
    ok = rows < num_rows
    if VALID == _HERE:
        expert = tl.load(valid_ptr + rows, mask=ok, other=0)
        ok = ok & (tl.load(map_ptr + expert, mask=ok, other=-1) >= 0)
    elif VALID == _BATCHED:
        count = tl.load(valid_ptr + rows // rows_per_expert, mask=ok, other=0)
        ok = ok & (rows % rows_per_expert < count)
    return ok


@triton.jit
def _scale_of(amax):
    return tl.where(amax > 0.0, amax / E4M3_MAX, 1.0)


@triton.jit
def _group_scales(x):
    """The fp8 scale of each row of a float32 ``[rows, 128]`` group tile (`_scale_of` its abs-max): the
    one rule of FP8_BLOCK activations, here and in the decode GEMM's K loop (_decode_fp8.py)."""
    return _scale_of(max_(tl.abs(x), 1))


@triton.jit
def _row_scales(x_rows, ok, K, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """The fp8 scale of each row from its abs-max over all K columns (FP8_ROW): ``x_rows [BLOCK_R, 1]``
    row pointers, ``ok [BLOCK_R]`` the rows to read (others get 1). Here and in _decode_fp8.py."""
    cols = tl.arange(0, BLOCK_K)
    best = tl.full([BLOCK_R, BLOCK_K], 0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask = ok[:, None] & (k0 + cols[None, :] < K)
        x = tl.load(x_rows + k0 + cols[None, :], mask=mask, other=0.0)
        best = tl.maximum(best, tl.abs(x.to(tl.float32)))
    return _scale_of(max_(best, 1))


@triton.jit
def _to_e4m3(x, scale):
    """e4m3(clamp(x / scale)), rounding to nearest even in fp32 first.

    The explicit rounding makes the final cast exact: Triton's CPU interpreter truncates the carry
    of a rounded-up mantissa (124 -> 64 instead of 128); GPUs round correctly either way.
    """
    q = x / scale
    q = tl.minimum(tl.maximum(q, -E4M3_MAX), E4M3_MAX)
    binade = (q.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    ulp = tl.maximum(binade * 0.125, 0.001953125)  # 3 mantissa bits; 2**-9 below the normals
    magic = ulp * 12582912.0  # 1.5 * 2**23 * ulp: adding it rounds to a multiple of ulp
    q = (q + magic) - magic
    return q.to(tl.float8e4nv)


@triton.jit(do_not_specialize=["num_rows", "rows_per_expert"])
def amax_kernel(x_ptr, amax_ptr, valid_ptr, map_ptr, num_rows, K, rows_per_expert, stride_xm,
                VALID: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """``amax_ptr[0] = max(amax_ptr[0], max |x|)`` over the valid rows of this program's tile."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = _valid_rows(rows, num_rows, valid_ptr, map_ptr, rows_per_expert, VALID)
    cols = tl.arange(0, BLOCK_K)
    best = tl.full([BLOCK_R, BLOCK_K], 0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask = ok[:, None] & (k0 + cols[None, :] < K)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + k0 + cols[None, :], mask=mask, other=0.0)
        best = tl.maximum(best, tl.abs(x.to(tl.float32)))
    tl.atomic_max(amax_ptr, max_(max_(best, 1), 0), sem="relaxed")  # read by the next launch: no fence needed


@triton.jit(do_not_specialize=["num_rows", "rows_per_expert"])
def fp8_quant_kernel(x_ptr, q_ptr, scale_ptr, amax_ptr, valid_ptr, map_ptr, num_rows, K, rows_per_expert,
                     stride_xm, stride_qm, stride_sm, stride_sk,
                     MODE: tl.constexpr, VALID: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    """e4m3 ``q`` and fp32 scales of the valid rows of x; MODE picks tensor / row / 128-group scales."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = _valid_rows(rows, num_rows, valid_ptr, map_ptr, rows_per_expert, VALID)
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows64[:, None] * stride_xm
    q_rows = q_ptr + rows64[:, None] * stride_qm
    if MODE == _TENSOR:
        scale = _scale_of(tl.load(amax_ptr))
        if tl.program_id(0) == 0:
            tl.store(scale_ptr, scale)
        for k0 in range(0, K, BLOCK_K):
            mask = ok[:, None] & (k0 + cols[None, :] < K)
            x = tl.load(x_rows + k0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(q_rows + k0 + cols[None, :], _to_e4m3(x, scale), mask=mask)
    elif MODE == _ROW:
        scale = _row_scales(x_rows, ok, K, BLOCK_R, BLOCK_K)
        tl.store(scale_ptr + rows64 * stride_sm, scale, mask=ok)
        for k0 in range(0, K, BLOCK_K):
            mask = ok[:, None] & (k0 + cols[None, :] < K)
            x = tl.load(x_rows + k0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(q_rows + k0 + cols[None, :], _to_e4m3(x, scale[:, None]), mask=mask)
    else:  # one scale per 128 columns (BLOCK_K == 128): groups program_id(1), + num_programs(1), ...
        # (rows.fp8_group_programs: one group per program, or all of K)
        for k0 in range(tl.program_id(1) * BLOCK_K, K, tl.num_programs(1) * BLOCK_K):
            mask = ok[:, None] & (k0 + cols[None, :] < K)
            x = tl.load(x_rows + k0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            scale = _group_scales(x)
            tl.store(scale_ptr + rows64 * stride_sm + (k0 // BLOCK_K) * stride_sk, scale, mask=ok)
            tl.store(q_rows + k0 + cols[None, :], _to_e4m3(x, scale[:, None]), mask=mask)


@triton.jit
def combine_kernel(y_ptr, weights_ptr, ids_ptr, map_ptr, rows_ptr, out_ptr, H, stride_ym, stride_om,
                   TOP_K: tl.constexpr, CHECK_LOCAL: tl.constexpr, SORTED: tl.constexpr, BLOCK_H: tl.constexpr):
    """``out[m] = sum_j weights[m, j] * y[row(m * k + j)]`` over the slots whose expert is here
    (``map[ids[m * k + j]] >= 0``): ``row(s)`` is ``rows[s]`` when ``SORTED`` (y holds the rows in sorted order),
    else ``s``."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    acc = tl.full([BLOCK_H], 0, tl.float32)
    for j in tl.static_range(TOP_K):
        slot = token * TOP_K + j
        weight = tl.load(weights_ptr + slot)
        if CHECK_LOCAL:  # slots whose expert is elsewhere hold garbage: never load them
            expert = tl.load(ids_ptr + slot + tl.full([BLOCK_H], 0, tl.int64))
            local = tl.load(map_ptr + expert)
            mask = col_ok & (local >= 0)
        else:
            mask = col_ok
        if SORTED:
            row = tl.load(rows_ptr + slot).to(tl.int64)
        else:
            row = slot
        y = tl.load(y_ptr + row * stride_ym + cols, mask=mask, other=0.0)
        acc += weight * y.to(tl.float32)
    tl.store(out_ptr + token * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)
