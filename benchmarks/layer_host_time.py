"""Host time of one decode-size forward of a FusedMoE layer (M=1, no CUDA graph), through the public API.

    python benchmarks/layer_host_time.py [--device cuda] [--experts triton,torch_grouped] [--calls 2000]

At M=1 the GPU work of a layer takes tens of microseconds, so the time of ``calls`` back-to-back forwards
(one synchronize at the end) is the host's: Python, checks, workspace, launches. The layer API is stable
across refactors of the kernel, so the same script measures before and after one.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moe import FusedMoE
from moe.presets import load_preset


def host_us(layer: FusedMoE, hidden: torch.Tensor, logits: torch.Tensor, calls: int, repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean microseconds per call of ``calls`` back-to-back forwards."""
    for _ in range(50):
        layer(hidden, logits)
    results = []
    for _ in range(repeats):
        if hidden.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            layer(hidden, logits)
        if hidden.is_cuda:
            torch.cuda.synchronize()
        results.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--experts", default="torch_grouped,reference")
    parser.add_argument("--calls", type=int, default=500)
    args = parser.parse_args()
    preset = load_preset(args.preset)
    if args.device == "cpu":  # the host path is what is measured: small sizes keep the compute out of it
        preset = preset.scaled(max_hidden=256, max_intermediate=128, max_experts=32)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    for name in args.experts.split(","):
        layer = FusedMoE(preset.num_experts, preset.top_k, preset.hidden_size, preset.intermediate_size,
                         activation=preset.activation, routing=preset.routing, dtype=dtype, device=args.device,
                         max_tokens=256, experts=name, **preset.router_options())
        p = layer.problem
        layer.load_weights(w13=torch.randn(p.num_experts, p.w13_rows, p.hidden_size) / p.hidden_size**0.5,
                           w2=torch.randn(p.num_experts, p.hidden_size, p.intermediate_size) / p.intermediate_size**0.5)
        hidden = torch.randn(1, p.hidden_size, device=args.device, dtype=dtype)
        logits = torch.randn(1, p.num_experts, device=args.device)
        print(f"{args.device} {preset.name} E={p.num_experts} H={p.hidden_size} I={p.intermediate_size} "
              f"{name:<14} M=1: {host_us(layer, hidden, logits, args.calls):8.1f} us per forward")


if __name__ == "__main__":
    main()
