"""Triton code of the warp-specialized grouped GEMM and its row gather (see gemm_ws.py for the contracts).

Triton warp-specializes a K loop on SM90 (a producer warp issuing TMA loads, consumer warps issuing
wgmma) only when every load in it is a tensor-descriptor load: a pointer-gathered A tile makes the
pass fail. So A is first gathered into sorted order (`gather_rows_kernel`: row r of a `BlockLayout`
is source row ``slot[r] // A_ROW_DIV``) and `moe_gemm_ws_kernel` loads both operands by descriptor.
Its output goes either to sorted row r (``OUT_SORTED``: the next GEMM's A, all rows of the block,
padding included) or to row ``slot[r]`` (the rows that hold a slot).
"""

import triton
import triton.language as tl

from moe.experts._triton._gemm import _activate, _block_segment, _dot, _grouped_tile
from moe.experts._triton._lang import cdiv_


@triton.jit(do_not_specialize=["num_experts"])
def gather_rows_kernel(src_ptr, dst_ptr, rows_ptr, ends_ptr, counts_ptr, num_experts, K, stride_sm, stride_sk, stride_dm,
                       A_ROW_DIV: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """``dst[r] = src[slot[r] // A_ROW_DIV]`` for the rows of block ``program_id(0)``; padding rows copy
    row 0 (finite values, whose products are never stored); blocks past the last segment are skipped."""
    pid_m = tl.program_id(0)
    expert, valid = _block_segment(pid_m, ends_ptr, counts_ptr, num_experts, E_PAD, BLOCK_M)
    if expert < num_experts:
        offs = tl.arange(0, BLOCK_M)
        slots = tl.load(rows_ptr + pid_m * BLOCK_M + offs, mask=offs < valid, other=0)
        src_rows = (slots // A_ROW_DIV).to(tl.int64)
        dst_rows = (pid_m * BLOCK_M + offs).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        col_ok = (cols < K)[None, :]
        x = tl.load(src_ptr + src_rows[:, None] * stride_sm + cols[None, :] * stride_sk, mask=col_ok, other=0.0)
        tl.store(dst_ptr + dst_rows[:, None] * stride_dm + cols[None, :], x, mask=col_ok)


@triton.jit
def _ws_loop(a_desc, w_desc, m0, w_row, N, k_end, GATED: tl.constexpr, IEEE: tl.constexpr,
             WARP_SPECIALIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The K loop, every load a descriptor load (TMA zero-fills past K), warp-specialized on SM90."""
    acc = tl.full([BLOCK_M, BLOCK_N], 0, tl.float32)
    acc_up = tl.full([BLOCK_M, BLOCK_N], 0, tl.float32)
    for k in tl.range(0, k_end, BLOCK_K, warp_specialize=WARP_SPECIALIZE):
        a = a_desc.load([m0, k])
        acc = _dot(a, w_desc.load([w_row, k]).T, acc, IEEE)
        if GATED:  # the up rows: N further down in [gate; up]
            acc_up = _dot(a, w_desc.load([w_row + N, k]).T, acc_up, IEEE)
    return acc, acc_up


@triton.jit
def _ws_tile(tile, a_desc, w_desc, bias_ptr, out_ptr, rows_ptr, ends_ptr, counts_ptr,
             num_m_blocks, num_experts, N, K, w_rows, stride_be, stride_bn, stride_om, stride_on,
             alpha, beta, limit,
             GATED: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, OUT_SORTED: tl.constexpr,
             IEEE: tl.constexpr, E_PAD: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Tile number ``tile`` of `moe_gemm_ws_kernel`, its K loop warp-specialized when WARP_SPECIALIZE."""
    pid_m, pid_n = _grouped_tile(tile, num_m_blocks, N, BLOCK_N, GROUP_M)
    expert, valid = _block_segment(pid_m, ends_ptr, counts_ptr, num_experts, E_PAD, BLOCK_M)
    live = expert < num_experts
    expert = tl.minimum(expert, num_experts - 1)
    m0 = pid_m * BLOCK_M
    w_row = expert * w_rows + pid_n * BLOCK_N
    acc, acc_up = _ws_loop(a_desc, w_desc, m0, w_row, N, tl.where(live, K, 0), GATED, IEEE, WARP_SPECIALIZE,
                           BLOCK_M, BLOCK_N, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_n = offs_n % N
    if HAS_BIAS:
        b_base = bias_ptr + expert.to(tl.int64) * stride_be
        acc += tl.load(b_base + offs_n * stride_bn)[None, :]
        if GATED:
            acc_up += tl.load(b_base + (offs_n + N) * stride_bn)[None, :]
    acc = _activate(acc, acc_up, ACTIVATION, alpha, beta, limit)
    offs = tl.arange(0, BLOCK_M)
    if OUT_SORTED:  # every row of the block: padding rows stay finite for the next GEMM
        out_rows = (m0 + offs).to(tl.int64)
        row_ok = offs < tl.where(live, BLOCK_M, 0)
    else:
        row_ok = offs < tl.where(live, valid, 0)
        out_rows = tl.load(rows_ptr + m0 + offs, mask=row_ok, other=0).to(tl.int64)
    out_ptrs = out_ptr + out_rows[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


# the token-dependent counts are not specialized on, so one compiled kernel serves every M
@triton.jit(do_not_specialize=["num_m_blocks", "num_experts"])
def moe_gemm_ws_kernel(
    a_desc, w_desc, bias_ptr, out_ptr, rows_ptr, ends_ptr, counts_ptr,
    num_m_blocks, num_experts, N, K, w_rows, stride_be, stride_bn, stride_om, stride_on,
    alpha, beta, limit,
    GATED: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, OUT_SORTED: tl.constexpr,
    IEEE: tl.constexpr, E_PAD: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, PERSISTENT: tl.constexpr,
    NUM_SMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """``out = act(a_sorted @ w[expert].T + bias)`` by (m block, n block) tiles: ``a_desc`` the sorted
    rows ``[rows, K]`` (block ``[BLOCK_M, BLOCK_K]``), ``w_desc`` the weights as ``[E * R, K]`` (block
    ``[BLOCK_N, BLOCK_K]``). The tail's extra columns read other rows; they are never stored. One tile
    per program, its K loop warp-specialized; or ``PERSISTENT``: NUM_SMS programs walk the tiles, the
    loop over tiles warp-specialized (the producer runs ahead into the next tile's loads).

    No ``return`` anywhere: Triton 3.6's warp specialization fails on a kernel that has one (an early
    exit for blocks past the last segment, or one after the loop); such a block runs zero K steps
    and stores nothing instead."""
    if PERSISTENT:
        total = num_m_blocks * cdiv_(N, BLOCK_N)
        for tile in tl.range(tl.program_id(0), total, NUM_SMS, flatten=True, warp_specialize=WARP_SPECIALIZE):
            _ws_tile(tile, a_desc, w_desc, bias_ptr, out_ptr, rows_ptr, ends_ptr, counts_ptr, num_m_blocks,
                     num_experts, N, K, w_rows, stride_be, stride_bn, stride_om, stride_on, alpha, beta, limit, GATED, ACTIVATION, HAS_BIAS, OUT_SORTED, IEEE, E_PAD, False,
                     BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    else:
        _ws_tile(tl.program_id(0), a_desc, w_desc, bias_ptr, out_ptr, rows_ptr, ends_ptr, counts_ptr, num_m_blocks,
                 num_experts, N, K, w_rows, stride_be, stride_bn, stride_om, stride_on, alpha, beta, limit, GATED, ACTIVATION, HAS_BIAS, OUT_SORTED, IEEE, E_PAD, WARP_SPECIALIZE,
                 BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
