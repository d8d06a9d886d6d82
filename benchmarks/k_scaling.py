"""Where a grouped GEMM's time goes: each GEMM of a shape's table config, timed with its K cut to 1/4, 1/2 and all
of it. The same tiles run fewer K steps, so a line through the points splits each GEMM's time into a part that grows
with K (the K loop) and a part that does not (the epilogue, each tile's tail, the launch). Session 31 found that
second part at 48% of Qwen3-30B-A3B's GEMM2 at M = 4096, which led to the ws tiles' TMA store
(benchmarks/results/bf16_ws_nvidia-h200.md).

    python benchmarks/k_scaling.py --preset qwen3-30b-a3b --tokens 4096 [--quant bf16 | fp8_block] [--json OUT]

It times the TMA-A path's GEMMs (``tma_a`` tiles, ``ws`` or not: gemm_tma_a.py), the ones a dense table uses from
about 256 rows per expert on SM90, or the fp8_block ``wgmma`` ones (``ws`` or not: gemm_wgmma.py), each launch on its
own (CUDA graphs, `moe.tools.bench.time_calls`). The inputs are random rows in the layout's sorted order (fp8: random
e4m3 codes, their scales 1); the routing is the bench's. The times at a cut K are of a GEMM that reads the first K
columns only: they say how the time scales, not what a smaller layer would take.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FRACTIONS = (4, 2, 1)  # K / f


def with_k(launch, k: int):
    """``launch`` with its kernel's ``K`` argument set to ``k`` (found by name in the kernel's arguments)."""
    from moe.experts._triton import kernels

    module, name = launch.kernel
    names = [n for n in getattr(kernels(module), name).arg_names if n not in launch.constexprs]
    index = names.index("K")
    return dataclasses.replace(launch, args=launch.args[:index] + (k,) + launch.args[index + 1:])


def cut_ks(k: int, block_k: int) -> list[int]:
    """K / 4, K / 2 and K, each a whole number of ``block_k`` steps (at least one)."""
    return [max(block_k, k // f // block_k * block_k) for f in FRACTIONS]


def fixed_part(points: list[tuple[int, float]]) -> float:
    """The time at K = 0 of the line through the smallest and the largest K of ``points`` ((K, us) pairs)."""
    (k_lo, t_lo), (k_hi, t_hi) = min(points), max(points)
    if k_hi == k_lo:
        raise ValueError(f"the points need two different K (got {points})")
    return t_hi - (t_hi - t_lo) / (k_hi - k_lo) * k_hi


def gemm_launches(preset_name: str, quant: str, tokens: int) -> tuple[dict, object]:
    """{"gemm1" | "gemm2": (launch at the full K, K, block_k)} of the shape's table config at ``tokens``, and the
    config; the operands are allocated here (CUDA)."""
    from moe.errors import MoEConfigError
    from moe.experts._triton.align import align_block_size, workspace_buffers
    from moe.experts._triton.gemm_tma_a import gemm1_operand, gemm2_output, tma_a_gemm_launch
    from moe.experts.triton import TritonExperts
    from moe.presets import load_preset
    from moe.tools.bench import build_weights, make_inputs

    device = torch.device("cuda")
    preset = load_preset(preset_name)
    problem = preset.problem(quant=quant, max_tokens=tokens)
    experts = TritonExperts(problem)
    weights = experts.prepare_weights(build_weights(problem, device))
    config = weights.configs.lookup(tokens)
    if not (config.gemm1.tma_a and config.gemm2.tma_a) and not config.gemm1.wgmma:
        raise MoEConfigError(f"k_scaling times the TMA-A GEMMs (tma_a tiles on both) or the fp8_block wgmma ones; "
                             f"{preset_name} {quant} at M = {tokens} runs {config}")
    x, topk = make_inputs(preset, problem, tokens, 1, device)[0]
    ids = topk.ids.to(torch.int32)
    slots, local = ids.numel(), problem.local_num_experts
    buffers = {name: torch.empty(shape, dtype=dtype, device=device)
               for name, (shape, dtype) in workspace_buffers(slots, local, (config.block_m,)).items()}
    layout = align_block_size(ids, weights.expert_map, local, config.block_m, buffers)
    rows = layout.sorted_slots.numel()
    if config.gemm1.wgmma:
        gemm1, gemm2 = _wgmma_launches(problem, weights, config, layout, slots)
        return {"gemm1": (gemm1, weights.w13.k, 128), "gemm2": (gemm2, weights.w2.k, 128)}, config
    tile1, a, a_row_div = gemm1_operand(x, layout, ids.shape[1], config.gemm1,  # as the layer's GEMM1 reads
                                        torch.empty(rows, problem.hidden_size, dtype=x.dtype, device=device))
    inter = torch.randn(rows, problem.intermediate_size, dtype=x.dtype, device=device)
    y = torch.empty(rows, problem.hidden_size, dtype=x.dtype, device=device)
    gemm1 = tma_a_gemm_launch(a, weights.w13, inter, layout, True, problem.activation, tile1, a_row_div)
    out, out_sorted = gemm2_output(config.gemm2, y, rows, slots)  # as the layer's GEMM2 writes
    gemm2 = tma_a_gemm_launch(inter, weights.w2, out, layout, out_sorted, None, config.gemm2)
    return {"gemm1": (gemm1, weights.w13.k, config.gemm1.block_k),
            "gemm2": (gemm2, weights.w2.k, config.gemm2.block_k)}, config


def _wgmma_launches(problem, weights, config, layout, slots: int) -> tuple:
    """GEMM1 and GEMM2 of an fp8_block ``wgmma`` config on random sorted e4m3 rows with unit scales, their outputs
    where the layer's go (`gemm_wgmma.sorted_wgmma_gemms`)."""
    from moe.experts._triton import cdiv
    from moe.experts._triton.gemm_tma_a import gemm2_output
    from moe.experts._triton.gemm_wgmma import wgmma_gemm_launch
    from moe.experts._triton.rows import GROUP

    device = layout.sorted_slots.device
    rows = layout.sorted_slots.numel()
    hidden, inter_size = weights.w13.k, weights.w2.k

    def e4m3(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:  # codes [n, k] and scales [k / 128, n]
        codes = torch.randn(n, k, device=device).clamp(-4, 4).to(torch.float8_e4m3fn)
        return codes, torch.ones(cdiv(k, GROUP), n, device=device)

    x_sorted, x_scale = e4m3(rows, hidden)
    inter = torch.empty(rows, inter_size, dtype=problem.dtype, device=device)
    inter_q, inter_scale = e4m3(rows, inter_size)
    y = torch.empty(rows, hidden, dtype=problem.dtype, device=device)
    out, out_sorted = gemm2_output(config.gemm2, y, rows, slots)  # as the layer's GEMM2 writes
    return (wgmma_gemm_launch(x_sorted, x_scale, weights.w13, inter, layout, True, problem.activation, config.gemm1),
            wgmma_gemm_launch(inter_q, inter_scale, weights.w2, out, layout, out_sorted, None, config.gemm2))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", required=True)
    parser.add_argument("--tokens", type=int, required=True)
    parser.add_argument("--quant", default="bf16")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every launch taking turns (the best counts)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        print("k_scaling: needs an SM90+ CUDA GPU (the TMA-A and wgmma GEMMs)", file=sys.stderr)
        return 2
    from moe.tools.bench import time_calls

    launches, config = gemm_launches(args.preset, args.quant, args.tokens)
    cut = {(gemm, k): with_k(launch, k) for gemm, (launch, full, block_k) in launches.items()
           for k in cut_ks(full, block_k)}
    times = {key: [] for key in cut}
    for r in range(args.rounds):
        for key in (list(cut) if r % 2 == 0 else list(cut)[::-1]):
            times[key].append(time_calls([cut[key].run], True, budget_ms=150.0))
    report = {"preset": args.preset, "quant": args.quant, "tokens": args.tokens, "config": config.to_dict(),
              "device": torch.cuda.get_device_name(), "gemms": {}}
    print(f"{args.preset} {args.quant} M = {args.tokens}, the table's config: {config}")
    print("| GEMM | K: us (best of rounds) | part not scaling with K |\n|---|---|---|")
    for gemm in launches:
        points = sorted((k, min(v)) for (g, k), v in times.items() if g == gemm)
        fixed = fixed_part(points)
        report["gemms"][gemm] = {"points": points, "fixed_us": fixed, "fixed_fraction": fixed / points[-1][1]}
        print(f"| {gemm} | {', '.join(f'{k}: {t:.1f}' for k, t in points)} | {fixed:.1f} us, "
              f"{100 * fixed / points[-1][1]:.1f}% |")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
