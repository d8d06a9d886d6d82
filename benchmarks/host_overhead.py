"""Host time of one decode-size forward: M = 1, CUDA graphs off, what the Python path costs per call.

    python benchmarks/host_overhead.py                   # CPU, fp32
    python benchmarks/host_overhead.py --device cuda     # the same on a GPU

The layer is Qwen3-30B-A3B's routing (E=128, k=8, softmax, renormalized) with H and I divided by
``--scale`` (default 8: H=256, I=96), so on a CPU the arithmetic of one token stays small next to the
bookkeeping around it. For each experts backend it times, with ``time.perf_counter``:

- ``layer``: ``FusedMoE.forward(hidden [1, H], router_logits [1, E])`` -- router, bucket lookup, kernel;
- ``kernel``: ``ModularKernel.forward(hidden, topk, validate=False)`` with the routing done beforehand.

Each number is the median (and p10/p90) of ``--calls`` calls after ``--warmup`` calls. On CUDA the
device is synchronized after every call, outside the timed region, so each call starts on an idle queue
and the time is the host's (launches included, kernels not waited for).

Runs against this tree's API (``kernel.load(weights)`` then ``kernel(hidden, topk)``); on a tree from
before that API (``kernel(hidden, topk, prepared)``) it uses that form, so the same script measures both.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe import FusedMoE  # noqa: E402
from moe.presets import load_preset  # noqa: E402


def timed(call: Callable[[], object], device: torch.device, calls: int, warmup: int) -> list[float]:
    """Microseconds of each of ``calls`` calls, after ``warmup`` untimed ones."""
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        call()
    synchronize()
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        samples.append((time.perf_counter() - start) * 1e6)
        synchronize()
    return samples


def build_layer(experts: str, scale: int, device: torch.device) -> FusedMoE:
    preset = load_preset("qwen3-30b-a3b")
    hidden, inter = preset.hidden_size // scale, preset.intermediate_size // scale
    layer = FusedMoE(preset.num_experts, preset.top_k, hidden, inter, activation=preset.activation,
                     quant="fp32", dtype=torch.float32, device=device, max_tokens=256, experts=experts,
                     routing=preset.routing, **dict(preset.routing_options))
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(preset.num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(preset.num_experts, hidden, inter, generator=gen) / inter**0.5
    layer.load_weights(w13=w13.to(device), w2=w2.to(device))
    return layer


def kernel_call(layer: FusedMoE, hidden: torch.Tensor, logits: torch.Tensor) -> Callable[[], object]:
    """The M=1 kernel's forward with the routing done once, in whichever API this tree has."""
    kernel, topk = layer.kernel_for(1), layer.router(logits)
    if hasattr(kernel, "load"):
        return lambda: kernel(hidden, topk, validate=False)
    prepared = kernel.experts.prepare_weights(layer.weights)  # the API before kernel.load
    return lambda: kernel(hidden, topk, prepared, validate=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--experts", default="torch_grouped,reference")
    parser.add_argument("--scale", type=int, default=8, help="divide Qwen3-30B-A3B's H and I by this")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(1) if device.type == "cpu" else None  # steadier host numbers on a shared CPU
    print(f"host time of one M=1 forward on {device} ({torch.__version__}), median [p10, p90] of "
          f"{args.calls} calls after {args.warmup}, microseconds")
    print(f"{'experts':<15}{'path':<8}{'median':>9}{'p10':>9}{'p90':>9}")
    for name in args.experts.split(","):
        layer = build_layer(name, args.scale, device)
        gen = torch.Generator().manual_seed(1)
        hidden = torch.randn(1, layer.problem.hidden_size, generator=gen).to(device)
        logits = torch.randn(1, layer.problem.num_experts, generator=gen).to(device)
        paths = {"layer": lambda: layer(hidden, logits), "kernel": kernel_call(layer, hidden, logits)}
        for path, call in paths.items():
            samples = timed(call, device, args.calls, args.warmup)
            p10, *_, p90 = statistics.quantiles(samples, n=10)
            print(f"{name:<15}{path:<8}{statistics.median(samples):>9.1f}{p10:>9.1f}{p90:>9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
