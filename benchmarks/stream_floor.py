"""The floor under one token's decode GEMMs: what reading their weight bytes alone costs on this GPU.

At one token an MoE layer reads the weights of the experts it hits once, GEMM1's then GEMM2's, and the roofline
(`moe.oracle.cost.roofline`) is those bytes over the measured copy bandwidth. A real kernel pays more than the
bytes: launches, the first loads' latency, the last programs' tail. This script times kernels that do nothing but
read the same byte counts (each program XORs a contiguous run of 8 KB blocks into registers and stores the result,
so no load is dropped), in a CUDA graph and rotating through buffers that together exceed the L2, as `moe bench`
times the experts:

- ``one``: a single launch over both GEMMs' bytes;
- ``two``: two launches in a row, GEMM1's bytes then GEMM2's;
- ``two-pdl``: the same as a programmatic dependent launch, the second grid waiting for the first
  (``griddepcontrol``) as the decode GEMMs run for one token (SM90+, Triton 3.4+);
- ``one-tma`` and ``two-tma`` (SM90, Gluon): as ``one`` and ``two``, but each program keeps a ring of
  `TMA_STAGES` TMA loads of 16 KB blocks in flight into shared memory (waiting on each block's mbarrier before it
  reloads the buffer) instead of loading into registers.

Each is swept over programs per SM and the fastest kept. Its fraction of the roofline is the most a kernel (or
kernel pair) that only streamed these bytes reached here; the decode GEMMs' own fractions (`moe bench`) read
against it.

    python benchmarks/stream_floor.py --preset qwen3-30b-a3b,gpt-oss-120b,deepseek-v3-ep8-slice
        --quant fp8_block,mxfp4,bf16 [--programs-per-sm 1,2,4,8,16] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

try:  # grid dependency control: Triton 3.4+
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAS_PDL = True
except ImportError:
    gdc_launch_dependents = gdc_wait = None
    HAS_PDL = False

BLOCK = 2048  # int32 words per load step: 8 KB
PDL_NONE, PDL_FIRST, PDL_SECOND = 0, 1, 2
MIN_ROTATED_BYTES = 200 * 2**20  # four times an H200's 50 MB L2: no buffer is still there when read again


@triton.jit
def stream_kernel(src, out, n_blocks, blocks_per_program, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program p XORs blocks ``p * blocks_per_program ..`` (those below ``n_blocks``) of ``src`` and stores the
    ``[BLOCK]`` result at ``out[p]``. ``PDL``: 1 lets the next grid launch once past the loads, 2 waits for the
    previous grid first."""
    if PDL == 2:
        gdc_wait()
    pid = tl.program_id(0)
    first = pid * blocks_per_program
    last = tl.minimum(first + blocks_per_program, n_blocks)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.int32)
    for block in range(first, last):
        acc ^= tl.load(src + block * BLOCK + offs)  # a row of the pool: < 2**31 words
    if PDL == 1:
        gdc_launch_dependents()
    tl.store(out + pid.to(tl.int64) * BLOCK + offs, acc)


TMA_ROWS, TMA_COLS = 128, 64  # a TMA block: 128 rows of 64 bf16 (128 bytes, one swizzle span): 16 KB
TMA_STAGES = 4  # blocks in flight per program: 64 KB of shared memory, three programs per SM at most


@functools.cache
def _tma_kernel():
    """The Gluon kernel of the ``*-tma`` modes, built on first use (Gluon is experimental; CUDA only)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier

    from moe.experts._triton._gemm_wgmma import _tma_load as tma_load  # the TMA load under either Triton's name

    @gluon.jit
    def tma_stream_kernel(desc, out, n_blocks, blocks_per_program, ROWS: gl.constexpr, COLS: gl.constexpr,
                          STAGES: gl.constexpr):
        """Program p loads blocks ``p * blocks_per_program ..`` (those below ``n_blocks``) of ``desc`` (blocks of
        ``[ROWS, COLS]``) by TMA, a ring of ``STAGES`` in flight, and stores how many it loaded at ``out[p]``."""
        bufs = gl.allocate_shared_memory(desc.dtype, [STAGES, ROWS, COLS], desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        pid = gl.program_id(0)
        first = pid * blocks_per_program
        count = gl.minimum(first + blocks_per_program, n_blocks) - first
        for i in gl.static_range(STAGES):
            mbarrier.expect(bars.index(i), desc.block_type.nbytes, pred=i < count)
            tma_load(desc, [(first + i) * ROWS, 0], bars.index(i), bufs.index(i), i < count)
        for j in range(count):
            index = j % STAGES
            mbarrier.wait(bars.index(index), (j // STAGES) & 1)
            again = j + STAGES < count  # nothing reads the buffer: it takes the next block at once
            mbarrier.expect(bars.index(index), desc.block_type.nbytes, pred=again)
            tma_load(desc, [(first + j + STAGES) * ROWS, 0], bars.index(index), bufs.index(index), again)
        gl.store(out + pid, count)

    return tma_stream_kernel


def _tma_layout():
    """The shared-memory layout of a TMA block (bf16, 128-byte swizzle)."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for([TMA_ROWS, TMA_COLS], gl.bfloat16)


def tma_ptx(arch: int = 90) -> str:
    """The TMA kernel's PTX for ``arch``, compiled by the installed Triton without a GPU (the CPU's check of it; run
    where ``TRITON_INTERPRET`` is off)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = _tma_kernel()
    layout = _tma_layout()
    consts = dict(ROWS=TMA_ROWS, COLS=TMA_COLS, STAGES=TMA_STAGES)
    types = {"desc": f"tensordesc<bf16[{TMA_ROWS}, {TMA_COLS}],{layout!r}>", "out": "*i32"}
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    source = GluonASTSource(fn=fn, signature=signature,
                            constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=1)).asm["ptx"]


def tma_launch(src: torch.Tensor, out: torch.Tensor, programs: int) -> None:
    """The TMA kernel over all of ``src`` (int32 words, a whole number of 16 KB blocks) on ``programs`` programs."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    rows = src.view(torch.bfloat16).view(-1, TMA_COLS)
    desc = TensorDescriptor(rows, list(rows.shape), [TMA_COLS, 1], [TMA_ROWS, TMA_COLS], _tma_layout())
    n_blocks = rows.shape[0] // TMA_ROWS
    per_program = triton.cdiv(n_blocks, programs)
    grid = (triton.cdiv(n_blocks, per_program),)
    _tma_kernel()[grid](desc, out, n_blocks, per_program, ROWS=TMA_ROWS, COLS=TMA_COLS, STAGES=TMA_STAGES,
                        num_warps=1)


def launch(src: torch.Tensor, out: torch.Tensor, programs: int, pdl: int = PDL_NONE) -> None:
    """``stream_kernel`` over all of ``src`` (a whole number of blocks) on ``programs`` programs."""
    n_blocks = src.numel() // BLOCK
    per_program = triton.cdiv(n_blocks, programs)
    grid = (triton.cdiv(n_blocks, per_program),)
    options = {"launch_pdl": True} if pdl == PDL_SECOND else {}
    stream_kernel[grid](src, out, n_blocks, per_program, BLOCK=BLOCK, PDL=pdl, num_warps=4, **options)


def blocks(num_bytes: float) -> int:
    return max(1, round(num_bytes / (4 * BLOCK)))


def byte_counts(preset_name: str, quant: str, platform, device) -> tuple[float, float, float, float]:
    """(GEMM1's weight bytes, GEMM2's, the activations' bytes, the roofline in us on ``platform``) of one token of
    ``preset_name`` under ``quant``: the experts `moe bench`'s routing hits, its roofline's formulas."""
    from moe.presets import load_preset
    from moe.tools.bench import make_inputs, traffic

    preset = load_preset(preset_name)
    problem = preset.problem(quant=quant, max_tokens=1)
    roof = traffic(problem, platform, [topk for _, topk in make_inputs(preset, problem, 1, 4, device)])
    gemm1 = problem.w13_rows * problem.hidden_size
    gemm2 = problem.hidden_size * problem.intermediate_size
    return (roof.weight_bytes * gemm1 / (gemm1 + gemm2), roof.weight_bytes * gemm2 / (gemm1 + gemm2),
            roof.activation_bytes, roof.memory_us)


def floors(bytes1: float, bytes2: float, programs_per_sm: list[int], device, tma: bool = False) -> dict:
    """{mode: (best us, its programs per SM)} for streaming ``bytes1`` then ``bytes2`` (``tma``: the TMA modes
    too). A block is 8 KB; the TMA kernel's are 16 KB, so each GEMM's blocks are rounded to an even count."""
    from moe.tools.bench import time_calls

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    n1, n2 = blocks(bytes1), blocks(bytes2)
    if tma:  # whole 16 KB blocks for the TMA kernel in both halves
        n1, n2 = n1 + n1 % 2, n2 + n2 % 2
    rotations = max(2, -(-MIN_ROTATED_BYTES // (4 * BLOCK * (n1 + n2))))
    pool = torch.randint(0, 2**30, (rotations, (n1 + n2) * BLOCK), device=device, dtype=torch.int32)
    out = torch.empty(16 * sms * BLOCK, device=device, dtype=torch.int32)
    modes = ["one", "two"]
    if HAS_PDL and torch.cuda.get_device_capability(device) >= (9, 0):
        modes.append("two-pdl")
    if tma and torch.cuda.get_device_capability(device) >= (9, 0):
        modes += ["one-tma", "two-tma"]
    best = {}
    for mode in modes:
        for per_sm in programs_per_sm:
            programs = per_sm * sms

            def call(r, mode=mode, programs=programs):
                if mode == "one":
                    launch(pool[r], out, programs)
                    return
                if mode == "one-tma":
                    tma_launch(pool[r], out, programs)
                    return
                if mode == "two-tma":
                    tma_launch(pool[r, : n1 * BLOCK], out, programs)
                    tma_launch(pool[r, n1 * BLOCK:], out, programs)
                    return
                first = PDL_FIRST if mode == "two-pdl" else PDL_NONE
                second = PDL_SECOND if mode == "two-pdl" else PDL_NONE
                launch(pool[r, : n1 * BLOCK], out, programs, first)
                launch(pool[r, n1 * BLOCK:], out, programs, second)

            us = time_calls([lambda r=r, call=call: call(r) for r in range(rotations)], graphs=True)
            if mode not in best or us < best[mode][0]:
                best[mode] = (us, per_sm)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b,gpt-oss-120b,deepseek-v3-ep8-slice")
    parser.add_argument("--quant", default="fp8_block")
    parser.add_argument("--programs-per-sm", default="1,2,4,8,16")
    parser.add_argument("--tma", action="store_true", help="also the TMA-ring modes (SM90, Gluon)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("stream_floor.py needs a CUDA GPU (it times kernels that read device memory)", file=sys.stderr)
        return 2
    programs_per_sm = [int(p) for p in args.programs_per_sm.split(",")]
    if not programs_per_sm or min(programs_per_sm) < 1 or max(programs_per_sm) > 16:
        print(f"--programs-per-sm: each must be in 1..16 (got {args.programs_per_sm})", file=sys.stderr)
        return 2
    from moe.platform import Platform

    device = torch.device("cuda")
    platform = Platform.detect(device).measure_rates(device)
    print(f"{torch.cuda.get_device_name(device)}: copy {platform.memory_bandwidth / 1e12:.2f} TB/s")
    rows = []
    print("| preset | scheme | GEMM1 + GEMM2 MB | roofline us | mode | floor us | programs / SM | % of roofline |")
    print("|---|---|---|---|---|---|---|---|")
    for preset in args.preset.split(","):
        for quant in args.quant.split(","):
            bytes1, bytes2, act_bytes, roofline_us = byte_counts(preset, quant, platform, device)
            for mode, (us, per_sm) in floors(bytes1, bytes2, programs_per_sm, device, args.tma).items():
                rows.append(dict(preset=preset, quant=quant, gemm1_bytes=bytes1, gemm2_bytes=bytes2,
                                 activation_bytes=act_bytes, roofline_us=roofline_us, mode=mode, us=us,
                                 programs_per_sm=per_sm, roofline_fraction=roofline_us / us))
                print(f"| {preset} | {quant} | {bytes1 / 1e6:.1f} + {bytes2 / 1e6:.1f} | {roofline_us:.1f} | {mode} | "
                      f"{us:.1f} | {per_sm} | {roofline_us / us:.0%} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(device),
                                                   bandwidth=platform.memory_bandwidth, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
