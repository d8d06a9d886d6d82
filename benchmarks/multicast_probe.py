"""Does a two-CTA cluster sharing its weight tile by TMA multicast work here, and what does it save? A probe for
the grouped GEMMs' next step (session 26's scoreboard: two CTAs of a cluster take two m blocks of one expert and
share its weight tile, halving the weights' L2 traffic), written in Gluon, which has multi-CTA layouts and
``async_load(..., multicast=True)`` from Triton 3.9 (the GPU machine runs it from `triton_carry.sh`'s package).

    python benchmarks/multicast_probe.py [--m 8192 --n 8192 --k 4096] [--json OUT]

One kernel, `probe_kernel`, a dense bf16 ``out = a @ w.T``: a cluster of two CTAs takes a ``[2 * HALF_M, BLOCK_N]``
tile, each CTA its ``HALF_M`` rows of ``a`` (a shared layout split over the cluster); the weight block ``[BLOCK_N,
BLOCK_K]`` sits in both CTAs (a broadcast layout), loaded by each CTA for itself or, with ``MULTICAST``, once for
both. Single-buffered, a cluster barrier after each K step (before the next load may overwrite the block): the two
sides differ only in who loads the weights. Printed: each side's error against torch and its time (the median of
20 calls of `run`, host work included: the output's allocation and both descriptors, the same on both sides).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HALF_M, BLOCK_N, BLOCK_K = 64, 128, 64  # a CTA's rows, the shared weight block


@functools.cache
def _kernel():
    """The Gluon kernel, built on first use (Gluon's multi-CTA API: Triton 3.9+)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

    @gluon.jit
    def probe_kernel(a_desc, w_desc, out, K, stride_om, MULTICAST: gl.constexpr, num_warps: gl.constexpr):
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]  # the cluster's rows: HALF_M per CTA
        N_BLOCK: gl.constexpr = w_desc.block_type.shape[0]
        K_BLOCK: gl.constexpr = w_desc.block_type.shape[1]
        a_smem = gl.allocate_shared_memory(a_desc.dtype, [BLOCK_M, K_BLOCK], a_desc.layout)
        w_smem = gl.allocate_shared_memory(w_desc.dtype, [N_BLOCK, K_BLOCK], w_desc.layout)
        bar = mbarrier.allocate_mbarrier()  # one per CTA
        mbarrier.init(bar, count=1)
        gl.barrier(cluster=True)  # every CTA's barrier initialized before any multicast signals it
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, N_BLOCK, 16], cga_layout=[[1, 0]])
        acc = gl.zeros([BLOCK_M, N_BLOCK], gl.float32, layout=mma)
        m0 = gl.program_id(0) * BLOCK_M
        n0 = gl.program_id(1) * N_BLOCK
        phase = 0
        for k in range(0, K, K_BLOCK):
            mbarrier.expect(bar, (BLOCK_M // 2 + N_BLOCK) * K_BLOCK * 2)  # per CTA: its rows, the whole block
            tma.async_load(a_desc, [m0, k], bar, a_smem)
            tma.async_load(w_desc, [n0, k], bar, w_smem, multicast=MULTICAST)
            mbarrier.wait(bar, phase)
            acc = warpgroup_mma(a_smem, w_smem.permute((1, 0)), acc)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            gl.barrier(cluster=True)  # both CTAs are done with the block before the next load replaces it
            phase ^= 1
        rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma))
        cols = n0 + gl.arange(0, N_BLOCK, layout=gl.SliceLayout(0, mma))
        gl.store(out + rows[:, None] * stride_om + cols[None, :], acc.to(out.dtype.element_ty))

    return probe_kernel


def _layouts():
    """(A's layout: rows split over the cluster's two CTAs; W's: the whole block in both)."""
    from triton.experimental.gluon import language as gl

    a = gl.NVMMASharedLayout.get_default_for([2 * HALF_M, BLOCK_K], gl.bfloat16, cga_layout=[[1, 0]])
    w = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.bfloat16, cga_layout=[[0, 0]])
    return a, w


def multi_cta_gluon() -> bool:
    """Whether the installed Triton's Gluon has TMA multicast and the multi-CTA layouts this kernel uses (3.9+).
    Triton 3.8 (torch 2.14's) already has ``async_load(multicast=)``, but compiling the kernel fails in its layouts
    ("'list' object has no attribute 'type'"), so the version is checked too."""
    import inspect

    import triton

    try:
        from triton.experimental.gluon.language.nvidia.hopper import tma
    except ImportError:
        return False
    major, minor = (int(part) for part in triton.__version__.split(".")[:2])
    return (major, minor) >= (3, 9) and "multicast" in inspect.signature(tma.async_load).parameters


def probe_ptx(multicast: bool, arch: int = 90) -> str:
    """The kernel's PTX for ``arch``, compiled without a GPU (run where ``TRITON_INTERPRET`` is off)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = _kernel()
    a, w = _layouts()
    types = {"a_desc": f"tensordesc<bf16[{2 * HALF_M}, {BLOCK_K}],{a!r}>",
             "w_desc": f"tensordesc<bf16[{BLOCK_N}, {BLOCK_K}],{w!r}>", "out": "*bf16"}
    consts = dict(MULTICAST=multicast, num_warps=4)
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    source = GluonASTSource(fn=fn, signature=signature,
                            constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    options = dict(num_warps=4, num_ctas=2)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options).asm["ptx"]


def run(a: torch.Tensor, w: torch.Tensor, multicast: bool) -> torch.Tensor:
    """``a @ w.T`` by the probe kernel (bf16, M a multiple of 2 * HALF_M, N of BLOCK_N, K of BLOCK_K)."""
    m, k = a.shape
    n = w.shape[0]
    if m % (2 * HALF_M) or n % BLOCK_N or k % BLOCK_K or w.shape[1] != k or min(m, n, k) == 0:
        raise ValueError(f"the probe takes a [M, K] and w [N, K] with M a positive multiple of {2 * HALF_M}, N of "
                         f"{BLOCK_N}, K of {BLOCK_K} (got a {list(a.shape)}, w {list(w.shape)})")
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    a_layout, w_layout = _layouts()
    out = torch.empty(m, n, dtype=a.dtype, device=a.device)
    a_desc = TensorDescriptor.from_tensor(a, [2 * HALF_M, BLOCK_K], a_layout)
    w_desc = TensorDescriptor.from_tensor(w, [BLOCK_N, BLOCK_K], w_layout)
    _kernel()[(m // (2 * HALF_M), n // BLOCK_N)](a_desc, w_desc, out, k, out.stride(0), MULTICAST=multicast,
                                                 num_warps=4, num_ctas=2)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--m", type=int, default=8192)
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        print("multicast_probe: needs an SM90+ CUDA GPU (TMA multicast, thread-block clusters)", file=sys.stderr)
        return 2
    if not multi_cta_gluon():
        print("multicast_probe: needs Triton 3.9+ (Gluon's multi-CTA layouts and TMA multicast); on the GPU machine "
              "carry it with benchmarks/triton_carry.sh", file=sys.stderr)
        return 2
    import triton

    from moe.tools.bench import median_ms

    torch.manual_seed(0)
    a = torch.randn(args.m, args.k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(args.n, args.k, device="cuda", dtype=torch.bfloat16) / args.k**0.5
    want = (a.float() @ w.float().T)
    report = {"triton": triton.__version__, "device": torch.cuda.get_device_name(), "shape": [args.m, args.n, args.k]}
    for multicast in (False, True, False, True):
        out = run(a, w, multicast)
        err = float((out.float() - want).norm() / want.norm())
        ms = median_ms(lambda mc=multicast: run(a, w, mc), 20, warmup=3)
        tflops = 2 * args.m * args.n * args.k / ms * 1e-9
        side = "multicast" if multicast else "each CTA loads"
        report.setdefault(side, []).append({"rel_err": err, "ms": ms, "tflops": tflops})
        print(f"{side}: rel err {err:.2e}, {ms * 1e3:.1f} us, {tflops:.0f} TFLOP/s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
