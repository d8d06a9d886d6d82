"""Gluon code of the fp8 128-block grouped GEMM with a pipelined wgmma (see gemm_wgmma.py for the contract).

Why Gluon: in plain Triton each K step of a 128-block GEMM ends in ``acc += dot(a, w) * scale``, and the
compiler waits for that step's wgmma before the next one is issued (it keeps a wgmma in flight only when
its result feeds the next dot's accumulator), so the tensor cores idle while the scales are applied.
Here each step's product goes to a fresh register tile ``t`` and is scaled into ``acc`` one step later,
after the next step's wgmma has been issued (``warpgroup_mma_wait(num_outstanding=1)``): the scaling of
step k-1 overlaps the wgmma of step k.

One program computes one (m block, n block) tile of a `BlockLayout`'s sorted rows. A (the rows in
sorted order, e4m3) and W (``[E * R, K]`` e4m3) arrive by TMA into a ring of ``STAGES`` shared-memory
buffers, ``STAGES - 2`` steps ahead: the buffer a load overwrites was read by the wgmma two steps
back, which the last wait has retired. A K step is one 128-column scale group (BLOCK_K = 128).
Gated GEMMs load the gate rows ``n0..n0+BN`` and the up rows ``N+n0..`` into one ``[2BN, 128]`` buffer,
so one wgmma of width 2BN computes both halves; the column's half picks its weight scale.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

# @triton.jit functions, which Gluon kernels may call
from moe.experts._triton._gemm import _activate, _store_sorted_block, _tile_coords

# Gluon is experimental: Triton 3.6 (what the GPU machine runs) names the TMA load
# async_copy_global_to_shared, later versions async_load (and make the old name raise)
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
# the barrier of a CTA's threads (in a warp-specialized partition, of the partition's): thread_barrier in 3.6, later
# barrier
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@gluon.constexpr_function
def _warps_per_cta(block_m, num_warps):
    """Warpgroups along M while BLOCK_M has 64 rows for each, then along N."""
    along_m = min(num_warps, block_m // 16)
    return [along_m, num_warps // along_m]


@gluon.constexpr_function
def _epilogue_layout(block_n, num_warps):
    """A blocked layout of ``[BLOCK_M, block_n]`` with 8 contiguous columns per thread."""
    threads_n = min(32, block_n // 8)
    return gl.BlockedLayout([1, 8], [32 // threads_n, threads_n], [num_warps, 1], [1, 0])


@gluon.constexpr_function
def _experts_layout(e_pad, num_warps):
    """A layout of ``[E_PAD]`` that every warp holds whole (replicated), so that a reduction over the experts
    stays within a warp: no shared memory, no barrier."""
    return gl.BlockedLayout([max(1, e_pad // 32)], [32], [num_warps], [0])


@gluon.jit
def _expert_segments(ends_ptr, counts_ptr, num_experts, E_PAD: gl.constexpr, num_warps: gl.constexpr):
    """The experts' padded segment ends and slot counts, loaded once, every warp holding them all: (experts,
    is_expert, ends, counts)."""
    experts = gl.arange(0, E_PAD, layout=_experts_layout(E_PAD, num_warps))
    is_expert = experts < num_experts
    ends = gl.load(ends_ptr + experts, mask=is_expert, other=0)
    counts = gl.load(counts_ptr + experts, mask=is_expert, other=0)
    return experts, is_expert, ends, counts


@gluon.jit
def _segment_of(pid_m, segments, BLOCK_M: gl.constexpr):
    """(expert, rows holding a slot) of sorted block ``pid_m`` from `_expert_segments`; expert == num_experts
    past the last segment. The twin of _gemm._block_segment, which a Gluon kernel cannot call: its
    ``tl.arange`` over the experts has no layout, and Gluon needs one."""
    experts, is_expert, ends, counts = segments
    first = pid_m * BLOCK_M
    expert = gl.sum(((ends <= first) & is_expert).to(gl.int32), 0)
    count = gl.sum(gl.where(experts == expert, counts, 0), 0)
    end = gl.sum(gl.where(experts == expert, ends, 0), 0)
    segment_start = end - (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    return expert, count - (first - segment_start)


@gluon.jit
def _block_segment(pid_m, ends_ptr, counts_ptr, num_experts, E_PAD: gl.constexpr, BLOCK_M: gl.constexpr,
                   num_warps: gl.constexpr):
    """`_segment_of` one block, the segments loaded for it."""
    return _segment_of(pid_m, _expert_segments(ends_ptr, counts_ptr, num_experts, E_PAD, num_warps), BLOCK_M)


@gluon.jit
def _issue_load(step, n_steps, a_desc, w_desc, m0, w_row, N, ready, a_bufs, w_bufs,
                GATED: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """TMA loads of K step ``step`` (none past the last) into buffer ``step % STAGES``."""
    index = step % STAGES
    pred = step < n_steps
    bar = ready.index(index)
    k = step * 128
    w_buf = w_bufs.index(index)
    if GATED:
        mbarrier.expect(bar, a_desc.block_type.nbytes + 2 * w_desc.block_type.nbytes, pred=pred)
        _tma_load(a_desc, [m0, k], bar, a_bufs.index(index), pred)
        _tma_load(w_desc, [w_row, k], bar, w_buf.slice(0, BLOCK_N), pred)
        _tma_load(w_desc, [w_row + N, k], bar, w_buf.slice(BLOCK_N, BLOCK_N), pred)
    else:
        mbarrier.expect(bar, a_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=pred)
        _tma_load(a_desc, [m0, k], bar, a_bufs.index(index), pred)
        _tma_load(w_desc, [w_row, k], bar, w_buf, pred)


@gluon.jit
def _mma_step(step, ring_step, n_steps, a_desc, w_desc, m0, w_row, N, scales, ready, a_bufs, w_bufs,
              GATED: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, WIDTH: gl.constexpr,
              STAGES: gl.constexpr, LOADS: gl.constexpr, mma: gl.constexpr):
    """K step ``step`` of a tile, buffer ``ring_step % STAGES`` of the ring: with ``LOADS`` (the wgmma
    kernel, which loads its own tiles) first the loads ``STAGES - 2`` steps ahead, then this step's wgmma
    into a fresh tile. Returns the tile in flight (to pass through a `warpgroup_mma_wait`) and the row
    scales of its two column halves. The buffer a load overwrites was read ``STAGES - 2`` steps back or
    earlier: retired, as every wait leaves at most one wgmma in flight."""
    if LOADS:
        _issue_load(step + STAGES - 2, n_steps, a_desc, w_desc, m0, w_row, N, ready, a_bufs, w_bufs,
                    GATED, BLOCK_N, STAGES)
    scale_rows, stride_asg, lo_ptr, hi_ptr, hi_ok, stride_wsk = scales
    a_s = gl.load(scale_rows + step * stride_asg)
    s_lo = gl.load(lo_ptr + step * stride_wsk)
    s_hi = gl.load(hi_ptr + step * stride_wsk, mask=hi_ok, other=0.0)
    index = ring_step % STAGES
    mbarrier.wait(ready.index(index), (ring_step // STAGES) & 1)
    a_buf = a_bufs.index(index)
    w_buf = w_bufs.index(index)
    t = warpgroup_mma(a_buf, w_buf.permute((1, 0)), gl.zeros([BLOCK_M, WIDTH], gl.float32, layout=mma),
                      use_acc=False, is_async=True)
    return t, a_s * s_lo, a_s * s_hi


@gluon.jit
def _promote(acc, t, lo, hi, first_half):
    """``acc + t * scale``: the row scale of the column's half times the tile."""
    return acc + t * gl.where(first_half, gl.expand_dims(lo, 1), gl.expand_dims(hi, 1))


@gluon.jit
def _retired(empty, ring_step, STAGES: gl.constexpr, RELEASE: gl.constexpr):
    """With ``RELEASE`` (a warp-specialized consumer), hands buffer ``ring_step % STAGES``, whose wgmma has
    retired, back to the loader partition."""
    if RELEASE:
        mbarrier.arrive(empty.index(ring_step % STAGES), count=1)


@gluon.jit
def _tile_scales(a_scale_ptr, w_scale_ptr, expert, m0, n0, N, w_rows, stride_asg, stride_wse, stride_wsn, stride_wsk,
                 GATED: gl.constexpr, BLOCK_M: gl.constexpr, rows_l: gl.constexpr):
    """Where a tile's K steps read their scales: its rows' (``[groups, rows]``, group stride ``stride_asg``) and
    the weight scales of its two column halves, gate/up rows (gated) or the two 128-row blocks of a 256-wide
    tile (the second past the weights' rows when the tile is narrower: ``hi_ok`` false)."""
    ws_base = w_scale_ptr + expert.to(gl.int64) * stride_wse
    if GATED:
        block_hi = (N + n0) // 128
    else:
        block_hi = n0 // 128 + 1
    scale_rows = a_scale_ptr + m0 + gl.arange(0, BLOCK_M, layout=rows_l)
    return (scale_rows, stride_asg, ws_base + (n0 // 128) * stride_wsn, ws_base + block_hi * stride_wsn,
            block_hi * 128 < w_rows, stride_wsk)


@gluon.jit
def _fp8_tile(ring0, n_steps, a_desc, w_desc, m0, w_row, N, scales, ready, empty, a_bufs, w_bufs, first_half,
              GATED: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, WIDTH: gl.constexpr,
              STAGES: gl.constexpr, WS: gl.constexpr, mma: gl.constexpr, rows_l: gl.constexpr):
    """The float32 accumulator of one tile: ``n_steps`` K steps, the first in buffer ``ring0 % STAGES``.
    ``WS``: a warp-specialized consumer (its loads come from a loader partition; each buffer goes back
    on ``empty`` once its wgmma retires), else this program issues its own loads.

    Steps go in pairs: the even step's tile is scaled in while the odd step's wgmma runs, the odd one
    while the next pair's even wgmma runs. Only retired tiles cross the loop's back edge: a tile whose
    wgmma is in flight would be copied there, and ptxas then serializes every wgmma of the kernel."""
    acc = gl.zeros([BLOCK_M, WIDTH], gl.float32, layout=mma)
    t_odd = gl.zeros([BLOCK_M, WIDTH], gl.float32, layout=mma)
    lo_odd = gl.zeros([BLOCK_M], gl.float32, layout=rows_l)  # row scales of the odd tile's halves
    hi_odd = lo_odd
    LOADS: gl.constexpr = not WS
    for pair in range(n_steps // 2):
        even = 2 * pair
        t_even, lo_even, hi_even = _mma_step(even, ring0 + even, n_steps, a_desc, w_desc, m0, w_row, N, scales,
                                             ready, a_bufs, w_bufs, GATED, BLOCK_M, BLOCK_N, WIDTH, STAGES, LOADS,
                                             mma)
        acc = _promote(acc, t_odd, lo_odd, hi_odd, first_half)
        t_next, lo_odd, hi_odd = _mma_step(even + 1, ring0 + even + 1, n_steps, a_desc, w_desc, m0, w_row, N,
                                           scales, ready, a_bufs, w_bufs, GATED, BLOCK_M, BLOCK_N, WIDTH, STAGES,
                                           LOADS, mma)
        t_even = warpgroup_mma_wait(num_outstanding=1, deps=(t_even, ))
        _retired(empty, ring0 + even, STAGES, WS)
        acc = _promote(acc, t_even, lo_even, hi_even, first_half)
        t_odd = warpgroup_mma_wait(num_outstanding=0, deps=(t_next, ))
        _retired(empty, ring0 + even + 1, STAGES, WS)
    acc = _promote(acc, t_odd, lo_odd, hi_odd, first_half)
    if n_steps % 2:
        t_even, lo_even, hi_even = _mma_step(n_steps - 1, ring0 + n_steps - 1, n_steps, a_desc, w_desc, m0, w_row,
                                             N, scales, ready, a_bufs, w_bufs, GATED, BLOCK_M, BLOCK_N, WIDTH,
                                             STAGES, LOADS, mma)
        t_even = warpgroup_mma_wait(num_outstanding=0, deps=(t_even, ))
        _retired(empty, ring0 + n_steps - 1, STAGES, WS)
        acc = _promote(acc, t_even, lo_even, hi_even, first_half)
    return acc


@gluon.jit
def _activated(out, up, layout: gl.constexpr, expert, n0, bias_ptr, N, stride_be, stride_bn, alpha, beta, limit,
               GATED: gl.constexpr, ACTIVATION: gl.constexpr, HAS_BIAS: gl.constexpr, BLOCK_N: gl.constexpr):
    """``out`` (the gate half when ``GATED``) and ``up`` in ``layout`` (an ungated tile passes ``out`` again,
    unread), the expert's biases added, the activation applied (gated or not: relu2 too; ACTIVATION 0 leaves
    ``out`` as it is): the tile an epilogue stores, float32."""
    offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    cols = offs_n % N  # the tail's extra columns read valid biases; they are never stored
    b_base = bias_ptr + expert.to(gl.int64) * stride_be
    if HAS_BIAS:
        out += gl.expand_dims(gl.load(b_base + cols * stride_bn).to(gl.float32), 0)
    if GATED and HAS_BIAS:
        up += gl.expand_dims(gl.load(b_base + (cols + N) * stride_bn).to(gl.float32), 0)
    return _activate(out, up, ACTIVATION, alpha, beta, limit)  # an ungated one (relu2) reads the first only


@gluon.jit
def _epilogue(out, up, layout: gl.constexpr, expert, m0, n0, valid, bias_ptr, out_ptr, rows_ptr, N, stride_be,
              stride_bn, stride_om, stride_on, alpha, beta, limit, GATED: gl.constexpr, ACTIVATION: gl.constexpr,
              HAS_BIAS: gl.constexpr, OUT_SORTED: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """The Gluon kernels' tile epilogue: `_activated`, then the rows stored (`_store_sorted_block`)."""
    out = _activated(out, up, layout, expert, n0, bias_ptr, N, stride_be, stride_bn, alpha, beta, limit, GATED,
                     ACTIVATION, HAS_BIAS, BLOCK_N)
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    _store_sorted_block(out_ptr, out, offs_m, offs_n, N, m0, valid, rows_ptr, stride_om, stride_on, OUT_SORTED,
                        BLOCK_M)


@gluon.constexpr_function
def _fp8_mma_layout(block_m, width, num_warps):
    """The accumulator layout of a ``[block_m, width]`` fp8 wgmma (K 32 per instruction)."""
    warps = _warps_per_cta(block_m, num_warps)
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=warps, instr_shape=[16, width // warps[1], 32])


# the token-dependent counts are not specialized on, so one compiled kernel serves every M
@gluon.jit(do_not_specialize=["num_m_blocks", "num_experts", "stride_asg"])
def moe_gemm_fp8_wgmma_kernel(
    a_desc, w_desc, a_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, rows_ptr, ends_ptr, counts_ptr,
    num_m_blocks, num_experts, N, K, w_rows, stride_asg,
    stride_wse, stride_wsn, stride_wsk, stride_be, stride_bn, stride_om, stride_on,
    alpha, beta, limit,
    GATED: gl.constexpr, ACTIVATION: gl.constexpr, HAS_BIAS: gl.constexpr, OUT_SORTED: gl.constexpr,
    E_PAD: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    """``out = act(dequant(a_sorted) @ dequant(w[expert]).T + bias[expert])`` by (m block, n block) tiles:
    ``a_desc`` the sorted e4m3 rows ``[rows, K]`` (block ``[BLOCK_M, 128]``), ``a_scale_ptr`` their scales
    as ``[groups, rows]`` (group stride ``stride_asg``), ``w_desc`` the e4m3 weights as ``[E * R, K]``
    (block ``[BLOCK_N, 128]``), ``w_scale_ptr`` the weights' ``[E, R / 128, groups]`` block scales."""
    WIDTH: gl.constexpr = 2 * BLOCK_N if GATED else BLOCK_N  # columns of one wgmma
    HALF: gl.constexpr = BLOCK_N if GATED else (128 if BLOCK_N > 128 else BLOCK_N)  # columns per weight scale
    pid_m, pid_n = _tile_coords(num_m_blocks, N, BLOCK_N, GROUP_M)
    expert, valid = _block_segment(pid_m, ends_ptr, counts_ptr, num_experts, E_PAD, BLOCK_M, num_warps)
    if expert >= num_experts:  # past the last segment
        return
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    w_row = expert * w_rows + n0
    n_steps = (K + 127) // 128

    mma: gl.constexpr = _fp8_mma_layout(BLOCK_M, WIDTH, num_warps)
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    cols_l: gl.constexpr = gl.SliceLayout(0, mma)
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, 128], a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, WIDTH, 128], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    for i in gl.static_range(STAGES - 2):
        _issue_load(i, n_steps, a_desc, w_desc, m0, w_row, N, ready, a_bufs, w_bufs, GATED, BLOCK_N, STAGES)

    scales = _tile_scales(a_scale_ptr, w_scale_ptr, expert, m0, n0, N, w_rows, stride_asg, stride_wse, stride_wsn,
                          stride_wsk, GATED, BLOCK_M, rows_l)
    first_half = gl.expand_dims(gl.arange(0, WIDTH, layout=cols_l) < HALF, 0)
    acc = _fp8_tile(0, n_steps, a_desc, w_desc, m0, w_row, N, scales, ready, ready, a_bufs, w_bufs, first_half,
                    GATED, BLOCK_M, BLOCK_N, WIDTH, STAGES, False, mma, rows_l)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))

    out_l: gl.constexpr = _epilogue_layout(BLOCK_N, num_warps)
    if GATED:  # the halves meet in shared memory, in the store's layout
        stage = gl.allocate_shared_memory(gl.float32, [BLOCK_M, WIDTH],
                                          gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
        stage.store(acc)
        gate = stage.slice(0, BLOCK_N, dim=1).load(out_l)
        up = stage.slice(BLOCK_N, BLOCK_N, dim=1).load(out_l)
    else:
        gate = gl.convert_layout(acc, out_l)
        up = gate
    _epilogue(gate, up, out_l, expert, m0, n0, valid, bias_ptr, out_ptr, rows_ptr, N, stride_be, stride_bn, stride_om,
              stride_on, alpha, beta, limit, GATED, ACTIVATION, HAS_BIAS, OUT_SORTED, BLOCK_M, BLOCK_N)
