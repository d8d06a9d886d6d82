"""Time of one routing call on a CUDA GPU: the torch reference against the fused Triton kernel.

    python benchmarks/routing_time.py                 # both shapes, M = 1 .. 4096
    python benchmarks/routing_time.py --tokens 1 64   # fewer token counts

Shapes: DeepSeek-V3 (E=256, k=8, sigmoid, n_group=8, topk_group=4, correction bias, scale 2.5) and
Qwen3-MoE (E=128, k=8, softmax, renormalized), bfloat16 logits. Each number is the median over
``--calls`` calls of the GPU time of ``--repeat`` back-to-back calls (CUDA events), divided by
``--repeat``: launch costs included, as a layer pays them at decode sizes. The last column is
reference / fused: where it is below 1 the fused kernel does not pay (see moe/routing/fused.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe.router import Router  # noqa: E402
from moe.routing.fused import fused_route  # noqa: E402
from moe.routing.reference import route_reference  # noqa: E402


def shapes() -> dict[str, Router]:
    bias = torch.randn(256, generator=torch.Generator().manual_seed(0)).cuda() * 0.1
    return {
        "deepseek_v3 E=256 k=8 n_group=8 topk_group=4": Router(
            "deepseek_v3", 256, 8, n_group=8, topk_group=4, correction_bias=bias, routed_scaling_factor=2.5),
        "qwen3 E=128 k=8": Router("softmax", 128, 8),
    }


def microseconds(call: Callable[[], object], calls: int, repeat: int) -> float:
    """Median GPU microseconds of one call."""
    for _ in range(3):
        call()
    times = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeat):
            call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / repeat)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024, 4096])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("routing_time.py times CUDA kernels; no CUDA device here")
    print(f"# {torch.cuda.get_device_name()}, bf16 logits, microseconds per call")
    print(f"{'shape':46} {'M':>5} {'reference':>10} {'fused':>8} {'ref/fused':>9}")
    for name, router in shapes().items():
        for tokens in args.tokens:
            logits = torch.randn(tokens, router.num_choices, device="cuda", dtype=torch.bfloat16)
            reference = microseconds(lambda: route_reference(logits, router), args.calls, args.repeat)
            fused = microseconds(lambda: fused_route(logits, router), args.calls, args.repeat)
            print(f"{name:46} {tokens:5d} {reference:10.1f} {fused:8.1f} {reference / fused:9.2f}")


if __name__ == "__main__":
    main()
