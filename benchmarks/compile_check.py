"""Eager vs torch.compile vs torch.compile + CUDA graph: one FusedMoE forward, and the recompile count.

    python benchmarks/compile_check.py                      # Qwen3-30B-A3B bf16 on cuda, M = 1, 16, 256
    python benchmarks/compile_check.py --experts triton     # force one experts backend
    python benchmarks/compile_check.py --device cpu --scale 16 --tokens 1,16 --calls 5   # a smoke run

The layer is Qwen3-30B-A3B's (E=128, k=8, H=2048, I=768, softmax renormalized; H and I divided by
``--scale``), bf16 on cuda (float32 on cpu), random weights, ``max_tokens`` = the largest M. For each M:

- ``eager``: ``layer(hidden, router_logits)``;
- ``compiled``: ``torch.compile(layer, fullgraph=True)``, one compile for every M (M marked with
  ``moe.custom_op.mark_tokens_dynamic`` on the first call);
- ``compiled+graph``: that compiled callable captured in a ``torch.cuda.graph`` per M, replayed.

Times are the median of ``--calls`` calls after ``--warmup``, from CUDA events around each call (wall
clock on cpu), in microseconds. Then the recompile count: the graphs dynamo built over all the M
(``torch._dynamo.utils.counters["stats"]["unique_graphs"]``), expected 1, i.e. no recompile.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch._dynamo
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe import FusedMoE  # noqa: E402
from moe.custom_op import mark_tokens_dynamic  # noqa: E402
from moe.presets import load_preset  # noqa: E402
from moe.testing.cuda_checks import capture  # noqa: E402


def build_layer(device: torch.device, scale: int, max_tokens: int, experts: str | None) -> FusedMoE:
    preset = load_preset("qwen3-30b-a3b")
    hidden, inter = preset.hidden_size // scale, preset.intermediate_size // scale
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    layer = FusedMoE(preset.num_experts, preset.top_k, hidden, inter, activation=preset.activation, dtype=dtype,
                     device=device, max_tokens=max_tokens, experts=experts, routing=preset.routing,
                     **dict(preset.routing_options))
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(preset.num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(preset.num_experts, hidden, inter, generator=gen) / inter**0.5
    layer.load_weights(w13=w13.to(device), w2=w2.to(device))
    return layer


def median_us(call: Callable[[], object], device: torch.device, calls: int, warmup: int) -> float:
    for _ in range(warmup):
        call()
    samples = []
    for _ in range(calls):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
        else:
            begin = time.perf_counter()
            call()
            samples.append((time.perf_counter() - begin) * 1e6)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--experts", default=None, help="force one experts backend (default: the plan's)")
    parser.add_argument("--scale", type=int, default=1, help="divide Qwen3-30B-A3B's H and I by this")
    parser.add_argument("--tokens", default="1,16,256")
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args(argv)
    device, token_counts = torch.device(args.device), [int(t) for t in args.tokens.split(",")]
    layer = build_layer(device, args.scale, max(token_counts), args.experts)
    compiled = torch.compile(layer, fullgraph=True)
    torch._dynamo.reset()
    counters.clear()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{layer!r}\non {name}, torch {torch.__version__}; median of {args.calls} calls, microseconds")
    print(f"{'M':>6}{'eager':>12}{'compiled':>12}{'compiled+graph':>16}")
    for i, tokens in enumerate(token_counts):
        x = torch.randn(tokens, layer.problem.hidden_size, device=device).to(layer.problem.dtype)
        logits = torch.randn(tokens, layer.problem.num_experts, device=device)
        if i == 0:
            mark_tokens_dynamic(x, logits)
        times = [median_us(call, device, args.calls, args.warmup)
                 for call in (lambda: layer(x, logits), lambda: compiled(x, logits))]
        replay = capture(lambda: compiled(x, logits))[0].replay if device.type == "cuda" else None
        graph = (f"{median_us(replay, device, args.calls, args.warmup):>16.1f}"
                 if device.type == "cuda" else f"{'-':>16}")
        print(f"{tokens:>6}{times[0]:>12.1f}{times[1]:>12.1f}{graph}")
    graphs = counters["stats"]["unique_graphs"]
    print(f"graphs compiled over M = {args.tokens}: {graphs} (recompiles: {graphs - 1})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
