"""The MMA-fragment decode program (`decode.DecodeTile.mma`): MXFP4 / NVFP4 weights x bfloat16 activations on
``mma.sync.m16n8k16`` with the few activation rows as the MMA's narrow side (8 tokens) and the weights read
straight into its A registers -- no shared memory, no layout conversion.

Triton places a tensor's elements on threads as it likes, and a warp-wide MMA needs to know which lane holds
which value. So every tensor here is one-dimensional with one element per thread (``2 * BLOCK_N`` of them:
BLOCK_N / 16 warps), element i on thread i -- the layout Triton gives such a tensor -- and every load that
feeds the MMA is PTX too (`_LD16`), which Triton's coalescing pass (the only one that would widen a thread's
share) never touches. Warp w owns weight rows ``16 (tile * W + w) ..`` + 15; lane ``4g + t`` loads the 16 bytes
`weights.mma_fragments` put there for it (rows g and g + 8, two groups of 32 along K) and the 4 bytes of their
scales, pairs the scales in PTX (MXFP4's e8m0 and NVFP4's e4m3 alike: `_e8m0_pairs_ptx`, `_e4m3_pairs_ptx`),
decodes the codes to bf16 with the scale folded in (`e2m1_fragment_ptx`: the bf16x2 trick of the tensor-core
tiles' `_decode._E2M1_PTX` on codes pre-placed for it; exact where `decode.packed_dequantization` holds) and
runs the four MMAs of the 64-column K step, accumulating token ``2t, 2t + 1``'s sums of rows g and g + 8.
Its activations are token g's 16 contiguous bytes per group, the K order both operands agree on. ``UNROLL``
steps' loads go out before their MMAs (Triton does not pipeline loads it cannot see). The epilogue is the
other kinds': bias and activation with one split, partial sums otherwise (with a program per slot the caller
may finish them in the kernel, `_decode._finish_if_last`).
"""

import triton
import triton.language as tl

from moe.experts._triton._gemm import _NVFP4, _activate, _e4m3_scaled
from moe.experts._triton._lang import cdiv_

MMA_TOKENS = tl.constexpr(8)  # the MMA's N: tokens per pass over an expert's weights


# NVFP4's e4m3 scales reach the PTX as scale * 2**NVFP4_SCALE_BIAS: normal and finite in bf16 for every
# code (2**-9 .. 448 -> 2**109 .. < 2**127), and the products with the e2m1 values times 2**-126 are
# normal and exact (value * scale * 2**-8: 2**-18 .. 10.5, at most 2 + 4 significant bits of bf16's 8).
# The rest of the 2**126, NVFP4_ASM_UNBIAS, goes into the global scale after the K sum (tests/test_nvfp4_asm.py).
NVFP4_SCALE_BIAS = 118
_E4M3_SCALED_TO_BIASED = tl.constexpr(2.0 ** (NVFP4_SCALE_BIAS + 8))  # `_e4m3_scaled` gives scale * 2**-8
NVFP4_ASM_UNBIAS = tl.constexpr(2.0 ** (126 - NVFP4_SCALE_BIAS))


@triton.jit
def e4m3_bf16_biased(scale_bytes):
    """The e4m3 scale times 2**NVFP4_SCALE_BIAS as bfloat16, exact for every byte (0x7F/0xFF read as
    480, as `_e4m3_scaled` reads them); the e2m1 products then lack a factor NVFP4_ASM_UNBIAS."""
    return (_e4m3_scaled(scale_bytes, tl.float32) * _E4M3_SCALED_TO_BIASED).to(tl.bfloat16)


def e2m1_fragment_ptx(word: str, scale_g: str, scale_g8: str, out: tuple[str, str, str, str]) -> str:
    """PTX body: the 8 codes of a fragment word (`weights.FRAGMENT_BITS`) as 4 bf16x2 registers ``out`` (the
    first MMA's rows g, g + 8, then the second's) times the bf16x2 scales of rows g and g + 8. Each register's
    bits go to bf16 bits 6..8 and 15 by one shift and one AND (the last by three of each): the value times 2**-126,
    as in `_decode._E2M1_PTX`, which the fma by the biased scale makes the value times the scale. Needs the
    registers x, y, negz (-0.0 twice)."""
    r0, r1, r2, r3 = out
    return f"""
and.b32 x, {word}, 0x81C081C0;
fma.rn.bf16x2 {r0}, x, {scale_g}, negz;
shl.b32 x, {word}, 3;
and.b32 x, x, 0x81C081C0;
fma.rn.bf16x2 {r1}, x, {scale_g8}, negz;
shl.b32 x, {word}, 6;
and.b32 x, x, 0x81C081C0;
fma.rn.bf16x2 {r2}, x, {scale_g}, negz;
shr.b32 x, {word}, 4;
and.b32 x, x, 0x00400040;
shr.b32 y, {word}, 6;
and.b32 y, y, 0x01800180;
or.b32 x, x, y;
shl.b32 y, {word}, 4;
and.b32 y, y, 0x80008000;
or.b32 x, x, y;
fma.rn.bf16x2 {r3}, x, {scale_g8}, negz;
"""


# e8m0 byte k of the scale word -> bf16x2 2**(byte - 1) in both halves (`_decode._e8m0_bf16_biased`): prmt puts
# the byte in the low byte of both halves, + 126 and << 7 build each half's exponent (at most 9 bits: no carry
# between halves)
def _e8m0_pairs_ptx(word: str, pairs: tuple[str, str, str, str]) -> str:
    return "".join(f"prmt.b32 {p}, {word}, 0, 0x4{k}4{k};\nadd.u32 {p}, {p}, 0x007E007E;\nshl.b32 {p}, {p}, 7;\n"
                   for k, p in enumerate(pairs))


# e4m3 byte k of the scale word -> bf16x2 (byte's value * 2**NVFP4_SCALE_BIAS) in both halves, as
# `e4m3_bf16_biased` gives it: prmt spreads the byte over both halves; its sign goes to bit 15 and its seven
# exponent and mantissa bits to bits 4..10, which reads as the value * 2**-120 in bfloat16 (both biases apart by
# 120; e4m3's subnormals land on bfloat16's); two exact fmas by 2**119 (0x7B00) make that * 2**118. The fmas need
# subnormal inputs kept, as sm80+'s bf16 fma does (tests/gpu/test_triton_decode_gpu.py checks all 256 bytes).
def _e4m3_pairs_ptx(word: str, pairs: tuple[str, str, str, str]) -> str:
    return "".join(f"prmt.b32 {p}, {word}, 0, 0x4{k}4{k};\nshl.b32 x, {p}, 8;\nand.b32 x, x, 0x80008000;\n"
                   f"shl.b32 {p}, {p}, 4;\nand.b32 {p}, {p}, 0x07F007F0;\nor.b32 {p}, {p}, x;\n"
                   f"fma.rn.bf16x2 {p}, {p}, two119, negz;\nfma.rn.bf16x2 {p}, {p}, two119, negz;\n"
                   for k, p in enumerate(pairs))


_MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"


def _mma_step_ptx(e8m0: bool) -> str:
    """One 64-column K step of one lane: $4..$7 its weight words (group 0: $4, $5; group 1: $6, $7); $8 its scale
    word (rows g / g + 8 of group 0, of group 1), MXFP4's e8m0 bytes (``e8m0``) or NVFP4's e4m3 ones, paired here;
    then 8 registers of activations (group 0's 8 bf16, group 1's) and the 4 accumulators; $0..$3 out, written by the
    last MMA only (no input is read after an output is written, so they may share registers)."""
    s = ("sp0", "sp1", "sp2", "sp3")
    acc = "$17, $18, $19, $20"
    text = "{\n.reg .b32 x, y, negz, two119, sp<4>, a<16>;\n.reg .f32 d<4>;\nmov.b32 negz, 0x80008000;\n"
    if e8m0:
        text += _e8m0_pairs_ptx("$8", s)
    else:
        text += "mov.b32 two119, 0x7B007B00;\n" + _e4m3_pairs_ptx("$8", s)
    text += (e2m1_fragment_ptx("$4", s[0], s[1], ("a0", "a1", "a4", "a5"))
             + e2m1_fragment_ptx("$5", s[0], s[1], ("a2", "a3", "a6", "a7"))
             + e2m1_fragment_ptx("$6", s[2], s[3], ("a8", "a9", "a12", "a13"))
             + e2m1_fragment_ptx("$7", s[2], s[3], ("a10", "a11", "a14", "a15")))
    text += (f"{_MMA} {{d0, d1, d2, d3}}, {{a0, a1, a2, a3}}, {{$9, $10}}, {{{acc}}};\n"
             f"{_MMA} {{d0, d1, d2, d3}}, {{a4, a5, a6, a7}}, {{$11, $12}}, {{d0, d1, d2, d3}};\n"
             f"{_MMA} {{d0, d1, d2, d3}}, {{a8, a9, a10, a11}}, {{$13, $14}}, {{d0, d1, d2, d3}};\n"
             f"{_MMA} {{$0, $1, $2, $3}}, {{a12, a13, a14, a15}}, {{$15, $16}}, {{d0, d1, d2, d3}};\n}}")
    return text


MMA_STEP_PTX = tl.constexpr(_mma_step_ptx(e8m0=False))  # NVFP4: the e4m3 word, paired in the PTX
MMA_STEP_PTX_E8M0 = tl.constexpr(_mma_step_ptx(e8m0=True))  # MXFP4: the e8m0 word, likewise
_MMA_STEP_CONSTRAINTS = tl.constexpr("=f,=f,=f,=f" + ",r" * 13 + ",f,f,f,f")

# 16 bytes at $4 into $0..$3 where $5 != 0, else zeros (read-only data: the non-coherent path)
_LD16 = tl.constexpr("""{
.reg .pred p;
setp.ne.b32 p, $5, 0;
@p ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];
@!p mov.b32 $0, 0;
@!p mov.b32 $1, 0;
@!p mov.b32 $2, 0;
@!p mov.b32 $3, 0;
}""")


@triton.jit
def _ld16(ptr, pred):
    return tl.inline_asm_elementwise(_LD16, "=r,=r,=r,=r,l,r", [ptr, pred.to(tl.int32)],
                                     dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)


_LD4 = tl.constexpr("""{
.reg .pred p;
setp.ne.b32 p, $2, 0;
@p ld.global.nc.b32 $0, [$1];
@!p mov.b32 $0, 0;
}""")


@triton.jit
def _ld4(ptr, pred):
    """4 bytes at ``ptr`` where ``pred``, else 0 (as `_LD16`)."""
    return tl.inline_asm_elementwise(_LD4, "=r,l,r", [ptr, pred.to(tl.int32)], dtype=tl.int32, is_pure=True, pack=1)


# the same 16 / 4 bytes with no predicate (`DecodeTile.unpredicated`): weight loads whose address is always inside
# the expert's fragments
_LD16_ANY = tl.constexpr("ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];")
_LD4_ANY = tl.constexpr("ld.global.nc.b32 $0, [$1];")


@triton.jit
def _weights(w_ptr, s_ptr, ok, UNPREDICATED: tl.constexpr):
    """One K step's weight words and scale word of a lane: zeros where not ``ok``, or (``UNPREDICATED``) loaded
    with no predicate."""
    if UNPREDICATED:
        w0, w1, w2, w3 = tl.inline_asm_elementwise(_LD16_ANY, "=r,=r,=r,=r,l", [w_ptr],
                                                   dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True,
                                                   pack=1)
        scale = tl.inline_asm_elementwise(_LD4_ANY, "=r,l", [s_ptr], dtype=tl.int32, is_pure=True, pack=1)
        return w0, w1, w2, w3, scale
    w0, w1, w2, w3 = _ld16(w_ptr, ok)
    return w0, w1, w2, w3, _ld4(s_ptr, ok)


@triton.jit
def _loads(kk, ok, k_last, x_ptrs, tok_ok, t, K, w_ptrs, s_ptrs, up_w, up_s, GATED: tl.constexpr,
           UNPREDICATED: tl.constexpr):
    """Everything K step ``kk`` reads (``ok``: the step is in the split): the activations (8 words, zeros where not
    ``ok``), the gate (or only) rows' weights and scales, the up rows'. ``UNPREDICATED``: the weight loads take no
    predicate; a step past the split (an unrolled loop's last steps) reads the split's last step again, whose products
    with its zero activations add nothing (the packed dequantization is finite for every code and finite scale)."""
    k0 = kk * 64 + t * 8
    a_lo = _ld16(x_ptrs + kk * 64, ok & tok_ok & (k0 < K))
    a_hi = _ld16(x_ptrs + kk * 64 + 32, ok & tok_ok & (k0 + 32 < K))
    if UNPREDICATED:
        kk = tl.minimum(kk, k_last - 1)
    gate = _weights(w_ptrs + kk * 128, s_ptrs + kk * 32, ok, UNPREDICATED)
    up = gate
    if GATED:  # the up rows: up_blocks further, same lanes, same activations
        up = _weights(w_ptrs + up_w + kk * 128, s_ptrs + up_s + kk * 32, ok, UNPREDICATED)
    a = (a_lo[0], a_lo[1], a_lo[2], a_lo[3], a_hi[0], a_hi[1], a_hi[2], a_hi[3])
    return a, gate, up


@triton.jit
def _mma(acc, a, w, SCALES: tl.constexpr):
    """``acc`` (4 floats per lane) plus the step's four MMAs on weights ``w`` (`_weights`), activations ``a``."""
    args = [w[0], w[1], w[2], w[3], w[4], a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], acc[0], acc[1], acc[2],
            acc[3]]
    if SCALES == _NVFP4:
        out = tl.inline_asm_elementwise(MMA_STEP_PTX, _MMA_STEP_CONSTRAINTS, args,
                                        dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        out = tl.inline_asm_elementwise(MMA_STEP_PTX_E8M0, _MMA_STEP_CONSTRAINTS, args,
                                        dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    return out


@triton.jit
def _step(acc, up, loaded, GATED: tl.constexpr, SCALES: tl.constexpr):
    a, w_gate, w_up = loaded
    acc = _mma(acc, a, w_gate, SCALES)
    if GATED:
        up = _mma(up, a, w_up, SCALES)
    return acc, up


@triton.jit
def _store(acc, acc_up, row, tok, ok, count, start, expert, sorted_ptr, bias_ptr, out_ptr, part_ptr, split, N,
           stride_be, stride_om, stride_ps, stride_pm, alpha, beta, limit,
           GROUPED: tl.constexpr, GATED: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr,
           FUSED: tl.constexpr):
    """One accumulator element per thread: (weight row ``row``, the chunk's token ``tok``)."""
    ok = ok & (tok < count)
    if GROUPED:
        slot = tl.load(sorted_ptr + start + tok, mask=ok, other=0).to(tl.int64)
    else:
        slot = (start + tok * 0).to(tl.int64)
    if FUSED:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + expert * stride_be + row, mask=ok, other=0.0)
            if GATED:
                acc_up += tl.load(bias_ptr + expert * stride_be + N + row, mask=ok, other=0.0)
        acc = _activate(acc, acc_up, ACTIVATION, alpha, beta, limit)
        tl.store(out_ptr + slot * stride_om + row, acc.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        p_ptrs = part_ptr + split * stride_ps + slot * stride_pm + row
        tl.store(p_ptrs, acc, mask=ok)
        if GATED:
            tl.store(p_ptrs + N, acc_up, mask=ok)


@triton.jit
def mma_program(a_ptr, fw_ptr, fs_ptr, wg_ptr, bias_ptr, out_ptr, part_ptr, sorted_ptr, expert, start, count,
                N, K, stride_am, stride_fe, stride_fse, k_blocks, up_blocks, stride_be, stride_om, stride_ps,
                stride_pm, alpha, beta, limit,
                GROUPED: tl.constexpr, A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, ACTIVATION: tl.constexpr,
                HAS_BIAS: tl.constexpr, FUSED: tl.constexpr, SPLITS: tl.constexpr, SCALES: tl.constexpr,
                ASM_UNBIAS: tl.constexpr, BLOCK_N: tl.constexpr, UNROLL: tl.constexpr, UNPREDICATED: tl.constexpr):
    """Program (N tile x K split, expert group) of an MMA tile: ``BLOCK_N`` weight rows (16 per warp) of
    ``expert`` over K blocks of 64, applied to the group's ``count`` slots 8 at a time (``UNPREDICATED``:
    `DecodeTile.unpredicated`)."""
    idx = tl.arange(0, 2 * BLOCK_N)
    lane = idx % 32
    g = lane // 4
    t = lane % 4
    split = tl.program_id(0) % SPLITS
    block = (tl.program_id(0) // SPLITS) * (BLOCK_N // 16) + idx // 32
    row = block * 16 + g  # lane 4g + t's rows: row, row + 8
    block = tl.minimum(block, cdiv_(N, 16) - 1)  # a tail warp re-reads the last block; never stored
    per_split = cdiv_(k_blocks, SPLITS)
    k_first = tl.minimum(split * per_split, k_blocks)
    k_last = tl.minimum(k_first + per_split, k_blocks)
    w_ptrs = fw_ptr + expert * stride_fe + (block * k_blocks * 32 + lane) * 4
    s_ptrs = fs_ptr + expert * stride_fse + block * k_blocks * 32 + lane
    up_w = up_blocks * k_blocks * 128
    up_s = up_blocks * k_blocks * 32
    global_scale = 1.0
    if SCALES == _NVFP4:  # the rest of the PTX's bias rides on the expert's global scale
        global_scale = tl.load(wg_ptr + expert) * ASM_UNBIAS
    for m0 in range(0, count, MMA_TOKENS):
        tok = m0 + g  # B's column: lane 4g + t reads token g
        tok_ok = tok < count
        if GROUPED:
            slot = tl.load(sorted_ptr + start + tok, mask=tok_ok, other=0)
        else:
            slot = start + tok * 0
        x_ptrs = a_ptr + (slot // A_ROW_DIV).to(tl.int64) * stride_am + t * 8
        zero = tl.full([2 * BLOCK_N], 0, tl.float32)
        acc, up = (zero, zero, zero, zero), (zero, zero, zero, zero)
        # UNROLL steps' loads first, then their MMAs: that many steps of bytes in flight per warp
        for kk in range(k_first, k_last, UNROLL):
            first = _loads(kk, idx >= 0, k_last, x_ptrs, tok_ok, t, K, w_ptrs, s_ptrs, up_w, up_s, GATED,
                           UNPREDICATED)
            if UNROLL >= 2:
                second = _loads(kk + 1, idx * 0 + kk + 1 < k_last, k_last, x_ptrs, tok_ok, t, K, w_ptrs, s_ptrs,
                                up_w, up_s, GATED, UNPREDICATED)
            if UNROLL == 4:
                third = _loads(kk + 2, idx * 0 + kk + 2 < k_last, k_last, x_ptrs, tok_ok, t, K, w_ptrs, s_ptrs,
                               up_w, up_s, GATED, UNPREDICATED)
                fourth = _loads(kk + 3, idx * 0 + kk + 3 < k_last, k_last, x_ptrs, tok_ok, t, K, w_ptrs, s_ptrs,
                                up_w, up_s, GATED, UNPREDICATED)
            acc, up = _step(acc, up, first, GATED, SCALES)
            if UNROLL >= 2:
                acc, up = _step(acc, up, second, GATED, SCALES)
            if UNROLL == 4:
                acc, up = _step(acc, up, third, GATED, SCALES)
                acc, up = _step(acc, up, fourth, GATED, SCALES)
        acc0, acc1, acc2, acc3 = acc
        up0, up1, up2, up3 = up
        # lane 4g + t holds rows (g, g + 8) x tokens (2t, 2t + 1): acc0 (g, 2t), acc1 (g, 2t + 1), acc2, acc3 (g + 8)
        _store(acc0 * global_scale, up0 * global_scale, row, m0 + 2 * t, row < N, count, start, expert, sorted_ptr,
               bias_ptr, out_ptr, part_ptr, split, N, stride_be, stride_om, stride_ps, stride_pm, alpha, beta, limit,
               GROUPED, GATED, ACTIVATION, HAS_BIAS, FUSED)
        _store(acc1 * global_scale, up1 * global_scale, row, m0 + 2 * t + 1, row < N, count, start, expert,
               sorted_ptr, bias_ptr, out_ptr, part_ptr, split, N, stride_be, stride_om, stride_ps, stride_pm, alpha,
               beta, limit, GROUPED, GATED, ACTIVATION, HAS_BIAS, FUSED)
        _store(acc2 * global_scale, up2 * global_scale, row + 8, m0 + 2 * t, row + 8 < N, count, start, expert,
               sorted_ptr, bias_ptr, out_ptr, part_ptr, split, N, stride_be, stride_om, stride_ps, stride_pm, alpha,
               beta, limit, GROUPED, GATED, ACTIVATION, HAS_BIAS, FUSED)
        _store(acc3 * global_scale, up3 * global_scale, row + 8, m0 + 2 * t + 1, row + 8 < N, count, start, expert,
               sorted_ptr, bias_ptr, out_ptr, part_ptr, split, N, stride_be, stride_om, stride_ps, stride_pm, alpha,
               beta, limit, GROUPED, GATED, ACTIVATION, HAS_BIAS, FUSED)
