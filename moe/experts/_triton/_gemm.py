"""Triton code of the grouped MoE GEMM (see gemm.py for the contract and the torch twin).

One kernel serves both GEMMs and both activation formats; constexpr switches pick the variant:

- ``ROWS``: 0 walks `BlockLayout` blocks (standard format; A row = slot // A_ROW_DIV, output row =
  slot; a block's expert and valid rows come from the experts' padded ends and counts); 1: batched,
  rows ``expert * T + m`` for ``m < tokens_per_expert[expert]``; 2: direct, one
  slot per program, its expert read from the top-k ids (and the expert map when ``HAS_MAP``) --
  decode, where sorting costs more than the weights a repeated expert would re-read.
- ``GATED``: the program computes BLOCK_N columns of both halves of w13 (gate rows n, up rows I + n)
  and writes ``act(gate) * up``: the ``[rows, 2I]`` pre-activation never reaches memory.
- ``W_TMA``: weight tiles arrive by TMA through ``w_desc`` (a descriptor of the weights as
  ``[E * R, K]``, block ``[BLOCK_N, BLOCK_K]``) instead of pointer loads; dense and fp8 weights.
- ``QUANT``: how A and W are stored (the numbering is `gemm.QUANT_CODES`):
  0 dense; 1 fp8 per tensor; 2 fp8 per row/channel; 3 fp8 128x128 blocks (1x128 groups of A);
  4 MXFP4 and 5 NVFP4 weights (dequantized tile by tile in registers, one loop: only the scale decoding
  differs) with dense activations; 6 MXFP8 weights with dense activations (the e4m3 bits decoded and
  scaled by their group's e8m0 byte in registers: MXFP4's scale words, a whole K tile per dot).
- ``WEIGHT_ONLY``: fp8 weights with dense activations (GPUs without fp8 tensor cores): the e4m3 bits
  (uint8) are decoded to A's dtype in registers and A's scale is 1; the weight scales apply as for fp8.
"""

import triton
import triton.language as tl

from moe.experts._triton._lang import cdiv_, sigmoid_, sum_

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
_NVFP4 = tl.constexpr(5)
_MXFP8 = tl.constexpr(6)


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
def _e8m0_factor(scale_bytes):
    """2**(byte - 127 + 14) as float32: the e8m0 scale, times 2**14 to undo `_e2m1_scaled`'s 2**-14.
    Bytes above 240 (scales over 2**113) would overflow and are clamped."""
    exponent = tl.minimum(scale_bytes, 240) + 14
    return (exponent << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_scaled(bits, dtype: tl.constexpr):
    """e4m3 bit patterns (integers) as ``dtype`` values times 2**-8, exactly: the sign goes to bit 15 of a
    float16 and the seven exponent and mantissa bits to bits 7..13, so the float16's exponent is e4m3's
    minus 8 (biases 15 and 7), subnormals included. 0x7F/0xFF (e4m3's NaN) read as 480: our quantizers
    saturate and never store them."""
    bits = bits.to(tl.int32)
    half = (((bits & 0x80) << 8) | ((bits & 0x7F) << 7)).to(tl.uint16).to(tl.float16, bitcast=True)
    return half.to(dtype)


@triton.jit
def _fp4_factors(words, shifts, SCALES: tl.constexpr):
    """The factors of a group's low and high half-tiles from its scale word (see `_fp4_half_tiles`), each
    times 2**14 to undo `_e2m1_scaled`'s 2**-14: MXFP4, the group's e8m0 byte for both halves; NVFP4, the
    e4m3 bytes of its two blocks of 16 (the byte at ``shifts`` and the next), times 2**8 more to undo
    `_e4m3_scaled`'s 2**-8. Exact in float32; NVFP4's global scale applies to the accumulator instead."""
    if SCALES == _NVFP4:
        low = _e4m3_scaled((words >> shifts) & 255, tl.float32) * 4194304.0  # 2**22
        high = _e4m3_scaled((words >> (shifts + 8)) & 255, tl.float32) * 4194304.0
    else:
        low = _e8m0_factor((words >> shifts) & 255)
        high = low
    return low, high


@triton.jit
def _e2m1_halves(packed):
    """The low and the high nibbles of packed e2m1 bytes as float16 values times 2**-14, exact: a code's
    three magnitude bits go to bits 9..11 of a float16 (exponent bits 10..11, top mantissa bit 9) and its
    sign to bit 15, subnormals included (the decode kernels' `_E2M1_F16X2` PTX gives the values times 2**-6)."""
    bits = packed.to(tl.int32)
    low = (((bits & 0x08) << 12) | ((bits & 0x07) << 9)).to(tl.uint16).to(tl.float16, bitcast=True)
    high = (((bits & 0x80) << 8) | ((bits & 0x70) << 5)).to(tl.uint16).to(tl.float16, bitcast=True)
    return low, high


@triton.jit
def _e2m1_scaled(half, factor, dtype: tl.constexpr):
    """`_e2m1_halves`' float16 values times ``factor``, as ``dtype``: exact in float32, so the result is
    the dequantized weight rounded once."""
    return (half.to(tl.float32) * factor).to(dtype)


@triton.jit
def _fp4_load(w_ptrs, s_ptrs, group_ok, EVEN_K: tl.constexpr):
    """One K step's weight bytes (packed fp4, or MXFP8's e4m3 bits) and their groups' scale words (groups
    past K read as 0)."""
    if EVEN_K:
        packed = tl.load(w_ptrs)
        words = tl.load(s_ptrs)
    else:
        packed = tl.load(w_ptrs, mask=group_ok, other=0)
        words = tl.load(s_ptrs, mask=group_ok, other=0)
    return packed, words


@triton.jit
def _fp4_half_tiles(w_ptrs, s_ptrs, shifts, group_ok, SCALES: tl.constexpr, dtype: tl.constexpr,
                    EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """One K step of MXFP4 or NVFP4 (``SCALES``) weights, dequantized: the half-tiles ``[BLOCK_K/2,
    BLOCK_N]`` of the low and the high nibbles (elements j and j + 16 of each group of 32; weights.py).

    ``w_ptrs [G, 16, BLOCK_N]`` address the packed bytes (G = BLOCK_K / 32 groups, 16 contiguous
    bytes each: vectorized loads), ``s_ptrs [G, 1, BLOCK_N]`` each group's scale word, ``shifts
    [G, 1, 1]`` the group's (first) byte in it, ``group_ok [G, 1, 1]`` the groups inside K. The scale
    factors are computed once per (group, row) and broadcast over the group's 16 bytes in registers;
    the codes become float16 values times 2**-14 first (`_e2m1_halves`).
    """
    packed, words = _fp4_load(w_ptrs, s_ptrs, group_ok, EVEN_K)
    factor_low, factor_high = _fp4_factors(words, shifts, SCALES)
    low, high = _e2m1_halves(packed)
    low, high = _e2m1_scaled(low, factor_low, dtype), _e2m1_scaled(high, factor_high, dtype)
    return tl.reshape(low, (BLOCK_K // 2, BLOCK_N)), tl.reshape(high, (BLOCK_K // 2, BLOCK_N))


@triton.jit
def _fp4_scale_words(s_base, group, stride_wsk, SCALES: tl.constexpr):
    """(pointers, bit shifts) of group ``group``'s scale in the scale words at ``s_base``: byte g of the
    words (MXFP4), or bytes 2g and 2g + 1 (NVFP4: a scale per 16; the shift is the first's)."""
    if SCALES == _NVFP4:
        byte = group * 2
    else:
        byte = group
    return s_base + (byte // 4) * stride_wsk, (byte % 4) * 8


@triton.jit
def _fp4_loop(acc, acc_up, a_ptr, a_rows, stride_am, stride_ak, w_base, stride_wn, stride_wk,
              ws_base, stride_wsn, stride_wsk, offs_n, N, K,
              SCALES: tl.constexpr, GATED: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
              BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The K loop with MXFP4 or NVFP4 weights: each step splits into the low and high half-tiles, whose
    A columns are runs of 16 (k_low and k_low + 16); K is a multiple of 32 (whole groups). Group g's
    scale is byte g of the scale words (MXFP4), or bytes 2g and 2g + 1 (NVFP4: a scale per 16)."""
    offs_b = tl.arange(0, BLOCK_K // 2)
    k_low = (offs_b // 16) * 32 + offs_b % 16
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + k_low[None, :] * stride_ak
    g3 = tl.arange(0, BLOCK_K // 32)[:, None, None]
    n3 = offs_n[None, None, :]
    w_ptrs = w_base + n3 * stride_wn + (g3 * 16 + tl.arange(0, 16)[None, :, None]) * stride_wk
    s_base = ws_base + n3 * stride_wsn
    for kk in range(0, cdiv_(K, BLOCK_K)):
        group = kk * (BLOCK_K // 32) + g3  # [G, 1, 1]: word group // 4, byte group % 4
        groups_left = K // 32 - kk * (BLOCK_K // 32)
        if EVEN_K:
            a_lo = tl.load(a_ptrs)
            a_hi = tl.load(a_ptrs + 16 * stride_ak)
        else:
            a_ok = (offs_b // 16)[None, :] < groups_left
            a_lo = tl.load(a_ptrs, mask=a_ok, other=0.0)
            a_hi = tl.load(a_ptrs + 16 * stride_ak, mask=a_ok, other=0.0)
        s_ptrs, shifts = _fp4_scale_words(s_base, group, stride_wsk, SCALES)
        w_lo, w_hi = _fp4_half_tiles(w_ptrs, s_ptrs, shifts, g3 < groups_left, SCALES, a_lo.dtype, EVEN_K,
                                     BLOCK_K, BLOCK_N)
        acc = _dot(a_lo, w_lo, acc, IEEE)
        acc = _dot(a_hi, w_hi, acc, IEEE)
        if GATED:  # the up rows: N further down, in the data and in the scale words alike
            w_lo, w_hi = _fp4_half_tiles(w_ptrs + N * stride_wn, s_ptrs + N * stride_wsn, shifts,
                                         g3 < groups_left, SCALES, a_lo.dtype, EVEN_K, BLOCK_K, BLOCK_N)
            acc_up = _dot(a_lo, w_lo, acc_up, IEEE)
            acc_up = _dot(a_hi, w_hi, acc_up, IEEE)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += (BLOCK_K // 2) * stride_wk
    return acc, acc_up


@triton.jit
def _mxfp8_tile(w_ptrs, s_ptrs, shifts, group_ok, dtype: tl.constexpr, EVEN_K: tl.constexpr,
                BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """One K step of MXFP8 weights, dequantized: ``[BLOCK_K, BLOCK_N]`` in ``dtype``. ``w_ptrs [G, 32,
    BLOCK_N]`` address the e4m3 bits (uint8) of G = BLOCK_K / 32 groups, ``s_ptrs``, ``shifts`` and
    ``group_ok`` as in `_fp4_half_tiles` (MXFP4's scale words). `_e4m3_scaled` gives the value times
    2**-8 and the factor is the e8m0 scale times 2**8 (`_e8m0_factor`'s 2**14, times 2**-6): exact in
    float32, so each weight is rounded once, to ``dtype``."""
    bits, words = _fp4_load(w_ptrs, s_ptrs, group_ok, EVEN_K)
    factor = _e8m0_factor((words >> shifts) & 255) * 0.015625  # 2**-6
    value = _e4m3_scaled(bits, tl.float32) * factor
    return tl.reshape(value.to(dtype), (BLOCK_K, BLOCK_N))


@triton.jit
def _mxfp8_loop(acc, acc_up, a_ptr, a_rows, stride_am, stride_ak, w_base, stride_wn, stride_wk,
                ws_base, stride_wsn, stride_wsk, offs_n, N, K,
                GATED: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
                BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The K loop with MXFP8 weights and unquantized activations (weight-only): one dot per K step on
    the dequantized tile (`_mxfp8_tile`); K is a multiple of 32 (whole groups), group g's scale is byte
    g of the scale words, as MXFP4's."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    g3 = tl.arange(0, BLOCK_K // 32)[:, None, None]
    n3 = offs_n[None, None, :]
    w_ptrs = w_base + n3 * stride_wn + (g3 * 32 + tl.arange(0, 32)[None, :, None]) * stride_wk
    s_base = ws_base + n3 * stride_wsn
    for kk in range(0, cdiv_(K, BLOCK_K)):
        group = kk * (BLOCK_K // 32) + g3
        groups_left = K // 32 - kk * (BLOCK_K // 32)
        if EVEN_K:
            a = tl.load(a_ptrs)
        else:
            a = tl.load(a_ptrs, mask=(offs_k // 32)[None, :] < groups_left, other=0.0)
        s_ptrs, shifts = _fp4_scale_words(s_base, group, stride_wsk, _MXFP4)
        w = _mxfp8_tile(w_ptrs, s_ptrs, shifts, g3 < groups_left, a.dtype, EVEN_K, BLOCK_K, BLOCK_N)
        acc = _dot(a, w, acc, IEEE)
        if GATED:  # the up rows: N further down, in the data and in the scale words alike
            w = _mxfp8_tile(w_ptrs + N * stride_wn, s_ptrs + N * stride_wsn, shifts, g3 < groups_left, a.dtype,
                            EVEN_K, BLOCK_K, BLOCK_N)
            acc_up = _dot(a, w, acc_up, IEEE)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    return acc, acc_up


@triton.jit
def _a_scales(ptrs, WEIGHT_ONLY: tl.constexpr, BLOCK_M: tl.constexpr):
    """A's fp8 scales of a block of rows at ``ptrs``; weight-only (A unquantized): 2**8 instead, which
    undoes `_e4m3_scaled`'s 2**-8 on the weights. One return: Triton 3.6 compiling for a GPU rejects
    returns of two types even under a constexpr branch (the pointer is a uint8 placeholder there)."""
    if WEIGHT_ONLY:
        scales = tl.full([BLOCK_M], 256.0, tl.float32)
    else:
        scales = tl.load(ptrs).to(tl.float32)
    return scales


@triton.jit
def _tile_of(t, num_m_blocks, num_n, GROUP_M: tl.constexpr):
    """Tile ``t`` -> (m block, n block), GROUP_M m blocks at a time: the tiles that run together share their A
    tiles (and an expert's m blocks its weight tiles) in L2."""
    per_group = GROUP_M * num_n
    first_m = (t // per_group) * GROUP_M
    group_rows = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (t % per_group) % group_rows
    pid_n = (t % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _tile_coords(num_m_blocks, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program id -> (m block, n block), as `_tile_of`."""
    return _tile_of(tl.program_id(0), num_m_blocks, cdiv_(N, BLOCK_N), GROUP_M)


@triton.jit
def _block_bounds(pid_m, ends_ptr, counts_ptr, num_experts, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """(expert, segment start, slots): the local expert of sorted block ``pid_m`` (``num_experts`` when
    the block lies past the last segment), the first row of that expert's padded segment and how many
    of its rows hold a slot."""
    first = pid_m * BLOCK_M
    experts = tl.arange(0, E_PAD)
    is_expert = experts < num_experts
    ends = tl.load(ends_ptr + experts, mask=is_expert, other=0)
    counts = tl.load(counts_ptr + experts, mask=is_expert, other=0)
    expert = sum_(((ends <= first) & is_expert).to(tl.int32), 0)  # segments ending before it
    count = sum_(tl.where(experts == expert, counts, 0), 0)
    segment_start = sum_(tl.where(experts == expert, ends, 0), 0) - cdiv_(count, BLOCK_M) * BLOCK_M
    return expert, segment_start, count


@triton.jit
def _block_segment(pid_m, ends_ptr, counts_ptr, num_experts, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """(expert, rows): `_block_bounds`' expert and how many of block ``pid_m``'s rows hold a slot (the
    rest are padding)."""
    expert, segment_start, count = _block_bounds(pid_m, ends_ptr, counts_ptr, num_experts, E_PAD, BLOCK_M)
    return expert, count - (pid_m * BLOCK_M - segment_start)


@triton.jit
def _store_sorted_block(out_ptr, tile, offs_m, offs_n, N, m0, valid, rows_ptr, stride_om, stride_on,
                        OUT_SORTED: tl.constexpr, BLOCK_M: tl.constexpr):
    """Stores a sorted block's ``tile`` (rows ``m0 + offs_m``, columns ``offs_n``, those < N): to every row of
    the block (``OUT_SORTED``: the next GEMM's A; its padding rows hold whatever their A rows gave, and nothing
    reads what they give), else to the slot rows of the rows that hold one (``offs_m < valid``). The TMA-A and the
    wgmma (Gluon) kernels' epilogue."""
    if OUT_SORTED:
        out_rows = (m0 + offs_m).to(tl.int64)
        row_ok = offs_m < BLOCK_M
    else:
        row_ok = offs_m < valid
        out_rows = tl.load(rows_ptr + m0 + offs_m, mask=row_ok, other=0).to(tl.int64)
    ptrs = out_ptr + out_rows[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(ptrs, tile.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n < N)[None, :])


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:  # float32 problems: exact products instead of tf32
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


# the token-dependent counts are not specialized on, so one compiled kernel serves every M
@triton.jit(do_not_specialize=["num_m_blocks", "num_slots", "rows_per_expert", "num_experts"])
def moe_gemm_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_desc, w_scale_ptr, w_global_ptr, bias_ptr, out_ptr,
    rows_ptr, map_ptr, ends_ptr, counts_ptr,
    num_m_blocks, num_slots, rows_per_expert, num_experts, N, K, w_rows,
    stride_am, stride_ak, stride_asm, stride_ask,
    stride_we, stride_wn, stride_wk, stride_wse, stride_wsn, stride_wsk,
    stride_be, stride_bn, stride_om, stride_on,
    alpha, beta, limit,
    ROWS: tl.constexpr, HAS_MAP: tl.constexpr, A_ROW_DIV: tl.constexpr, GATED: tl.constexpr,
    ACTIVATION: tl.constexpr, QUANT: tl.constexpr, WEIGHT_ONLY: tl.constexpr, HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr, E_PAD: tl.constexpr, W_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile_coords(num_m_blocks, N, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if ROWS == _SORTED:  # rows_ptr: sorted slots; ends_ptr, counts_ptr: per local expert
        expert, segment_start, count = _block_bounds(pid_m, ends_ptr, counts_ptr, num_experts, E_PAD, BLOCK_M)
        if expert >= num_experts:  # past the last segment
            return
        # this form of the mask, not `arange(BLOCK_M) < valid rows`: the same rows, but with that one the
        # gated fp8_block GEMM (255 registers) spilled and ran 1.5x slower at Qwen3-30B-A3B's shape (H100,
        # M = 4096 and 16384; benchmarks/results/fp8_block_qwen3_nvidia-h100.md)
        row_ok = rows - segment_start < count
        slots = tl.load(rows_ptr + rows, mask=row_ok, other=0)  # padding rows read row 0, never stored
        a_rows = slots // A_ROW_DIV
        out_rows = slots
    elif ROWS == _DIRECT:  # rows_ptr: top-k ids, map_ptr: the expert map
        expert = tl.load(rows_ptr + pid_m)
        if HAS_MAP:
            expert = tl.load(map_ptr + expert)
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
    if QUANT == _MXFP4 or QUANT == _NVFP4:
        acc, acc_up = _fp4_loop(acc, acc_up, a_ptr, a_rows, stride_am, stride_ak, w_base, stride_wn,
                                stride_wk, ws_base, stride_wsn, stride_wsk, offs_n, N, K,
                                QUANT, GATED, EVEN_K, IEEE, BLOCK_K, BLOCK_N)
    elif QUANT == _MXFP8:
        acc, acc_up = _mxfp8_loop(acc, acc_up, a_ptr, a_rows, stride_am, stride_ak, w_base, stride_wn, stride_wk,
                                  ws_base, stride_wsn, stride_wsk, offs_n, N, K, GATED, EVEN_K, IEEE, BLOCK_K, BLOCK_N)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
        w_ptrs = w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
        w_row = (expert * w_rows + pid_n * BLOCK_N).to(tl.int32)  # W_TMA: the tile's first row in [E * R, K]
        for kk in range(0, cdiv_(K, BLOCK_K)):
            if W_TMA:  # the weight tiles by TMA (zero past K); the tail's extra rows are never stored
                if EVEN_K:
                    a = tl.load(a_ptrs)
                else:
                    a = tl.load(a_ptrs, mask=(offs_k < K - kk * BLOCK_K)[None, :], other=0.0)
                w = w_desc.load([w_row, kk * BLOCK_K]).T
                if GATED:
                    w_up = w_desc.load([w_row + N, kk * BLOCK_K]).T
            elif EVEN_K:
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
            if WEIGHT_ONLY:  # e4m3 bits -> A's dtype, times 2**-8 (undone by the scales below)
                w = _e4m3_scaled(w, a.dtype)
                if GATED:
                    w_up = _e4m3_scaled(w_up, a.dtype)
            if QUANT == _FP8_BLOCK:
                group = (kk * BLOCK_K) // 128
                a_s = _a_scales(a_scale_ptr + a_rows * stride_asm + group * stride_ask, WEIGHT_ONLY, BLOCK_M)
                w_s = tl.load(ws_base + (offs_n // 128) * stride_wsn + group * stride_wsk)
                acc += _dot(a, w, None, IEEE) * (a_s[:, None] * w_s[None, :])
                if GATED:
                    w_s = tl.load(ws_base + ((offs_n + N) // 128) * stride_wsn + group * stride_wsk)
                    acc_up += _dot(a, w_up, None, IEEE) * (a_s[:, None] * w_s[None, :])
            else:
                acc = _dot(a, w, acc, IEEE)
                if GATED:
                    acc_up = _dot(a, w_up, acc_up, IEEE)
            a_ptrs += BLOCK_K * stride_ak
            w_ptrs += BLOCK_K * stride_wk

    if QUANT == _FP8_TENSOR:
        if WEIGHT_ONLY:
            scale = tl.load(ws_base) * 256.0  # A's scale is 1; 2**8 undoes `_e4m3_scaled`
        else:
            scale = tl.load(a_scale_ptr) * tl.load(ws_base)
        acc *= scale
        acc_up *= scale
    if QUANT == _NVFP4:  # the global scale, one per expert, factors out of the sum over K
        scale = tl.load(w_global_ptr + expert)
        acc *= scale
        acc_up *= scale
    if QUANT == _FP8_ROW:
        a_s = _a_scales(a_scale_ptr + a_rows * stride_asm, WEIGHT_ONLY, BLOCK_M)
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
