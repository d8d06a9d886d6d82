"""GPU: the fp8 128-group row quantization (`_rows.fp8_quant_kernel`, FP8_BLOCK) under several grids, one process.

    python benchmarks/fp8_quant_grid.py            # prints a table, writes $OUT/fp8_quant_grid.json

Each program quantizes BLOCK_R rows of the groups program_id(1), + num_programs(1), ...: a grid of
(rows / BLOCK_R, 1) loops over all of K in each program (the kernel before session 16), (rows / BLOCK_R, groups)
gives each program one group. The shapes are the intermediates and inputs the fp8 tables quantize at
M = 1024-16384 (rows: the slots plus a layout's padding). Times are CUDA-event means of triton.testing.do_bench.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe.experts._triton import cdiv, kernels  # noqa: E402
from moe.experts._triton.rows import FP8_MODES, GROUP  # noqa: E402
from moe.quant import QuantFormat  # noqa: E402

SHAPES = {  # name: (rows, K)
    "deepseek inter M=1024": (10240, 2048),
    "deepseek inter M=16384": (135168, 2048),
    "deepseek x M=16384": (16384, 7168),
    "qwen3 inter M=4096": (40960, 768),
    "qwen3 inter M=16384": (147456, 768),
    "gpt-oss inter M=16384": (73728, 2880),
}
VARIANTS = [(16, False), (16, True), (32, True), (64, True), (64, False)]  # (BLOCK_R, one group per program)


def time_variant(x, q, scale, block_r: int, per_group: bool) -> float:
    rows, k = x.shape
    grid = (cdiv(rows, block_r), cdiv(k, GROUP) if per_group else 1)
    fn = kernels("rows").fp8_quant_kernel

    def call():
        fn[grid](x, q, scale, scale, x, x, rows, k, 0, x.stride(0), q.stride(0), 1, rows,
                 MODE=FP8_MODES[QuantFormat.FP8_BLOCK], VALID=0, BLOCK_R=block_r, BLOCK_K=GROUP)

    return triton.testing.do_bench(call, rep=100) * 1000


def main() -> dict:
    results = {}
    for name, (rows, k) in SHAPES.items():
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        q = torch.empty(rows, k, device="cuda", dtype=torch.float8_e4m3fn)
        scale = torch.empty(cdiv(k, GROUP) * rows, device="cuda", dtype=torch.float32)  # [groups, rows]
        ideal = (x.numel() * 3 + scale.numel() * 4) / 4.2e12 * 1e6  # bf16 in, e4m3 out, scales, at 4.2 TB/s
        row = {"ideal_us": round(ideal, 1)}
        for block_r, per_group in VARIANTS:
            us = time_variant(x, q, scale, block_r, per_group)
            row[f"r{block_r}{'_per_group' if per_group else '_loop'}"] = round(us, 1)
        results[name] = row
        print(name, row, flush=True)
    return results


if __name__ == "__main__":
    found = main()
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, "fp8_quant_grid.json"), "w") as f:
        json.dump(found, f, indent=1)
