"""Triton code of the TMA-A grouped GEMM and its row gather (see gemm_tma_a.py for the contracts).

A is first gathered into sorted order (`gather_rows_kernel`: row r of a `BlockLayout` that holds a slot is
source row ``slot[r] // A_ROW_DIV``; padding rows are not written), so that `moe_gemm_tma_a_kernel` loads both
operands by TMA descriptor (TMA gather of scattered rows is Blackwell-only). Its output goes either to sorted
row r (``OUT_SORTED``: the next GEMM's A, all rows of the block, padding included) or to row ``slot[r]`` (the
rows that hold a slot). The K loop is software-pipelined by ``num_stages``, one tile per program.

No warp specialization: with Triton 3.6.0 on an H100, ``tl.range(..., warp_specialize=True)`` over this
loop failed to compile with 128 local experts (E_PAD = 128: an assertion in the NVGPUWarpSpecialization
pass, WSLowerToken.cpp), and where it compiled (the expert count split into chunks of 32) the kernel
hung on the GPU in every variant run (one tile per program; GEMM1 only or both; blocks past the last
segment running 0, 1 or all K steps; the runs that also held a persistent form hung at their first
case). The same descriptor loop without it is correct.
"""

import triton
import triton.language as tl

from moe.experts._triton._gemm import _activate, _block_segment, _dot, _store_sorted_block, _tile_coords


@triton.jit(do_not_specialize=["num_experts"])
def gather_rows_kernel(src_ptr, dst_ptr, rows_ptr, ends_ptr, counts_ptr, num_experts, K, stride_sm, stride_sk, stride_dm,
                       scale_src_ptr, scale_dst_ptr, stride_ssm, stride_ssg, stride_dsg, groups,
                       A_ROW_DIV: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                       HAS_SCALES: tl.constexpr, GROUPS_PAD: tl.constexpr):
    """``dst[r] = src[slot[r] // A_ROW_DIV]`` for the rows of block ``program_id(0)`` that hold a slot. Padding rows
    are not written: whatever they hold, a GEMM's output row depends on its own A row only, and the padding rows'
    outputs are never read (the sum over k and a scattering store take slot rows only). Blocks past the last segment
    are skipped. ``HAS_SCALES``: the rows' scales too, transposed: ``scale_dst[g, r] = scale_src[slot[r] // A_ROW_DIV,
    g]`` (by the programs of the first column block)."""
    pid_m = tl.program_id(0)
    expert, valid = _block_segment(pid_m, ends_ptr, counts_ptr, num_experts, E_PAD, BLOCK_M)
    if expert < num_experts:
        offs = tl.arange(0, BLOCK_M)
        row_ok = (offs < valid)[:, None]
        slots = tl.load(rows_ptr + pid_m * BLOCK_M + offs, mask=offs < valid, other=0)
        src_rows = (slots // A_ROW_DIV).to(tl.int64)
        dst_rows = (pid_m * BLOCK_M + offs).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        ok = row_ok & (cols < K)[None, :]
        x = tl.load(src_ptr + src_rows[:, None] * stride_sm + cols[None, :] * stride_sk, mask=ok, other=0.0)
        tl.store(dst_ptr + dst_rows[:, None] * stride_dm + cols[None, :], x, mask=ok)
        if HAS_SCALES:
            if tl.program_id(1) == 0:
                g = tl.arange(0, GROUPS_PAD)[None, :]
                g_ok = row_ok & (g < groups)
                s = tl.load(scale_src_ptr + src_rows[:, None] * stride_ssm + g * stride_ssg, mask=g_ok, other=1.0)
                tl.store(scale_dst_ptr + g * stride_dsg + dst_rows[:, None], s, mask=g_ok)


@triton.jit
def _tma_a_loop(a_desc, w_desc, m0, w_row, N, K, GATED: tl.constexpr, IEEE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The K loop, every load a descriptor load (TMA zero-fills past K)."""
    acc = tl.full([BLOCK_M, BLOCK_N], 0, tl.float32)
    acc_up = tl.full([BLOCK_M, BLOCK_N], 0, tl.float32)
    for k in range(0, K, BLOCK_K):
        a = a_desc.load([m0, k])
        acc = _dot(a, w_desc.load([w_row, k]).T, acc, IEEE)
        if GATED:  # the up rows: N further down in [gate; up]
            acc_up = _dot(a, w_desc.load([w_row + N, k]).T, acc_up, IEEE)
    return acc, acc_up


# the token-dependent counts are not specialized on, so one compiled kernel serves every M
@triton.jit(do_not_specialize=["num_m_blocks", "num_experts"])
def moe_gemm_tma_a_kernel(
    a_desc, w_desc, bias_ptr, out_ptr, rows_ptr, ends_ptr, counts_ptr,
    num_m_blocks, num_experts, N, K, w_rows, stride_be, stride_bn, stride_om, stride_on,
    alpha, beta, limit,
    GATED: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, OUT_SORTED: tl.constexpr,
    IEEE: tl.constexpr, E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """``out = act(a_sorted @ w[expert].T + bias)`` by (m block, n block) tiles, one per program:
    ``a_desc`` the sorted rows ``[rows, K]`` (block ``[BLOCK_M, BLOCK_K]``), ``w_desc`` the weights as
    ``[E * R, K]`` (block ``[BLOCK_N, BLOCK_K]``). The tail's extra columns read other rows; they are
    never stored. Blocks past the last segment return at once."""
    pid_m, pid_n = _tile_coords(num_m_blocks, N, BLOCK_N, GROUP_M)
    expert, valid = _block_segment(pid_m, ends_ptr, counts_ptr, num_experts, E_PAD, BLOCK_M)
    if expert >= num_experts:  # past the last segment
        return
    m0 = pid_m * BLOCK_M
    acc, acc_up = _tma_a_loop(a_desc, w_desc, m0, expert * w_rows + pid_n * BLOCK_N, N, K, GATED, IEEE,
                              BLOCK_M, BLOCK_N, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = offs_n % N  # the tail's extra columns read valid biases; they are never stored
    if HAS_BIAS:
        b_base = bias_ptr + expert.to(tl.int64) * stride_be
        acc += tl.load(b_base + cols * stride_bn)[None, :]
        if GATED:
            acc_up += tl.load(b_base + (cols + N) * stride_bn)[None, :]
    acc = _activate(acc, acc_up, ACTIVATION, alpha, beta, limit)
    _store_sorted_block(out_ptr, acc, tl.arange(0, BLOCK_M), offs_n, N, m0, valid, rows_ptr, stride_om, stride_on,
                        OUT_SORTED, BLOCK_M)
