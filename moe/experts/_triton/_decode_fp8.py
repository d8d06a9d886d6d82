"""Triton code of the fp8 W8A8 decode GEMMs' K loop (decode.py launches it through _decode.py's
`decode_gemm_kernel`, which owns the rest: expert groups, N tiles, K splits, epilogue).

W8A8 numerics as the grouped GEMM's, without a quantization launch: the program quantizes its rows
itself with `_rows.py`'s helpers, from the same float32 values, so the e4m3 codes and scales are bit
for bit those `quantize_fp8_rows` would store. fp8_block (e4m3 weights, one fp32 scale per 128 x 128
block; activations per (row, 128-column group)): each K step is one group, its scale `_group_scales`
of the step's columns; K splits cut between groups, so a split never needs another's scale.
fp8_token (``ROWWISE``: a weight scale per output channel, an activation scale per row): the row's
scale (`_row_scales`, its abs-max over all of K) is computed before the loop -- every program reads
its rows whole once more (a few KB, from L2) -- and the K steps are 128 columns as well.

The products, per group: ``DOT`` (tensor cores, ``block_m >= 16``): ``(q_w . q_a)`` of the e4m3 codes
in fp32 times ``w_scale[n block, group] * a_scale[row, group]``, as the grouped GEMM; else (few rows)
fp32 FMAs of the dequantized codes, ``(q_a * a_scale) * (q_w * w_scale)``, into a ``[BLOCK_M, BLOCK_K,
BLOCK_N]`` accumulator reduced over K after the loop (the same sums, rounded in another order).
A group is consumed in ``128 / BLOCK_K`` pieces (the accumulator's size, registers); the pieces past
the first re-load their activations (L1) and re-quantize them with the group's scale: the same codes.
"""

import triton
import triton.language as tl

from moe.experts._triton._lang import sum_
from moe.experts._triton._rows import _group_scales, _row_scales, _to_e4m3
from moe.quant.fp8 import FP8_GROUP_SIZE

GROUP = tl.constexpr(FP8_GROUP_SIZE)  # the activation group and the weight block along K


@triton.jit
def _load_rows(ptrs, row_ok, k_ok, EVEN_K: tl.constexpr):
    """Activation columns as float32 (columns past K read as 0, as `quantize_fp8_rows` reads them)."""
    if EVEN_K:
        x = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    else:
        x = tl.load(ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    return x.to(tl.float32)


@triton.jit
def _load_weights(ptrs, k_ok, EVEN_K: tl.constexpr):
    if EVEN_K:
        w = tl.load(ptrs)
    else:
        w = tl.load(ptrs, mask=k_ok[:, None], other=0.0)
    return w


@triton.jit
def _accumulate(acc, q, a_scale, w, w_scale, DOT: tl.constexpr):
    """One piece of a group: ``q [BLOCK_M, BLOCK_K]`` e4m3 activations, ``w [BLOCK_K, BLOCK_N]`` e4m3
    weights. ``DOT``: ``acc`` is the group's unscaled ``[BLOCK_N, BLOCK_M]`` sum (operands swapped:
    the few rows are the MMA's narrow side); else the scaled ``[BLOCK_M, BLOCK_K, BLOCK_N]`` FMAs."""
    if DOT:
        acc = tl.dot(tl.trans(w), tl.trans(q), acc)
    else:
        a = q.to(tl.float32) * a_scale[:, None]
        acc = acc + a[:, :, None] * (w.to(tl.float32) * w_scale[None, :])[None, :, :]
    return acc


@triton.jit
def _group_step(acc, x, a_scale, a_ptrs, row_ok, w_ptrs, w_desc, w_row, w_scale, k0, K,
                EVEN_K: tl.constexpr, DOT: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One 128-column K step of one weight half (gate or up): ``x`` its activations (float32, ``[BLOCK_M,
    128]``) and ``a_scale [BLOCK_M]`` theirs, ``a_ptrs`` / ``w_ptrs`` its first piece's ``[BLOCK_M, BLOCK_K]``
    / ``[BLOCK_K, BLOCK_N]`` pointers, ``w_scale [BLOCK_N]`` the tile rows' weight scales (fp8_block: one
    n-block's, or two where the tile straddles blocks: the up rows when I is not a multiple of 128).
    ``TMA``: the weights come instead by descriptor, ``[BLOCK_N, BLOCK_K]`` blocks from row ``w_row`` of
    ``w_desc`` (TMA zero-fills the columns past K, as the masked loads read them)."""
    if DOT:
        part = tl.full([BLOCK_N, BLOCK_M], 0, tl.float32)
    else:
        part = acc
    for piece in tl.static_range(GROUP // BLOCK_K):
        k_ok = k0 + piece * BLOCK_K + tl.arange(0, BLOCK_K) < K
        if BLOCK_K == GROUP:
            xs = x
        else:
            xs = _load_rows(a_ptrs + piece * BLOCK_K, row_ok, k_ok, EVEN_K)
        q = _to_e4m3(xs, a_scale[:, None])
        if TMA:
            w = w_desc.load([w_row, k0 + piece * BLOCK_K]).T
        else:
            w = _load_weights(w_ptrs + piece * BLOCK_K, k_ok, EVEN_K)
        part = _accumulate(part, q, a_scale, w, w_scale, DOT)
    if DOT:
        acc += part * (w_scale[:, None] * a_scale[None, :])
    else:
        acc = part
    return acc


@triton.jit
def _weight_scales(ws_ptrs, kk, stride_wsk, ROWWISE: tl.constexpr):
    """The ``[BLOCK_N]`` weight scales of K step ``kk``: fp8_block's group column, or (``ROWWISE``) the
    channels' one scale."""
    if ROWWISE:
        w_scale = tl.load(ws_ptrs)
    else:
        w_scale = tl.load(ws_ptrs + kk * stride_wsk)
    return w_scale


@triton.jit
def fp8_k_loop(a_ptr, a_rows, row_ok, stride_am, w_base, w_desc, w_row, stride_wn, ws_base, stride_wsn,
               stride_wsk, offs_n, N, K, k_first, k_last,
               GATED: tl.constexpr, ROWWISE: tl.constexpr, EVEN_K: tl.constexpr, DOT: tl.constexpr,
               TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """K steps ``k_first .. k_last - 1`` (128 columns each) of one row chunk: ``(acc, acc_up)``, float32
    ``[BLOCK_M, BLOCK_N]`` (the up half's stays 0 unless ``GATED``). Weights ``[N(, up rows N further), K]``
    K-contiguous; scales ``[n block, group]`` (fp8_block) or ``[n, 1]`` (``ROWWISE``), the layouts the
    grouped GEMM reads. ``TMA`` (tensor-core tiles): the weights by descriptor, ``w_desc`` the weights as
    ``[E * rows, K]`` and ``w_row`` the tile's first gate row there."""
    if DOT:
        acc = tl.full([BLOCK_N, BLOCK_M], 0, tl.float32)
    else:
        acc = tl.full([BLOCK_M, BLOCK_K, BLOCK_N], 0, tl.float32)
    acc_up = acc
    cols = tl.arange(0, GROUP)
    piece = tl.arange(0, BLOCK_K)
    a_rows_ptr = a_ptr + a_rows[:, None] * stride_am
    w_ptrs = w_base + offs_n[None, :] * stride_wn + piece[:, None]
    if ROWWISE:  # a scale per channel; the rows' scales from all of K, before the first step
        ws_ptrs = ws_base + offs_n * stride_wsn
        ws_up_ptrs = ws_base + (offs_n + N) * stride_wsn
        a_scale = _row_scales(a_rows_ptr, row_ok, K, BLOCK_M, GROUP)
    else:
        ws_ptrs = ws_base + (offs_n // GROUP) * stride_wsn
        ws_up_ptrs = ws_base + ((offs_n + N) // GROUP) * stride_wsn
    for kk in range(k_first, k_last):
        k0 = kk * GROUP
        x = _load_rows(a_rows_ptr + k0 + cols[None, :], row_ok, k0 + cols < K, EVEN_K)
        if ROWWISE:
            step_scale = a_scale
        else:
            step_scale = _group_scales(x)
        a_ptrs = a_rows_ptr + k0 + piece[None, :]
        acc = _group_step(acc, x, step_scale, a_ptrs, row_ok, w_ptrs + k0, w_desc, w_row,
                          _weight_scales(ws_ptrs, kk, stride_wsk, ROWWISE), k0, K, EVEN_K, DOT, TMA, BLOCK_M,
                          BLOCK_N, BLOCK_K)
        if GATED:  # the up rows: N further down, their scales those of rows N + n
            acc_up = _group_step(acc_up, x, step_scale, a_ptrs, row_ok, w_ptrs + N * stride_wn + k0, w_desc,
                                 w_row + N, _weight_scales(ws_up_ptrs, kk, stride_wsk, ROWWISE), k0, K, EVEN_K, DOT,
                                 TMA, BLOCK_M, BLOCK_N, BLOCK_K)
    if DOT:
        acc, acc_up = tl.trans(acc), tl.trans(acc_up)
    else:
        acc, acc_up = sum_(acc, 1), sum_(acc_up, 1)
    return acc, acc_up
