"""Triton code of the MXFP4 / NVFP4 W4A16, MXFP8 weight-only and fp8 (128-block, per-token) W8A8 decode GEMMs
(see decode.py for the contract and the launch; the fp8 K loop is in _decode_fp8.py).

One program owns (expert group, N tile, K split): it streams that expert's ``[BLOCK_N, K / SPLITS]``
weight slice once and applies it to every slot routed to the expert (all of them, BLOCK_M rows at
a time), then writes fp32 partial sums ``part[split, slot, n]``. A second tiny launch sums the
splits in a fixed order (deterministic: no float atomics) and applies the epilogue: bias and the
activation after GEMM1, bias, router weight and the sum over k after GEMM2. With one split GEMM1
applies its epilogue itself and skips that launch; with ``FINISH`` the last program to store a row's
partials does the launch's work for that row and N tile (`_finish_if_last`), and neither launch runs.

Expert groups (``GROUPED``): the alignment with BLOCK_M = 1 lists the slots by expert without
padding; program g takes the g-th expert that has any slot (an in-register scan of the counts), so
the grid (``min(slots, E)`` groups) depends on M only. Without grouping, program g takes slot g
(one token, whose k experts are distinct, or tiles that finish their own epilogue: the alignment launch is
saved, and an expert that several slots share is read once per slot).

Three program kinds: MMA-fragment tiles (``MMA``, `_decode_mma.mma_program`: fp4 weights pre-shuffled into the
``mma.sync`` register order, 8 tokens a pass; they win at every M where they run), tensor-core tiles of 16 rows
(``DOT``, `_k_loop`), and FMA tiles of one row (`_gemv_k_loop`), which win below one row per expert where the MMA
tiles cannot run. The weight format lives in `_weight_half_tiles` (tensor cores) and `_gemv_values` /
`_gemv_step` (FMAs) with their scale decoders.
"""

import triton
import triton.language as tl

from moe.experts._triton._decode_fp8 import GROUP, fp8_k_loop
from moe.experts._triton._gemm import (_FP8_BLOCK, _FP8_ROW, _MXFP8, _NVFP4, _activate, _dot, _e4m3_scaled,
                                       _e2m1_halves, _e8m0_factor, _fp4_factors, _fp4_half_tiles, _fp4_load,
                                       _fp4_scale_words, _mxfp8_tile)
from moe.experts._triton._decode_mma import (NVFP4_ASM_UNBIAS, NVFP4_SCALE_BIAS,  # noqa: F401
                                             e4m3_bf16_biased, mma_program)
from moe.experts._triton._lang import cdiv_, cumsum_, gdc_launch_dependents, gdc_wait, pdl_supported, sum_  # noqa: F401

# e2m1 codes of 4 bytes -> 8 bfloat16 values times the scale, 2 per register. The code's magnitude
# bits go to bf16 bits 6..8 (exponent 7..8, top mantissa bit 6) and its sign to bit 15: that bf16
# is the e2m1 value times 2**-126 (code 1 a subnormal), which the fma by a scale biased by 2**126
# turns into the value times the scale. prmt first puts byte 0 in the low and byte 1 in the high half
# (then bytes 2 and 3): bits 8..11 hold the low nibble, 12..15 the high nibble of each half's byte.
# Scale lane i covers byte i: its low nibbles take lanes $5/$6 (bytes 0-1 / 2-3), its high nibbles
# HI0/HI1 -- the same registers for MXFP4 (one scale per 32), $7/$8 for NVFP4 (a scale per 16: the
# high nibbles, elements j + 16, are the group's second block).
_E2M1_PTX = """
{
.reg .b32 t<2>, s, m, zero, negz;
mov.b32 zero, 0;
mov.b32 negz, 0x80008000;
prmt.b32 t0, $4, zero, 0x1404;
prmt.b32 t1, $4, zero, 0x3424;
shl.b32 s, t0, 4;
shr.b32 m, t0, 2;
and.b32 s, s, 0x80008000;
and.b32 m, m, 0x01C001C0;
or.b32 s, s, m;
fma.rn.bf16x2 $0, s, $5, negz;
shl.b32 s, t1, 4;
shr.b32 m, t1, 2;
and.b32 s, s, 0x80008000;
and.b32 m, m, 0x01C001C0;
or.b32 s, s, m;
fma.rn.bf16x2 $1, s, $6, negz;
shr.b32 m, t0, 6;
and.b32 s, t0, 0x80008000;
and.b32 m, m, 0x01C001C0;
or.b32 s, s, m;
fma.rn.bf16x2 $2, s, HI0, negz;
shr.b32 m, t1, 6;
and.b32 s, t1, 0x80008000;
and.b32 m, m, 0x01C001C0;
or.b32 s, s, m;
fma.rn.bf16x2 $3, s, HI1, negz;
}
"""
_E2M1_BF16X2 = tl.constexpr(_E2M1_PTX.replace("HI0", "$5").replace("HI1", "$6"))
_E2M1_BF16X2_SPLIT = tl.constexpr(_E2M1_PTX.replace("HI0", "$7").replace("HI1", "$8"))


@triton.jit
def _e8m0_bf16_biased(scale_bytes):
    """2**(byte - 1) as bfloat16: the e8m0 scale times 2**126 (`_E2M1_BF16X2`'s bias). Exact for
    bytes <= 128 (scales <= 2), which the launcher checks once at load."""
    return ((scale_bytes + 126) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)


# the decode GEMM's FINISH: none (the epilogue launches, or one fused split), GEMM1's or GEMM2's (`_finish_if_last`)
FINISH_NONE, FINISH_ACTIVATE, FINISH_COMBINE = 0, 1, 2
_FINISH_ACTIVATE = tl.constexpr(FINISH_ACTIVATE)
# the decode GEMM's part in a programmatic dependent launch (SM90+, `decode.pdl_roles`): none; FIRST, whose programs
# let the next launch start once all of them are past their K loop; SECOND, launched so, whose programs wait for the
# launch before it (its whole grid and memory) before they read what it wrote; CHAINED, launched so too, which waits
# before it reads the routing and then lets the next launch start as FIRST does (GEMM1 after the routing kernel,
# which lets it start at once: `moe.routing.fused`)
PDL_NONE, PDL_FIRST, PDL_SECOND, PDL_CHAINED = 0, 1, 2, 3
_PDL_FIRST = tl.constexpr(PDL_FIRST)
_PDL_SECOND = tl.constexpr(PDL_SECOND)
_PDL_CHAINED = tl.constexpr(PDL_CHAINED)


@triton.jit
def _e2m1_bf16x2(packed, words, shifts, SCALES: tl.constexpr):
    """The packed bf16x2 PTX on a K step's bytes and scale words: (low, high) nibbles' bf16 values,
    exact; NVFP4's lack the factor NVFP4_ASM_UNBIAS (the caller's global scale supplies it)."""
    if SCALES == _NVFP4:  # the low nibbles (elements j) take the group's first scale, the high ones its second
        scale_low = e4m3_bf16_biased((words >> shifts) & 255)
        scale_high = e4m3_bf16_biased((words >> (shifts + 8)) & 255)
        low, high = tl.inline_asm_elementwise(_E2M1_BF16X2_SPLIT, "=r,=r,=r,=r,r,r,r,r,r",
                                              [packed, scale_low, scale_high],
                                              dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        scale = _e8m0_bf16_biased((words >> shifts) & 255)
        low, high = tl.inline_asm_elementwise(_E2M1_BF16X2, "=r,=r,=r,=r,r,r,r", [packed, scale],
                                              dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    return low, high


@triton.jit
def _weight_half_tiles(w_ptrs, s_ptrs, shifts, group_ok, SCALES: tl.constexpr, dtype: tl.constexpr,
                       EVEN_K: tl.constexpr, ASM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """One K step of weights dequantized: the ``[BLOCK_K/2, BLOCK_N]`` half-tiles of elements j and j + 16
    of each group of 32 -- fp4: the low and high nibbles (weights.py's half-split layout; pointers as in
    `_gemm._fp4_half_tiles`); MXFP8: the group's first and second 16 bytes (``w_ptrs`` at the first).
    ``SCALES``: MXFP4, NVFP4 or MXFP8 (`_gemm`'s codes). ``ASM`` (fp4): packed bf16x2 PTX (4 bytes per call,
    bfloat16 only; MXFP4 with scales <= 2; NVFP4 any scale, its values times 2**-8 = 1 / NVFP4_ASM_UNBIAS,
    which the kernel's global-scale multiply undoes); else `_gemm`'s exact float32 math. Both give the same
    bf16 weights up to that power of two."""
    if SCALES == _MXFP8:  # e4m3 bits, MXFP4's scale words: `_gemm._mxfp8_tile` on each half
        low = _mxfp8_tile(w_ptrs, s_ptrs, shifts, group_ok, dtype, EVEN_K, BLOCK_K // 2, BLOCK_N)
        high = _mxfp8_tile(w_ptrs + 16, s_ptrs, shifts, group_ok, dtype, EVEN_K, BLOCK_K // 2, BLOCK_N)
    elif not ASM:
        low, high = _fp4_half_tiles(w_ptrs, s_ptrs, shifts, group_ok, SCALES, dtype, EVEN_K, BLOCK_K, BLOCK_N)
    else:
        packed, words = _fp4_load(w_ptrs, s_ptrs, group_ok, EVEN_K)
        low, high = _e2m1_bf16x2(packed, words, shifts, SCALES)
        low = tl.reshape(low.to(dtype), (BLOCK_K // 2, BLOCK_N))
        high = tl.reshape(high.to(dtype), (BLOCK_K // 2, BLOCK_N))
    return low, high


@triton.jit
def _accumulate(acc, a_lo, a_hi, w_lo, w_hi, IEEE: tl.constexpr):
    """``acc^T [BLOCK_N, BLOCK_M] += w_lo^T @ a_lo + w_hi^T @ a_hi``: tensor cores with the operands
    swapped (A given transposed, ``[BLOCK_K/2, BLOCK_M]``), the few activation rows the MMA's narrow side
    (16), the dequantized weights its register operand -- which Triton 3.6 still stages through shared
    memory to reach that layout (ncu: benchmarks/results/mxfp4_decode_nvidia-h100.md)."""
    return _dot(tl.trans(w_hi), a_hi, _dot(tl.trans(w_lo), a_lo, acc, IEEE), IEEE)


@triton.jit
def _a_pointers(a_ptr, a_rows, row_ok, stride_am, k0, groups_left, BLOCK_K: tl.constexpr):
    """A's low half-tile pointers and mask at K offset ``k0`` (the high half is 16 further), transposed
    for the swapped MMA: ``[BLOCK_K/2, BLOCK_M]``."""
    offs_b = tl.arange(0, BLOCK_K // 2)
    k_low = k0 + (offs_b // 16) * 32 + offs_b % 16
    k_ok = (offs_b // 16) < groups_left
    return a_ptr + a_rows[None, :] * stride_am + k_low[:, None], row_ok[None, :] & k_ok[:, None]


@triton.jit
def _k_loop(acc, acc_up, a_ptr, a_rows, row_ok, stride_am, w_base, stride_wn, ws_base, stride_wsn,
            stride_wsk, offs_n, N, K, k_first, k_last,
            GATED: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
            ASM: tl.constexpr, SCALES: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The tensor-core K loop: K steps ``k_first .. k_last - 1`` of one row chunk; the half-tiles' A
    columns are runs of 16.
    Group g's scale is byte g of the scale words (MXFP4, MXFP8), or bytes 2g and 2g + 1 (NVFP4: one per 16).
    A row's bytes per group: 16 packed fp4, or 32 MXFP8 (one per element, the canonical order)."""
    if SCALES == _MXFP8:
        group_bytes = 32
    else:
        group_bytes = 16
    g3 = tl.arange(0, BLOCK_K // 32)[:, None, None]
    n3 = offs_n[None, None, :]
    step_bytes = (BLOCK_K // 32) * group_bytes
    w_ptrs = w_base + n3 * stride_wn + (k_first * step_bytes + g3 * group_bytes + tl.arange(0, 16)[None, :, None])
    s_base = ws_base + n3 * stride_wsn
    for kk in range(k_first, k_last):
        group = kk * (BLOCK_K // 32) + g3
        groups_left = K // 32 - kk * (BLOCK_K // 32)
        a_ptrs, a_ok = _a_pointers(a_ptr, a_rows, row_ok, stride_am, kk * BLOCK_K, groups_left, BLOCK_K)
        a_lo = tl.load(a_ptrs, mask=a_ok, other=0.0)
        a_hi = tl.load(a_ptrs + 16, mask=a_ok, other=0.0)
        s_ptrs, shifts = _fp4_scale_words(s_base, group, stride_wsk, SCALES)
        w_lo, w_hi = _weight_half_tiles(w_ptrs, s_ptrs, shifts, g3 < groups_left, SCALES, a_lo.dtype, EVEN_K,
                                        ASM, BLOCK_K, BLOCK_N)
        acc = _accumulate(acc, a_lo, a_hi, w_lo, w_hi, IEEE)
        if GATED:  # the up rows: N further down, in the data and in the scale words alike
            w_lo, w_hi = _weight_half_tiles(w_ptrs + N * stride_wn, s_ptrs + N * stride_wsn, shifts,
                                            g3 < groups_left, SCALES, a_lo.dtype, EVEN_K, ASM, BLOCK_K, BLOCK_N)
            acc_up = _accumulate(acc_up, a_lo, a_hi, w_lo, w_hi, IEEE)
        w_ptrs += step_bytes
    return acc, acc_up


# e2m1 codes of 4 bytes -> their 8 values times 2**-6 as float16, exact (no scale): each code becomes an e4m3
# byte -- its three magnitude bits to bits 2..4 (exponent bits 0..1, top mantissa bit), its sign to bit 7, which
# reads as the value times 2**-6 (code 1 an e4m3 subnormal, 2**-7) -- and cvt widens the bytes two at a time.
# 9 logic ops and 4 conversions per 8 codes, where building the float16 bits directly took 20 logic ops.
# Byte i's low nibble lands in element i of $0/$1 (two per register), its high nibble in element i of $2/$3.
_E2M1_F16X2 = tl.constexpr("""
{
.reg .b32 a, b, lo, hi;
.reg .b16 l0, l1, h0, h1;
shl.b32 a, $4, 4;
shl.b32 b, $4, 2;
and.b32 a, a, 0x80808080;
and.b32 b, b, 0x1C1C1C1C;
or.b32 lo, a, b;
shr.b32 b, $4, 2;
and.b32 a, $4, 0x80808080;
and.b32 b, b, 0x1C1C1C1C;
or.b32 hi, a, b;
mov.b32 {l0, l1}, lo;
mov.b32 {h0, h1}, hi;
cvt.rn.f16x2.e4m3x2 $0, l0;
cvt.rn.f16x2.e4m3x2 $1, l1;
cvt.rn.f16x2.e4m3x2 $2, h0;
cvt.rn.f16x2.e4m3x2 $3, h1;
}
""")
E2M1_F16X2_UNIT = 2.0**-6  # the factor `_E2M1_F16X2`'s values carry
# `_gemm._fp4_factors` undo `_gemm._e2m1_halves`' 2**-14; times this they undo the PTX's unit instead
_ASM_TO_INT_UNIT = tl.constexpr(2.0**-14 / E2M1_F16X2_UNIT)


@triton.jit
def _gemv_values(lo_bytes, hi_bytes, SCALES: tl.constexpr, ASM: tl.constexpr):
    """The unscaled float32 weights of one K step ``[1, BLOCK_N, G, 16]``, exact: (elements j, elements
    j + 16) of each group. fp4: the low and high nibbles of ``lo_bytes``, e2m1 values times 2**-14
    (`_gemm._e2m1_halves`) or, with ``ASM``, times 2**-6 (`_E2M1_F16X2`; `_gemv_step` scales its factors
    to match); MXFP8: ``lo_bytes`` and ``hi_bytes``, the group's first and second 16 e4m3 codes, values
    times 2**-8."""
    if SCALES == _MXFP8:
        low, high = _e4m3_scaled(lo_bytes, tl.float32), _e4m3_scaled(hi_bytes, tl.float32)
    else:
        if ASM:
            low, high = tl.inline_asm_elementwise(_E2M1_F16X2, "=r,=r,=r,=r,r", [lo_bytes],
                                                  dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
        else:
            low, high = _e2m1_halves(lo_bytes)
        low, high = low.to(tl.float32), high.to(tl.float32)
    return low, high


@triton.jit
def _gemv_load(w_ptrs, s_ptrs, ok, SCALES: tl.constexpr):
    """One K step's weight bytes ``[1, BLOCK_N, G, 16]`` (MXFP8: the groups' first and second 16; fp4: the
    same bytes twice) and scale words ``[1, BLOCK_N, G]``; ``ok [1, 1, G]`` masks the groups past K (read
    as 0)."""
    lo = tl.load(w_ptrs, mask=ok[:, :, :, None], other=0)
    hi = lo
    if SCALES == _MXFP8:
        hi = tl.load(w_ptrs + 16, mask=ok[:, :, :, None], other=0)
    return lo, hi, tl.load(s_ptrs, mask=ok, other=0)


@triton.jit
def _gemv_step(acc, a_lo, a_hi, lo_bytes, hi_bytes, words, shifts, SCALES: tl.constexpr, ASM: tl.constexpr):
    """``acc [1, BLOCK_N, G] += factor * (a_lo . w_lo + a_hi . w_hi)`` over each group's 16 + 16
    elements: the products of exact unscaled weights (`_gemv_values`) summed per group in float32, then
    times the group's factors (`_gemm._fp4_factors`: scale times 2**14; MXFP8 the e8m0 scale times 2**8).
    One factor per group (MXFP4, MXFP8): one sum over the group's 32 products."""
    w_lo, w_hi = _gemv_values(lo_bytes, hi_bytes, SCALES, ASM)
    if SCALES == _NVFP4:  # a scale per 16: the low and the high half-tile each have their own
        f_lo, f_hi = _fp4_factors(words, shifts, SCALES)
        if ASM:
            f_lo, f_hi = f_lo * _ASM_TO_INT_UNIT, f_hi * _ASM_TO_INT_UNIT
        acc += sum_(a_lo * w_lo, 3) * f_lo + sum_(a_hi * w_hi, 3) * f_hi
    else:
        if SCALES == _MXFP8:
            factor = _e8m0_factor((words >> shifts) & 255) * 0.015625  # 2**-6: scale * 2**8
        else:
            factor, _ = _fp4_factors(words, shifts, SCALES)
            if ASM:
                factor = factor * _ASM_TO_INT_UNIT
        acc += sum_(a_lo * w_lo + a_hi * w_hi, 3) * factor
    return acc


@triton.jit
def _gemv_k_loop(acc, acc_up, a_ptr, a_rows, row_ok, stride_am, w_base, stride_wn, ws_base, stride_wsn,
                 stride_wsk, offs_n, N, K, k_first, k_last,
                 GATED: tl.constexpr, ASM: tl.constexpr, SCALES: tl.constexpr, BLOCK_K: tl.constexpr,
                 STAGES: tl.constexpr):
    """The one-row K loop (float32 FMAs): K steps ``k_first .. k_last - 1`` into ``acc [1, BLOCK_N, G]``.
    The weight bytes are addressed ``[1, BLOCK_N, G, 16]``, each thread's 16 contiguous bytes one row's
    group (one 16-byte load, one scale), and every tensor keeps that layout: no reshape, no layout change
    of the weights; only the step's BLOCK_K activations are redistributed. One row: with more, Triton laid the
    products out as the activations (the weights went through shared memory, the group sums across
    threads: 3x slower on an H200), so a program takes its rows one at a time (the launcher's check).
    ``STAGES`` > 1: Triton's pipeliner copies the loads of the next STAGES - 1 steps into shared memory
    ahead (cp.async; without the explicit `tl.range` stages it leaves loads that feed no MMA
    unpipelined). On an H200 every stage count > 1 measured slower (GPT-OSS MXFP4 M = 1: 45.0 against
    47.1-52.3 us), and so did loads a step ahead into registers (the bytes carried one per register);
    the shipped tiles take 1."""
    if SCALES == _MXFP8:
        group_bytes = 32
    else:
        group_bytes = 16
    G: tl.constexpr = BLOCK_K // 32
    g3 = tl.arange(0, G)[None, None, :]
    g4 = g3[:, :, :, None]
    j4 = tl.arange(0, 16)[None, None, None, :]
    step_bytes = G * group_bytes
    w_ptrs = w_base + offs_n[None, :, None, None] * stride_wn + (k_first * step_bytes + g4 * group_bytes + j4)
    s_base = ws_base + offs_n[None, :, None] * stride_wsn
    a_ptrs = a_ptr + a_rows[:, None, None, None] * stride_am + (k_first * BLOCK_K + g4 * 32 + j4)
    for kk in tl.range(k_first, k_last, num_stages=STAGES):
        ok = kk * G + g3 < K // 32
        s_ptrs, shifts = _fp4_scale_words(s_base, kk * G + g3, stride_wsk, SCALES)
        a_ok = row_ok[:, None, None, None] & ok[:, :, :, None]
        a_lo = tl.load(a_ptrs, mask=a_ok, other=0.0).to(tl.float32)
        a_hi = tl.load(a_ptrs + 16, mask=a_ok, other=0.0).to(tl.float32)
        lo, hi, words = _gemv_load(w_ptrs, s_ptrs, ok, SCALES)
        acc = _gemv_step(acc, a_lo, a_hi, lo, hi, words, shifts, SCALES, ASM)
        if GATED:  # the up rows: N further down, in the data and in the scale words alike
            lo, hi, words = _gemv_load(w_ptrs + N * stride_wn, s_ptrs + N * stride_wsn, ok, SCALES)
            acc_up = _gemv_step(acc_up, a_lo, a_hi, lo, hi, words, shifts, SCALES, ASM)
        w_ptrs += step_bytes
        a_ptrs += BLOCK_K
    return acc, acc_up


@triton.jit
def _group(g, ids_ptr, map_ptr, counts_ptr, ends_ptr, num_local,
           GROUPED: tl.constexpr, HAS_MAP: tl.constexpr, E_PAD: tl.constexpr):
    """(local expert or -1, first position in the sorted slots, slot count) of group ``g``."""
    if GROUPED:  # the g-th expert with any slot, in expert order
        experts = tl.arange(0, E_PAD)
        counts = tl.load(counts_ptr + experts, mask=experts < num_local, other=0)
        ends = tl.load(ends_ptr + experts, mask=experts < num_local, other=0)
        active = counts > 0
        pick = active & (cumsum_(active.to(tl.int32), 0) - 1 == g)
        found = sum_(pick.to(tl.int32), 0)
        expert = tl.where(found > 0, sum_(tl.where(pick, experts, 0), 0), -1)
        count = sum_(tl.where(pick, counts, 0), 0)
        return expert, sum_(tl.where(pick, ends, 0), 0) - count, count
    expert = tl.load(ids_ptr + g)
    if HAS_MAP:
        expert = tl.load(map_ptr + expert)
    return expert, g, 1


# the token-dependent counts are not specialized on, so one compiled kernel serves every M
@triton.jit(do_not_specialize=["num_local"])
def decode_gemm_kernel(
    a_ptr, w_ptr, ws_ptr, wg_ptr, bias_ptr, out_ptr, part_ptr, ids_ptr, map_ptr, counts_ptr, ends_ptr, sorted_ptr,
    tickets_ptr, topk_w_ptr, fw_ptr, fs_ptr, w_desc,
    num_local, N, K, w_rows, stride_am, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk, stride_be,
    stride_om, stride_ps, stride_pm, stride_fe, stride_fse, k_blocks, up_blocks, alpha, beta, limit,
    GROUPED: tl.constexpr, HAS_MAP: tl.constexpr, A_ROW_DIV: tl.constexpr, GATED: tl.constexpr,
    ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, FUSED: tl.constexpr, FINISH: tl.constexpr,
    TOP_K: tl.constexpr, SPLITS: tl.constexpr,
    E_PAD: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr, DOT: tl.constexpr, ASM: tl.constexpr,
    SCALES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    MMA: tl.constexpr, PDL: tl.constexpr, TMA: tl.constexpr, UNPREDICATED: tl.constexpr,
):
    if PDL == _PDL_CHAINED:  # the routing this reads may still be being written
        gdc_wait()
    expert, start, count = _group(tl.program_id(1), ids_ptr, map_ptr, counts_ptr, ends_ptr, num_local,
                                  GROUPED, HAS_MAP, E_PAD)
    if PDL == _PDL_SECOND:  # in every program, so that this grid ends after the first one
        gdc_wait()
    if expert < 0:
        return
    if MMA:  # the weights in MMA fragment order (_decode_mma.py)
        mma_program(a_ptr, fw_ptr, fs_ptr, wg_ptr, bias_ptr, out_ptr, part_ptr, sorted_ptr, expert.to(tl.int64),
                    start, count, N, K, stride_am, stride_fe, stride_fse, k_blocks, up_blocks, stride_be, stride_om,
                    stride_ps, stride_pm, alpha, beta, limit, GROUPED, A_ROW_DIV, GATED, ACTIVATION, HAS_BIAS, FUSED,
                    SPLITS, SCALES, NVFP4_ASM_UNBIAS, BLOCK_N, BLOCK_K // 64, UNPREDICATED)
        if PDL == _PDL_FIRST or PDL == _PDL_CHAINED:
            gdc_launch_dependents()
        if FINISH != 0 and not GROUPED:  # a program per slot: its one slot is `start`
            _finish_if_last(start.to(tl.int64), expert.to(tl.int64), tickets_ptr, part_ptr, bias_ptr, topk_w_ptr,
                            ids_ptr, map_ptr, out_ptr, N, stride_ps, stride_pm, stride_be, stride_om, alpha, beta,
                            limit, GATED, ACTIVATION, HAS_BIAS, FINISH, TOP_K, SPLITS, BLOCK_N)
        return
    split = tl.program_id(0) % SPLITS
    n0 = (tl.program_id(0) // SPLITS) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_n = offs_n % N  # the tail's extra columns re-read valid ones; they are never stored
    if SCALES == _FP8_BLOCK or SCALES == _FP8_ROW:  # K steps of 128 columns (_decode_fp8.py)
        steps = cdiv_(K, GROUP)
    else:
        steps = cdiv_(K, BLOCK_K)
    per_split = cdiv_(steps, SPLITS)
    k_first = tl.minimum(split * per_split, steps)
    k_last = tl.minimum(k_first + per_split, steps)
    expert = expert.to(tl.int64)
    w_base = w_ptr + expert * stride_we
    ws_base = ws_ptr + expert * stride_wse
    for m0 in range(0, count, BLOCK_M):  # every chunk re-reads the slice, from L2: rare at decode
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < count
        if GROUPED:
            slots = tl.load(sorted_ptr + start + rows, mask=row_ok, other=0)
        else:
            slots = start + rows * 0
        slots = slots.to(tl.int64)
        if SCALES == _FP8_BLOCK or SCALES == _FP8_ROW:  # W8A8: the activations quantized inside the loop
            acc, acc_up = fp8_k_loop(a_ptr, slots // A_ROW_DIV, row_ok, stride_am, w_base, w_desc,
                                     (expert * w_rows + n0).to(tl.int32), stride_wn, ws_base, stride_wsn,
                                     stride_wsk, offs_n, N, K, k_first, k_last,
                                     GATED, SCALES == _FP8_ROW, EVEN_K, DOT, TMA, BLOCK_M, BLOCK_N, BLOCK_K)
        else:
            if DOT:  # transposed (see `_accumulate`)
                acc = tl.full([BLOCK_N, BLOCK_M], 0, tl.float32)
                acc, acc_up = _k_loop(acc, acc, a_ptr, slots // A_ROW_DIV, row_ok, stride_am, w_base, stride_wn,
                                      ws_base, stride_wsn, stride_wsk, offs_n, N, K, k_first, k_last,
                                      GATED, EVEN_K, IEEE, ASM, SCALES, BLOCK_K, BLOCK_N)
                acc, acc_up = tl.trans(acc), tl.trans(acc_up)
            else:
                acc = tl.full([BLOCK_M, BLOCK_N, BLOCK_K // 32], 0, tl.float32)
                acc, acc_up = _gemv_k_loop(acc, acc, a_ptr, slots // A_ROW_DIV, row_ok, stride_am, w_base,
                                           stride_wn, ws_base, stride_wsn, stride_wsk, offs_n, N, K, k_first,
                                           k_last, GATED, ASM, SCALES, BLOCK_K, STAGES)
                acc, acc_up = sum_(acc, 2), sum_(acc_up, 2)
        if PDL == _PDL_FIRST or PDL == _PDL_CHAINED:  # the weights are streamed: the second GEMM may launch
            gdc_launch_dependents()
        if SCALES == _NVFP4:  # the expert's global scale factors out of the sum over K (and the splits)
            global_scale = tl.load(wg_ptr + expert)
            if ASM and DOT:  # the rest of the bf16x2 PTX's bias (`e4m3_bf16_biased`; the FMA path's PTX has none)
                global_scale = global_scale * NVFP4_ASM_UNBIAS
            acc, acc_up = acc * global_scale, acc_up * global_scale
        mask = row_ok[:, None] & n_ok[None, :]
        if FUSED:  # one split: the whole sum is here; bias and activation, then the output
            if HAS_BIAS:
                acc += tl.load(bias_ptr + expert * stride_be + offs_n)[None, :]
                if GATED:
                    acc_up += tl.load(bias_ptr + expert * stride_be + N + offs_n)[None, :]
            acc = _activate(acc, acc_up, ACTIVATION, alpha, beta, limit)
            tl.store(out_ptr + slots[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            p_ptrs = part_ptr + split * stride_ps + slots[:, None] * stride_pm + offs_n[None, :]
            tl.store(p_ptrs, acc, mask=mask)
            if GATED:
                tl.store(p_ptrs + N, acc_up, mask=mask)
            if FINISH != 0:  # the last program to arrive at the row's epilogue applies it
                if GROUPED:  # one-row FMA tiles: the chunk's one slot
                    slot = sum_(slots, 0)
                else:  # a program per slot (any tile): its one slot
                    slot = start.to(tl.int64)
                _finish_if_last(slot, expert, tickets_ptr, part_ptr, bias_ptr, topk_w_ptr, ids_ptr,
                                map_ptr, out_ptr, N, stride_ps, stride_pm, stride_be, stride_om, alpha, beta, limit,
                                GATED, ACTIVATION, HAS_BIAS, FINISH, TOP_K, SPLITS, BLOCK_N)


@triton.jit
def _split_sum(p_ptrs, stride_ps, mask, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """The splits' partial sums at ``p_ptrs``, added in split order (deterministic). Through L2 (``.cg``):
    a finishing program reads partials other SMs stored in the same launch."""
    total = tl.full([BLOCK], 0, tl.float32)
    for s in tl.static_range(SPLITS):
        total += tl.load(p_ptrs + s * stride_ps, mask=mask, other=0.0, cache_modifier=".cg")
    return total


@triton.jit
def _local_expert(ids_ptr, map_ptr, slot, HAS_MAP: tl.constexpr):
    expert = tl.load(ids_ptr + slot)
    if HAS_MAP:
        expert = tl.load(map_ptr + expert)
    return expert.to(tl.int64)


@triton.jit
def _activated(part_ptr, bias_ptr, slot, expert, cols, ok, N, stride_ps, stride_pm, stride_be, alpha, beta, limit,
               GATED: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, SPLITS: tl.constexpr,
               BLOCK: tl.constexpr):
    """GEMM1's epilogue on columns ``cols`` of ``slot``: ``act(sum of the splits + bias)``."""
    p_ptrs = part_ptr + slot * stride_pm + cols
    gate = _split_sum(p_ptrs, stride_ps, ok, SPLITS, BLOCK)
    up = gate
    if GATED:
        up = _split_sum(p_ptrs + N, stride_ps, ok, SPLITS, BLOCK)
    if HAS_BIAS:
        gate += tl.load(bias_ptr + expert * stride_be + cols, mask=ok, other=0.0)
        if GATED:
            up += tl.load(bias_ptr + expert * stride_be + N + cols, mask=ok, other=0.0)
    return _activate(gate, up, ACTIVATION, alpha, beta, limit)


@triton.jit
def _combined(part_ptr, bias_ptr, weights_ptr, ids_ptr, map_ptr, token, cols, ok, stride_ps, stride_pm, stride_be,
              TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MAP: tl.constexpr, SPLITS: tl.constexpr,
              BLOCK: tl.constexpr):
    """GEMM2's epilogue on columns ``cols`` of ``token``: ``sum_j weight[token, j] * (sum of the splits of
    slot token*k+j + bias)`` over the slots whose expert is here, in a fixed order."""
    acc = tl.full([BLOCK], 0, tl.float32)
    for j in tl.static_range(TOP_K):
        slot = token * TOP_K + j
        expert = _local_expert(ids_ptr, map_ptr, slot + cols * 0, HAS_MAP)
        here = ok & (expert >= 0)
        y = _split_sum(part_ptr + slot * stride_pm + cols, stride_ps, here, SPLITS, BLOCK)
        if HAS_BIAS:
            y += tl.load(bias_ptr + expert * stride_be + cols, mask=here, other=0.0)
        acc += tl.load(weights_ptr + slot) * y
    return acc


@triton.jit
def _finish_if_last(slot, expert, tickets_ptr, part_ptr, bias_ptr, weights_ptr, ids_ptr, map_ptr, out_ptr, N,
                    stride_ps, stride_pm, stride_be, stride_om, alpha, beta, limit,
                    GATED: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, FINISH: tl.constexpr,
                    TOP_K: tl.constexpr, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The epilogue launches' work, done by whichever program stores the last partial sums it needs: a
    ticket per (output row, N tile) counts the arrivals -- GEMM1 (``FINISH_ACTIVATE``) the row's SPLITS
    programs, GEMM2 (``FINISH_COMBINE``) those of the token's TOP_K slots (every expert local) -- and the
    last one sums the partials in the fixed order of the epilogue launches (the same bits) and puts its
    ticket back to 0 for the next launch. ``slot`` is a scalar (one-row programs), so the ticket is one
    atomic whose old value every thread of the program sees; the barrier before it orders all their
    partial-sum stores before its release."""
    tile = tl.program_id(0) // SPLITS
    n_tiles = tl.num_programs(0) // SPLITS
    if FINISH == _FINISH_ACTIVATE:
        row = slot
        arrivals = SPLITS
    else:
        row = slot // TOP_K
        arrivals = SPLITS * TOP_K
    ticket = tickets_ptr + row * n_tiles + tile
    tl.debug_barrier()
    if tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == arrivals - 1:
        tl.store(ticket, 0)
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = cols < N
        if FINISH == _FINISH_ACTIVATE:
            out = _activated(part_ptr, bias_ptr, slot, expert, cols, ok, N, stride_ps, stride_pm, stride_be,
                             alpha, beta, limit, GATED, ACTIVATION, HAS_BIAS, SPLITS, BLOCK_N)
        else:
            out = _combined(part_ptr, bias_ptr, weights_ptr, ids_ptr, map_ptr, row, cols, ok, stride_ps, stride_pm,
                            stride_be, TOP_K, HAS_BIAS, False, SPLITS, BLOCK_N)
        tl.store(out_ptr + row * stride_om + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def activate_splits_kernel(part_ptr, bias_ptr, ids_ptr, map_ptr, out_ptr, N, stride_ps, stride_pm, stride_be,
                           stride_om, alpha, beta, limit,
                           GATED: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr,
                           HAS_MAP: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """GEMM1's epilogue launch: ``out[slot] = act(sum of the splits + bias)`` for slots whose expert is here."""
    slot = tl.program_id(0).to(tl.int64)
    expert = _local_expert(ids_ptr, map_ptr, slot, HAS_MAP)
    if expert < 0:
        return
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    out = _activated(part_ptr, bias_ptr, slot, expert, cols, ok, N, stride_ps, stride_pm, stride_be, alpha, beta,
                     limit, GATED, ACTIVATION, HAS_BIAS, SPLITS, BLOCK)
    tl.store(out_ptr + slot * stride_om + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def combine_splits_kernel(part_ptr, bias_ptr, weights_ptr, ids_ptr, map_ptr, out_ptr, H, stride_ps, stride_pm,
                          stride_be, stride_om,
                          TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MAP: tl.constexpr,
                          SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """GEMM2's epilogue launch: `_combined` on a block of columns of one token."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    acc = _combined(part_ptr, bias_ptr, weights_ptr, ids_ptr, map_ptr, token, cols, ok, stride_ps, stride_pm,
                    stride_be, TOP_K, HAS_BIAS, HAS_MAP, SPLITS, BLOCK)
    tl.store(out_ptr + token * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)
