"""Triton code of the grouped MoE GEMM (see gemm.py for the contract and the torch twin).

One kernel serves both GEMMs and both activation formats; constexpr switches pick the variant:

- ``ROWS``: 0 walks `BlockLayout` blocks (standard format; A row = slot // A_ROW_DIV, output row =
  slot); 1: batched, rows ``expert * T + m`` for ``m < tokens_per_expert[expert]``; 2: direct, one
  slot per program, its expert read from the top-k ids (and the expert map when ``HAS_MAP``) --
  decode, where sorting costs more than the weights a repeated expert would re-read.
- ``GATED``: the program computes BLOCK_N columns of both halves of w13 (gate rows n, up rows I + n)
  and writes ``act(gate) * up``: the ``[rows, 2I]`` pre-activation never reaches memory.
- ``QUANT``: how A and W are stored (the numbering is `gemm.QUANT_CODES`):
  0 dense; 1 fp8 per tensor; 2 fp8 per row/channel; 3 fp8 128x128 blocks (1x128 groups of A);
  4 MXFP4 weights (dequantized tile by tile in registers) with dense activations.
"""

import triton
import triton.language as tl

from moe.experts._triton._lang import cdiv_, sigmoid_

# activation codes (gemm.ACTIVATION_CODES)
_NONE = tl.constexpr(0)
_SILU = tl.constexpr(1)
_GELU = tl.constexpr(2)
_SWIGLU_OAI = tl.constexpr(3)
_RELU2 = tl.constexpr(4)

# row sources (gemm.ROW_CODES)
_SORTED = tl.constexpr(0)
_BATCHED = tl.constexpr(1)
_DIRECT = tl.constexpr(2)

# quantization codes (gemm.QUANT_CODES)
_DENSE = tl.constexpr(0)
_FP8_TENSOR = tl.constexpr(1)
_FP8_ROW = tl.constexpr(2)
_FP8_BLOCK = tl.constexpr(3)
_MXFP4 = tl.constexpr(4)


@triton.jit
def _activate(gate, up, ACTIVATION: tl.constexpr, alpha, beta, limit):
    if ACTIVATION == _SILU:
        out = gate * sigmoid_(gate) * up
    elif ACTIVATION == _GELU:
        out = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476)) * up
    elif ACTIVATION == _SWIGLU_OAI:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        out = gate * sigmoid_(alpha * gate) * (up + beta)
    elif ACTIVATION == _RELU2:
        out = tl.maximum(gate, 0.0)
        out = out * out
    else:
        out = gate
    return out


@triton.jit
def _e2m1_tile(nibbles, scale_bytes, dtype: tl.constexpr):
    """e2m1 codes (sign bit 3) times 2**(byte - 127), as ``dtype``.

    The three magnitude bits go to bits 9..11 of a float16 (exponent field bits 10..11, top
    mantissa bit 9) and the sign to bit 15; that float16 is the e2m1 value times 2**-14 for every
    code, subnormals included. Bytes above 240 (scales over 2**113) would overflow and are clamped.
    """
    codes = nibbles.to(tl.int32)
    bits = ((codes & 8) << 12) | ((codes & 7) << 9)
    value = bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    exponent = tl.minimum(scale_bytes.to(tl.int32), 240) + 14  # 2**(b - 127 + 14) as fp32 bits
    factor = (exponent << 23).to(tl.float32, bitcast=True)
    return (value * factor).to(dtype)


@triton.jit
def _tile_coords(num_m_blocks, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program id -> (m block, n block), GROUP_M m blocks at a time so their A tiles stay in L2."""
    pid = tl.program_id(0)
    num_n = cdiv_(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:  # float32 problems: exact products instead of tf32
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


# the token-dependent counts are not specialized on, so one compiled kernel serves every M
@triton.jit(do_not_specialize=["num_m_blocks", "num_slots", "rows_per_expert"])
def moe_gemm_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr,
    sorted_ptr, block_expert_ptr, num_padded_ptr, counts_ptr,
    num_m_blocks, num_slots, rows_per_expert, N, K,
    stride_am, stride_ak, stride_asm, stride_ask,
    stride_we, stride_wn, stride_wk, stride_wse, stride_wsn, stride_wsk,
    stride_be, stride_bn, stride_om, stride_on,
    alpha, beta, limit,
    ROWS: tl.constexpr, HAS_MAP: tl.constexpr, A_ROW_DIV: tl.constexpr, GATED: tl.constexpr,
    ACTIVATION: tl.constexpr, QUANT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile_coords(num_m_blocks, N, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if ROWS == _SORTED:
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
        expert = tl.load(block_expert_ptr + pid_m)
        slots = tl.load(sorted_ptr + rows)
        row_ok = slots < num_slots
        slots = tl.where(row_ok, slots, 0)  # padding rows read row 0 and are never stored
        a_rows = slots // A_ROW_DIV
        out_rows = slots
    elif ROWS == _DIRECT:  # sorted_ptr: top-k ids, block_expert_ptr: the expert map
        expert = tl.load(sorted_ptr + pid_m)
        if HAS_MAP:
            expert = tl.load(block_expert_ptr + expert)
        if expert < 0:
            return
        row_ok = tl.arange(0, BLOCK_M) == 0  # every row computes this slot; one is stored
        out_rows = pid_m + tl.full([BLOCK_M], 0, tl.int32)
        a_rows = out_rows // A_ROW_DIV
    else:
        expert = tl.program_id(1)
        count = tl.load(counts_ptr + expert)
        if pid_m * BLOCK_M >= count:
            return
        row_ok = rows < count
        a_rows = expert * rows_per_expert + tl.where(row_ok, rows, 0)
        out_rows = a_rows
    expert = expert.to(tl.int64)
    a_rows = a_rows.to(tl.int64)
    out_rows = out_rows.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_n = offs_n % N  # the tail's extra columns re-read valid ones; they are never stored
    w_base = w_ptr + expert * stride_we
    ws_base = w_scale_ptr + expert * stride_wse

    acc = tl.full([BLOCK_M, BLOCK_N], 0, tl.float32)
    acc_up = tl.full([BLOCK_M, BLOCK_N], 0, tl.float32)
    if QUANT == _MXFP4:
        # weights repacked (weights.py): byte j of each 32-element group holds elements j and j+16
        offs_b = tl.arange(0, BLOCK_K // 2)
        k_low = (offs_b // 16) * 32 + offs_b % 16
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + k_low[None, :] * stride_ak
        w_ptrs = w_base + offs_n[None, :] * stride_wn + offs_b[:, None] * stride_wk
        s_ptrs = ws_base + offs_n[None, :] * stride_wsn + (offs_b // 16)[:, None] * stride_wsk
        for kk in range(0, cdiv_(K, BLOCK_K)):
            k_left = K - kk * BLOCK_K
            a_lo = tl.load(a_ptrs, mask=k_low[None, :] < k_left, other=0.0)
            a_hi = tl.load(a_ptrs + 16 * stride_ak, mask=k_low[None, :] < k_left, other=0.0)
            packed = tl.load(w_ptrs, mask=k_low[:, None] < k_left, other=0)
            scale = tl.load(s_ptrs, mask=k_low[:, None] < k_left, other=0)
            acc = _dot(a_lo, _e2m1_tile(packed & 15, scale, a_lo.dtype), acc, IEEE)
            acc = _dot(a_hi, _e2m1_tile(packed >> 4, scale, a_lo.dtype), acc, IEEE)
            if GATED:
                packed = tl.load(w_ptrs + N * stride_wn, mask=k_low[:, None] < k_left, other=0)
                scale = tl.load(s_ptrs + N * stride_wsn, mask=k_low[:, None] < k_left, other=0)
                acc_up = _dot(a_lo, _e2m1_tile(packed & 15, scale, a_lo.dtype), acc_up, IEEE)
                acc_up = _dot(a_hi, _e2m1_tile(packed >> 4, scale, a_lo.dtype), acc_up, IEEE)
            a_ptrs += BLOCK_K * stride_ak
            w_ptrs += (BLOCK_K // 2) * stride_wk
            s_ptrs += (BLOCK_K // 32) * stride_wsk
    else:
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
        w_ptrs = w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
        for kk in range(0, cdiv_(K, BLOCK_K)):
            if EVEN_K:
                a = tl.load(a_ptrs)
                w = tl.load(w_ptrs)
                if GATED:
                    w_up = tl.load(w_ptrs + N * stride_wn)
            else:
                k_ok = offs_k < K - kk * BLOCK_K
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
                if GATED:
                    w_up = tl.load(w_ptrs + N * stride_wn, mask=k_ok[:, None], other=0.0)
            if QUANT == _FP8_BLOCK:
                group = (kk * BLOCK_K) // 128
                a_s = tl.load(a_scale_ptr + a_rows * stride_asm + group * stride_ask)
                w_s = tl.load(ws_base + (offs_n // 128) * stride_wsn + group * stride_wsk)
                acc += tl.dot(a, w) * (a_s[:, None] * w_s[None, :])
                if GATED:
                    w_s = tl.load(ws_base + ((offs_n + N) // 128) * stride_wsn + group * stride_wsk)
                    acc_up += tl.dot(a, w_up) * (a_s[:, None] * w_s[None, :])
            else:
                acc = _dot(a, w, acc, IEEE)
                if GATED:
                    acc_up = _dot(a, w_up, acc_up, IEEE)
            a_ptrs += BLOCK_K * stride_ak
            w_ptrs += BLOCK_K * stride_wk

    if QUANT == _FP8_TENSOR:
        scale = tl.load(a_scale_ptr) * tl.load(ws_base)
        acc *= scale
        acc_up *= scale
    if QUANT == _FP8_ROW:
        a_s = tl.load(a_scale_ptr + a_rows * stride_asm)
        acc *= a_s[:, None] * tl.load(ws_base + offs_n * stride_wsn)[None, :]
        if GATED:
            acc_up *= a_s[:, None] * tl.load(ws_base + (offs_n + N) * stride_wsn)[None, :]
    if HAS_BIAS:
        b_base = bias_ptr + expert * stride_be
        acc += tl.load(b_base + offs_n * stride_bn)[None, :]
        if GATED:
            acc_up += tl.load(b_base + (offs_n + N) * stride_bn)[None, :]
    acc = _activate(acc, acc_up, ACTIVATION, alpha, beta, limit)
    out_ptrs = out_ptr + out_rows[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])
