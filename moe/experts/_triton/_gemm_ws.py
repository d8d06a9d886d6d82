"""Gluon code of the grouped GEMMs that are warp-specialized and persistent (``TileConfig.ws``; SM90): dense
bf16/fp16 (`moe_gemm_ws_kernel`) and fp8 128-block (`moe_gemm_fp8_ws_kernel`, ``wgmma`` and ``ws`` tiles).

The data flow is the TMA-A path's (gemm_tma_a.py): A is the layout's rows gathered into sorted order,
W is ``[E * R, K]``, both loaded by TMA descriptor. What differs is how the tensor cores are kept fed:

- **Persistent.** The grid is one program per SM (at most; two for one-warpgroup fp8 tiles whose rings fit,
  `gemm_ws.fp8_programs_per_sm`); program p takes the tiles p, p + grid, ...
  of the (m block, n block) order, ``GROUP_M`` m blocks at a time, up to the blocks the layout uses
  (read from ``ends_ptr`` on the GPU, so one grid serves every M and CUDA graphs replay it).
  The experts' segment ends and counts are loaded once per program, in a layout every warp holds whole,
  so finding a tile's expert is a reduction within each warp: no loads, shared memory or barrier between
  one tile's epilogue and the next tile's first wgmma.
- **Warp-specialized.** A one-warp loader partition walks the same tiles and issues every TMA load into
  a ring of ``STAGES`` shared-memory buffers, each guarded by a "ready" and an "empty" mbarrier (``GATHER``: four
  warps, which copy A's rows from the unsorted activations by cp.async). The
  default partition (``num_warps`` warps, 64 rows per warpgroup) waits for a buffer, issues its
  wgmma, retires the previous step's wgmma and hands that step's buffer back. So the loads of the next
  K steps, and of the next tile, run while the wgmmas and the epilogue of this one do.
- **Gated GEMMs** issue two wgmmas per K step, gate rows ``n0..`` and up rows ``N + n0..`` of one
  ``[2 * BLOCK_N, BLOCK_K]`` buffer into two accumulators of one layout, so the activation pairs them
  in registers (no shared-memory staging, which would compete with the ring).
- **The epilogue** adds the bias, applies the activation and stores from the accumulator's layout:
  every row of the block (``OUT_SORTED``, the intermediate) or the rows holding a slot, at their slot.
  With ``TMA_STORE`` (a sorted output) it writes the tile into a staging buffer beside the ring instead and
  sends it out by one TMA store, which runs on while the consumer starts the next tile's K steps; before
  writing the buffer again it waits only until the previous store has read it. Session 31 measured the
  register stores, with nothing beside them, at up to half of a short-K GEMM2's time
  (benchmarks/results/bf16_ws_nvidia-h200.md).
- **fp8 128-block** runs the same loader (BLOCK_K = 128, one scale group per K step) and the same tile
  walk; its consumer is the wgmma kernel's K loop (`_gemm_wgmma._fp8_tile`: each step's product goes
  to a fresh register tile, scaled into the accumulator while the next step's wgmma runs), handing each
  buffer back as its wgmma retires. Gated tiles keep the wgmma kernel's one ``[2 * BLOCK_N, 128]`` wgmma
  (one A read from shared memory for both halves); the halves are split in registers, where each thread
  already holds a gate column and its up column, so no shared-memory staging competes with the ring.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                             warpgroup_mma_wait)

# @triton.jit functions, which Gluon kernels may call
from moe.experts._triton._gemm import _tile_of
from moe.experts._triton._gemm_wgmma import (_activated, _barrier, _epilogue, _expert_segments, _fp8_mma_layout,
                                             _fp8_tile, _segment_of, _tile_scales, _tma_load, _tma_store,
                                             _warps_per_cta)

_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared  # Triton 3.9 / 3.6
GATHER_WARPS: gl.constexpr = gl.constexpr(4)  # the gathering loader's warps (`_load_partition`)


@gluon.jit
def _tile_count(ends_ptr, num_experts, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """(m blocks the layout uses, n blocks, tiles): the last expert's padded end gives the blocks."""
    num_m = gl.load(ends_ptr + num_experts - 1) // BLOCK_M
    num_n = gl.cdiv(N, BLOCK_N)
    return num_m, num_n, num_m * num_n


@gluon.jit
def _ring(a_desc, w_desc, GATED: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
          STAGES: gl.constexpr, GATHER: gl.constexpr = False):
    """The ring both partitions share: ``STAGES`` A and W buffers (gated: gate and up rows, ``2 * BLOCK_N``)
    and their "ready" (loads landed) and "empty" (wgmma retired) mbarriers. ``GATHER``: each of the gathering
    loader's threads arrives on "ready" too, once its copies of the step's A rows have landed."""
    WIDTH: gl.constexpr = 2 * BLOCK_N if GATED else BLOCK_N  # weight rows per K step
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, WIDTH, BLOCK_K], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1 + 32 * GATHER_WARPS if GATHER else 1)
        mbarrier.init(empty.index(i), count=1)
    return a_bufs, w_bufs, ready, empty


@gluon.jit
def _store_staged(out, out_buf, out_desc, m0, n0):
    """A tile out by TMA: written into ``out_buf`` once the previous tile's store has read it, then one TMA store
    that runs on while the consumer goes to the next tile (the kernel waits for the last before it exits)."""
    tma.store_wait(0)
    _barrier()
    out_buf.store(out.to(out_buf.dtype))
    fence_async_shared()
    _barrier()
    _tma_store(out_desc, [m0, n0], out_buf)


@gluon.jit
def _staging_buffer(out_desc, a_bufs, TMA_STORE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """The shared-memory tile a ``TMA_STORE`` epilogue stages its output in, beside the ring; else ``a_bufs``
    stands in, never written."""
    if TMA_STORE:
        out_buf = gl.allocate_shared_memory(out_desc.dtype, [BLOCK_M, BLOCK_N], out_desc.layout)
    else:
        out_buf = a_bufs
    return out_buf


@gluon.jit
def _tile_out(out, up, layout: gl.constexpr, out_desc, out_buf, expert, m0, n0, valid, bias_ptr, out_ptr, rows_ptr,
              N, stride_be, stride_bn, stride_om, stride_on, alpha, beta, limit, GATED: gl.constexpr,
              ACTIVATION: gl.constexpr, HAS_BIAS: gl.constexpr, OUT_SORTED: gl.constexpr, TMA_STORE: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Both ws kernels' epilogue: with ``TMA_STORE`` the activated tile leaves by one TMA store
    (`_store_staged`), which runs on under the next tile's K steps; else `_epilogue`'s register stores."""
    if TMA_STORE:
        _store_staged(_activated(out, up, layout, expert, n0, bias_ptr, N, stride_be, stride_bn, alpha, beta, limit,
                                 GATED, ACTIVATION, HAS_BIAS, BLOCK_N), out_buf, out_desc, m0, n0)
    else:
        _epilogue(out, up, layout, expert, m0, n0, valid, bias_ptr, out_ptr, rows_ptr, N, stride_be, stride_bn,
                  stride_om, stride_on, alpha, beta, limit, GATED, ACTIVATION, HAS_BIAS, OUT_SORTED, BLOCK_M, BLOCK_N)


@gluon.jit
def _load_partition(a_desc, w_desc, x_ptr, stride_xm, a_bufs, w_bufs, ready, empty, rows_ptr, ends_ptr, counts_ptr,
                    num_experts, N, K, w_rows, GATHER: gl.constexpr, A_ROW_DIV: gl.constexpr, GATED: gl.constexpr,
                    E_PAD: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                    GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    """One warp: the TMA loads of every K step of every tile of this program, in order, into the ring.

    ``GATHER`` (four warps): the A rows are not gathered first. The loader copies each step's rows straight from
    ``x_ptr`` (row ``slot // A_ROW_DIV`` for each of the block's slots; ``rows_ptr`` the sorted slots) with
    ``cp.async``, 16 bytes a copy, into the ring's swizzled buffer, and each thread arrives on the step's "ready"
    barrier once its copies have landed (``cp.async.mbarrier.arrive.noinc``: the barrier counts the 128 threads and
    the TMA's arrival); the weights still come by TMA. The consumer fences before its wgmma reads what cp.async
    wrote. Padding rows copy row 0 (finite values, never stored). K is a multiple of BLOCK_K and rows are 16-byte
    multiples apart (`gemm_ws.ws_gemm_launch` checks both)."""
    WARPS: gl.constexpr = GATHER_WARPS if GATHER else 1
    num_m, num_n, num_tiles = _tile_count(ends_ptr, num_experts, N, BLOCK_M, BLOCK_N)
    n_steps = gl.cdiv(K, BLOCK_K)
    W_BYTES: gl.constexpr = (2 if GATED else 1) * w_desc.block_type.nbytes
    NBYTES: gl.constexpr = W_BYTES if GATHER else a_desc.block_type.nbytes + W_BYTES  # the step's TMA bytes
    segments = _expert_segments(ends_ptr, counts_ptr, num_experts, E_PAD, WARPS)
    if GATHER:
        gl.static_assert(BLOCK_K % 8 == 0, "16-byte copies of 8 columns")
        TPW_K: gl.constexpr = BLOCK_K // 8 if BLOCK_K // 8 < 32 else 32
        rows_l: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW_K, TPW_K], [GATHER_WARPS, 1], [1, 0])
        offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, rows_l))
        offs_k = gl.expand_dims(gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, rows_l)), 0)
    it = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        pid_m, pid_n = _tile_of(t, num_m, num_n, GROUP_M)
        expert, valid = _segment_of(pid_m, segments, BLOCK_M)
        m0 = pid_m * BLOCK_M
        w_row = expert * w_rows + pid_n * BLOCK_N
        if GATHER:
            slots = gl.load(rows_ptr + m0 + offs_m, mask=offs_m < valid, other=0)
            # rows are 16-byte multiples apart (the launch checks): each thread's 8 columns are one 16-byte copy
            row_ptrs = gl.expand_dims(x_ptr + gl.multiple_of((slots // A_ROW_DIV).to(gl.int64) * stride_xm, 8), 1)
        for step in range(n_steps):
            index = it % STAGES
            # a fresh mbarrier counts as having completed the phase before phase 0: the first lap passes
            mbarrier.wait(empty.index(index), ((it // STAGES) & 1) ^ 1)
            bar = ready.index(index)
            k = step * BLOCK_K
            if GATHER:
                _async_load(a_bufs.index(index), row_ptrs + (k + offs_k))  # K is a multiple of BLOCK_K
                # counted in the barrier's init (noinc): the phase cannot complete before every thread's copies land
                async_copy.mbarrier_arrive(bar, increment_count=False)
            mbarrier.expect(bar, NBYTES)
            if not GATHER:
                _tma_load(a_desc, [m0, k], bar, a_bufs.index(index))
            w_buf = w_bufs.index(index)
            if GATED:
                _tma_load(w_desc, [w_row, k], bar, w_buf.slice(0, BLOCK_N))
                _tma_load(w_desc, [w_row + N, k], bar, w_buf.slice(BLOCK_N, BLOCK_N))
            else:
                _tma_load(w_desc, [w_row, k], bar, w_buf)
            it += 1


@gluon.jit
def _mma_partition(a_bufs, w_bufs, ready, empty, out_desc, out_buf, bias_ptr, out_ptr, rows_ptr, ends_ptr,
                   counts_ptr, num_experts, N, K, stride_be, stride_bn, stride_om, stride_on, alpha, beta, limit,
                   GATED: gl.constexpr, ACTIVATION: gl.constexpr, HAS_BIAS: gl.constexpr, OUT_SORTED: gl.constexpr,
                   TMA_STORE: gl.constexpr, E_PAD: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, GATHER: gl.constexpr,
                   num_warps: gl.constexpr):
    """The default partition: each tile's wgmmas as its buffers arrive, then its epilogue (``TMA_STORE``: staged in
    ``out_buf`` and sent out by ``out_desc``, a store that runs on under the next tile's K steps)."""
    warps: gl.constexpr = _warps_per_cta(BLOCK_M, num_warps)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=warps,
                                                  instr_shape=[16, BLOCK_N // warps[1], 16])
    num_m, num_n, num_tiles = _tile_count(ends_ptr, num_experts, N, BLOCK_M, BLOCK_N)
    n_steps = gl.cdiv(K, BLOCK_K)
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma)  # the gate half when GATED
    up = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma)
    segments = _expert_segments(ends_ptr, counts_ptr, num_experts, E_PAD, num_warps)
    it = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        pid_m, pid_n = _tile_of(t, num_m, num_n, GROUP_M)
        expert, valid = _segment_of(pid_m, segments, BLOCK_M)
        for step in range(n_steps):
            index = it % STAGES
            mbarrier.wait(ready.index(index), (it // STAGES) & 1)
            if GATHER:  # A was written by cp.async (the generic proxy); the wgmma reads it through the async one
                fence_async_shared()
            a_buf = a_bufs.index(index)
            w_buf = w_bufs.index(index)
            if GATED:
                acc = warpgroup_mma(a_buf, w_buf.slice(0, BLOCK_N).permute((1, 0)), acc, use_acc=step > 0,
                                    is_async=True)
                up = warpgroup_mma(a_buf, w_buf.slice(BLOCK_N, BLOCK_N).permute((1, 0)), up, use_acc=step > 0,
                                   is_async=True)
                acc, up = warpgroup_mma_wait(num_outstanding=2, deps=(acc, up))
            else:
                acc = warpgroup_mma(a_buf, w_buf.permute((1, 0)), acc, use_acc=step > 0, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            # the previous step's wgmmas have retired: its buffer goes back to the loader
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=step > 0)
            it += 1
        if GATED:
            acc, up = warpgroup_mma_wait(num_outstanding=0, deps=(acc, up))
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)

        _tile_out(acc, up, mma, out_desc, out_buf, expert, pid_m * BLOCK_M, pid_n * BLOCK_N, valid, bias_ptr, out_ptr,
                  rows_ptr, N, stride_be, stride_bn, stride_om, stride_on, alpha, beta, limit, GATED, ACTIVATION,
                  HAS_BIAS, OUT_SORTED, TMA_STORE, BLOCK_M, BLOCK_N)
    if TMA_STORE:
        tma.store_wait(0)


# the token-dependent counts are not specialized on, so one compiled kernel serves every M
@gluon.jit(do_not_specialize=["num_experts"])
def moe_gemm_ws_kernel(
    a_desc, w_desc, out_desc, x_ptr, bias_ptr, out_ptr, rows_ptr, ends_ptr, counts_ptr,
    num_experts, N, K, w_rows, stride_xm, stride_be, stride_bn, stride_om, stride_on,
    alpha, beta, limit,
    GATED: gl.constexpr, ACTIVATION: gl.constexpr, HAS_BIAS: gl.constexpr, OUT_SORTED: gl.constexpr,
    TMA_STORE: gl.constexpr, E_PAD: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    GROUP_M: gl.constexpr, STAGES: gl.constexpr, GATHER: gl.constexpr, A_ROW_DIV: gl.constexpr,
    LOADER_REGS: gl.constexpr, num_warps: gl.constexpr,
):
    """``out = act(a_sorted @ w[expert].T + bias[expert])`` over every (m block, n block) tile the layout
    uses: ``a_desc`` the sorted rows ``[rows, K]`` (block ``[BLOCK_M, BLOCK_K]``), ``w_desc`` the weights
    as ``[E * R, K]`` (block ``[BLOCK_N, BLOCK_K]``), bf16 or fp16; the module docstring says how. ``GATHER``:
    the sorted rows are not there; the loader copies row ``slot // A_ROW_DIV`` of ``x_ptr`` (rows ``stride_xm``
    apart) for each slot (`_load_partition`), and ``a_desc`` only gives the buffers' type and layout."""
    a_bufs, w_bufs, ready, empty = _ring(a_desc, w_desc, GATED, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GATHER)
    out_buf = _staging_buffer(out_desc, a_bufs, TMA_STORE, BLOCK_M, BLOCK_N)
    gl.warp_specialize([
        (_mma_partition, (a_bufs, w_bufs, ready, empty, out_desc, out_buf, bias_ptr, out_ptr, rows_ptr, ends_ptr,
                          counts_ptr, num_experts, N, K, stride_be, stride_bn, stride_om, stride_on, alpha, beta,
                          limit, GATED, ACTIVATION, HAS_BIAS, OUT_SORTED, TMA_STORE, E_PAD, BLOCK_M, BLOCK_N,
                          BLOCK_K, GROUP_M, STAGES, GATHER, num_warps)),
        (_load_partition, (a_desc, w_desc, x_ptr, stride_xm, a_bufs, w_bufs, ready, empty, rows_ptr, ends_ptr,
                           counts_ptr, num_experts, N, K, w_rows, GATHER, A_ROW_DIV, GATED, E_PAD, BLOCK_M, BLOCK_N,
                           BLOCK_K, GROUP_M, STAGES)),
    ], [GATHER_WARPS if GATHER else 1], [LOADER_REGS])


@gluon.jit
def _split_halves(acc, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, layout: gl.constexpr):
    """The gate columns ``[:, :BLOCK_N]`` and the up columns ``[:, BLOCK_N:]`` of a gated accumulator, each in
    ``layout`` (the ``BLOCK_N``-wide wgmma's): a thread holds both columns of a pair, so no data moves."""
    halves = gl.permute(gl.reshape(acc, [BLOCK_M, 2, BLOCK_N]), (0, 2, 1))
    gate, up = gl.split(halves)
    return gl.convert_layout(gate, layout), gl.convert_layout(up, layout)


@gluon.jit
def _fp8_mma_partition(a_bufs, w_bufs, ready, empty, out_desc, out_buf, a_scale_ptr, w_scale_ptr, bias_ptr, out_ptr,
                       rows_ptr, ends_ptr, counts_ptr, num_experts, N, K, w_rows, stride_asg, stride_wse, stride_wsn,
                       stride_wsk, stride_be, stride_bn, stride_om, stride_on, alpha, beta, limit,
                       GATED: gl.constexpr, ACTIVATION: gl.constexpr, HAS_BIAS: gl.constexpr,
                       OUT_SORTED: gl.constexpr, TMA_STORE: gl.constexpr, E_PAD: gl.constexpr, BLOCK_M: gl.constexpr,
                       BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    """The default partition of the fp8 kernel: each tile's scaled K steps as its buffers arrive, then its
    epilogue (``TMA_STORE``: as the dense kernel's)."""
    WIDTH: gl.constexpr = 2 * BLOCK_N if GATED else BLOCK_N  # columns of one wgmma
    HALF: gl.constexpr = BLOCK_N if GATED else (128 if BLOCK_N > 128 else BLOCK_N)  # columns per weight scale
    mma: gl.constexpr = _fp8_mma_layout(BLOCK_M, WIDTH, num_warps)
    out_l: gl.constexpr = _fp8_mma_layout(BLOCK_M, BLOCK_N, num_warps)  # one half's
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    first_half = gl.expand_dims(gl.arange(0, WIDTH, layout=gl.SliceLayout(0, mma)) < HALF, 0)
    num_m, num_n, num_tiles = _tile_count(ends_ptr, num_experts, N, BLOCK_M, BLOCK_N)
    n_steps = gl.cdiv(K, 128)
    segments = _expert_segments(ends_ptr, counts_ptr, num_experts, E_PAD, num_warps)
    it = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        pid_m, pid_n = _tile_of(t, num_m, num_n, GROUP_M)
        expert, valid = _segment_of(pid_m, segments, BLOCK_M)
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        scales = _tile_scales(a_scale_ptr, w_scale_ptr, expert, m0, n0, N, w_rows, stride_asg, stride_wse,
                              stride_wsn, stride_wsk, GATED, BLOCK_M, rows_l)
        # the loads are the loader partition's (no descriptors here: the buffers stand in, never read as such)
        acc = _fp8_tile(it, n_steps, a_bufs, w_bufs, m0, 0, N, scales, ready, empty, a_bufs, w_bufs, first_half,
                        GATED, BLOCK_M, BLOCK_N, WIDTH, STAGES, True, mma, rows_l)
        it += n_steps

        if GATED:
            gate, up = _split_halves(acc, BLOCK_M, BLOCK_N, out_l)
        else:
            gate = acc
            up = acc
        _tile_out(gate, up, out_l, out_desc, out_buf, expert, m0, n0, valid, bias_ptr, out_ptr, rows_ptr, N, stride_be,
                  stride_bn, stride_om, stride_on, alpha, beta, limit, GATED, ACTIVATION, HAS_BIAS, OUT_SORTED,
                  TMA_STORE, BLOCK_M, BLOCK_N)
    if TMA_STORE:
        tma.store_wait(0)


# the token-dependent counts are not specialized on, so one compiled kernel serves every M
@gluon.jit(do_not_specialize=["num_experts", "stride_asg"])
def moe_gemm_fp8_ws_kernel(
    a_desc, w_desc, out_desc, a_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, rows_ptr, ends_ptr, counts_ptr,
    num_experts, N, K, w_rows, stride_asg,
    stride_wse, stride_wsn, stride_wsk, stride_be, stride_bn, stride_om, stride_on,
    alpha, beta, limit,
    GATED: gl.constexpr, ACTIVATION: gl.constexpr, HAS_BIAS: gl.constexpr, OUT_SORTED: gl.constexpr,
    TMA_STORE: gl.constexpr, E_PAD: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
    STAGES: gl.constexpr, LOADER_REGS: gl.constexpr, num_warps: gl.constexpr,
):
    """``out = act(dequant(a_sorted) @ dequant(w[expert]).T + bias[expert])`` over every tile the layout
    uses, the operands as `_gemm_wgmma.moe_gemm_fp8_wgmma_kernel`'s (e4m3, blocks ``[BLOCK_M | BLOCK_N, 128]``,
    scales ``[groups, rows]`` and ``[E, R / 128, groups]``); the module docstring says how."""
    a_bufs, w_bufs, ready, empty = _ring(a_desc, w_desc, GATED, BLOCK_M, BLOCK_N, 128, STAGES)
    out_buf = _staging_buffer(out_desc, a_bufs, TMA_STORE, BLOCK_M, BLOCK_N)
    gl.warp_specialize([
        (_fp8_mma_partition, (a_bufs, w_bufs, ready, empty, out_desc, out_buf, a_scale_ptr, w_scale_ptr, bias_ptr,
                              out_ptr, rows_ptr, ends_ptr, counts_ptr, num_experts, N, K, w_rows, stride_asg,
                              stride_wse, stride_wsn, stride_wsk, stride_be, stride_bn, stride_om, stride_on, alpha,
                              beta, limit, GATED, ACTIVATION, HAS_BIAS, OUT_SORTED, TMA_STORE, E_PAD, BLOCK_M,
                              BLOCK_N, GROUP_M, STAGES, num_warps)),
        (_load_partition, (a_desc, w_desc, rows_ptr, 0, a_bufs, w_bufs, ready, empty, rows_ptr, ends_ptr, counts_ptr,
                           num_experts, N, K, w_rows, False, 1, GATED, E_PAD, BLOCK_M, BLOCK_N, 128, GROUP_M,
                           STAGES)),
    ], [1], [LOADER_REGS])
