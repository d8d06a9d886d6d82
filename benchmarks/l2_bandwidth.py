"""Read bandwidth of a CUDA GPU's L2 and DRAM as every SM's programs see it: how many bytes per second all SMs
together can pull with 16-byte loads from a buffer that fits in L2, and from one that does not.

    python benchmarks/l2_bandwidth.py [--sizes-mb 8,16,32,2048] [--json out.json]

Each program reads 16 KB blocks, spaced by the grid, cycling through the buffer, and XORs them into registers (the
result is stored, so no load is dropped). A grid-sized first pass warms the buffer into L2. The bandwidth is the
bytes read over the median time of `triton.testing.do_bench`. The grouped GEMMs' tiles need their operands at a
given rate from L2 (bytes per K step over the step's tensor-core time): this puts a number on what L2 gives.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

BLOCK = 4096  # int32 words per program and load: 16 KB


@triton.jit
def read_kernel(src, out, n_blocks, ITERS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.int32)
    for i in range(ITERS):
        block = (pid + i * grid) % n_blocks
        acc ^= tl.load(src + block.to(tl.int64) * BLOCK + offs)
    tl.store(out + pid * BLOCK + offs, acc)


def bandwidth(size_mb: int, programs_per_sm: int, iters: int) -> float:
    """Bytes per second all programs read from a ``size_mb`` buffer."""
    words = size_mb * 1024 * 1024 // 4 // BLOCK * BLOCK
    src = torch.randint(0, 2**30, (words,), device="cuda", dtype=torch.int32)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = sms * programs_per_sm
    out = torch.empty(grid * BLOCK, device="cuda", dtype=torch.int32)

    def run():
        read_kernel[(grid,)](src, out, words // BLOCK, ITERS=iters, BLOCK=BLOCK, num_warps=4)

    run()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(run, warmup=50, rep=300)
    return grid * iters * BLOCK * 4 / (ms * 1e-3)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", default="8,16,32,2048")
    parser.add_argument("--programs-per-sm", default="4,8")
    parser.add_argument("--iters", type=int, default=64)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("l2_bandwidth.py needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    for size in (int(s) for s in args.sizes_mb.split(",")):
        for per_sm in (int(p) for p in args.programs_per_sm.split(",")):
            tbs = bandwidth(size, per_sm, args.iters) / 1e12
            rows.append({"size_mb": size, "programs_per_sm": per_sm, "tb_per_s": round(tbs, 2)})
            print(f"{size:6d} MB, {per_sm} programs per SM: {tbs:.2f} TB/s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
