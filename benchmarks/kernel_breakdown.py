"""Where an experts backend's time goes: GPU time per kernel of one call, from torch.profiler.

    python benchmarks/kernel_breakdown.py --preset qwen3-30b-a3b --tokens 16,256 --experts triton

Builds the calls exactly as ``python -m moe bench`` does (random weights, the preset's router,
rotating inputs), runs them eagerly under the profiler after warm-up and prints, per (preset, M),
each kernel's mean microseconds per call and its share. Eager launches leave gaps between kernels
that CUDA graphs remove, so the sum here is the GPU busy time, not the bench's wall time. In a graph the gaps
are about 0.4 us a kernel; the bench's time can still be longer than this sum (by up to 11% on the lent H200),
because its replays run for about 300 ms under the GPU's power cap, at lower clocks than this short profile
(benchmarks/results/sorted_path_s33_nvidia-h200.md).

``--ncu`` runs one call per (preset, M) after the warm-up between ``cudaProfilerStart`` and ``Stop``, without
torch.profiler (CUPTI is ncu's then), for Nsight Compute. Session 17's profiles
(benchmarks/results/fp8_ws_ncu_nvidia-h200.txt) came from a throwaway script doing the same, under these
commands (the flag folds that script in here; its first GPU run, session 21, gave
benchmarks/results/ncu_bf16_ws_mixtral_m1024_nvidia-h200.txt with the first of them)::

    ncu --profile-from-start off --set full -k regex:moe_gemm --launch-count 2 \
        python3 benchmarks/kernel_breakdown.py --preset deepseek-v3-ep8-slice --quant fp8_block --tokens 1024 --ncu
    ncu --profile-from-start off --section WarpStateStats --section SourceCounters --page source \
        --print-source sass --csv -k regex:fp8_ws --launch-count 1 python3 benchmarks/kernel_breakdown.py ... --ncu

``benchmarks/ncu_summary.py`` turns ``ncu --csv --page details`` output into one short table per launch (its
docstring has the command, with the warp-stall metrics).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe.tools.bench import backend_calls, build_weights, make_inputs  # noqa: E402
from moe.presets import load_preset  # noqa: E402
from moe.registry import get_experts  # noqa: E402


def breakdown(calls: list, reps: int) -> dict[str, float]:
    """Mean GPU microseconds per call of each kernel name."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            for call in calls:
                call()
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name[:60]] += event.device_time / (reps * len(calls))
    return dict(per_kernel)


def one_call_for_ncu(calls: list) -> None:
    """Warm up, then run the first call once inside the range ``ncu --profile-from-start off`` profiles."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    calls[0]()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def main(argv: list[str] | None = None) -> int:
    import moe.experts.triton  # noqa: F401 -- registers the Triton experts
    import moe.experts.triton_batched  # noqa: F401

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", required=True)
    parser.add_argument("--quant", default="bf16")
    parser.add_argument("--tokens", type=lambda t: [int(x) for x in t.split(",")], required=True)
    parser.add_argument("--experts", default="triton")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--ncu", action="store_true", help="one call each between cudaProfilerStart/Stop, for ncu")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    preset = load_preset(args.preset)
    weights = None
    for m in args.tokens:
        problem = preset.problem(quant=args.quant, max_tokens=m)
        weights = weights if weights is not None else build_weights(problem, device)
        inputs = make_inputs(preset, problem, m, 4, device)
        for name in args.experts.split(","):
            calls = backend_calls(get_experts(name), problem, weights, inputs, device)
            if args.ncu:
                one_call_for_ncu(calls)
                print(f"{args.preset} {args.quant} M={m} {name}: one call profiled")
                continue
            times = breakdown(calls, args.reps)
            total = sum(times.values())
            print(f"\n{args.preset} {args.quant} M={m} {name}: {total:.1f} us of GPU time per call")
            for kernel, us in sorted(times.items(), key=lambda kv: -kv[1]):
                print(f"  {us:9.1f} us  {us / total:5.1%}  {kernel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
