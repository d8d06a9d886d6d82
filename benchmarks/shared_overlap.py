"""Shared experts overlapped with the routed experts on a second CUDA stream: what the overlap saves.

    python benchmarks/shared_overlap.py                       # DeepSeek-V3 EP8 slice, bf16, on cuda
    python benchmarks/shared_overlap.py --experts triton --tokens 1 64 4096 --no-graphs

The layer is one GPU's slice of DeepSeek-V3 under EP8 (preset ``deepseek-v3-ep8-slice``: 32 experts,
k=8, H=7168, I=2048) with the model's one shared expert (I=2048, SiLU), random bf16 weights and random
router logits. For each M it times, as the median of ``--reps`` timed runs after ``--warmup``:

- ``overlapped``: ``FusedMoE(..., shared_experts=...)(hidden, logits)`` -- shared MLP on the second stream;
- ``routed``:     the same layer without shared experts (router, prepare, experts, finalize);
- ``shared``:     the shared MLP alone;
- ``sequential``: the shared MLP, then the routed layer adding it (``shared_output=``), one stream.

Each callable is captured in a CUDA graph and replayed (``--no-graphs``: called eagerly), timed with CUDA
events around each replay. ``saved`` is sequential - overlapped; ``vs max`` is overlapped / max(routed,
shared), 1.0 for a perfect overlap. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe import FusedMoE  # noqa: E402
from moe.presets import load_preset  # noqa: E402

TOKENS = (1, 16, 64, 256, 1024, 4096)


def build(args: argparse.Namespace) -> tuple[FusedMoE, FusedMoE]:
    """The layer with its shared experts and the same routed layer without them, on the same weights."""
    preset = load_preset(args.preset)
    config = preset.shared_experts()
    if config is None:
        raise SystemExit(f"preset {args.preset} has no shared experts")

    def layer(shared):
        return FusedMoE(preset.num_experts, preset.top_k, preset.hidden_size, preset.intermediate_size,
                        activation=preset.activation, quant="bf16", dtype=torch.bfloat16, device="cuda",
                        max_tokens=max(args.tokens), experts=args.experts, routing=preset.routing,
                        shared_experts=shared, **preset.router_options())

    with_shared, routed = layer(config), layer(None)
    e, h, i, s = preset.num_experts, preset.hidden_size, preset.intermediate_size, config.intermediate_size
    w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16) / h**0.5
    w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16) / i**0.5
    for target in (with_shared, routed):
        target.load_weights(w13=w13, w2=w2)
    del w13, w2
    with_shared.shared_experts.load_weights(w13=torch.randn(2 * s, h, device="cuda") / h**0.5,
                                            w2=torch.randn(h, s, device="cuda") / s**0.5)
    return with_shared, routed


def median_us(call: Callable[[], object], reps: int, warmup: int, graphs: bool) -> float:
    """Median microseconds of one run of ``call`` (a graph replay, or an eager call), by CUDA events."""
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    run = call
    if graphs:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        run = graph.replay
        run()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return statistics.median(samples)


def measure(with_shared: FusedMoE, routed: FusedMoE, tokens: int, args: argparse.Namespace) -> dict[str, float]:
    hidden = torch.randn(tokens, with_shared.problem.hidden_size, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(tokens, with_shared.problem.num_experts, device="cuda")
    shared = with_shared.shared_experts
    calls = {
        "overlapped": lambda: with_shared(hidden, logits),
        "routed": lambda: routed(hidden, logits),
        "shared": lambda: shared(hidden),
        "sequential": lambda: routed(hidden, logits, shared_output=shared(hidden)),
    }
    torch.testing.assert_close(calls["overlapped"]().float(), calls["sequential"]().float(), rtol=2e-2, atol=2e-2)
    return {name: median_us(call, args.reps, args.warmup, not args.no_graphs) for name, call in calls.items()}


def table(rows: dict[int, dict[str, float]]) -> str:
    lines = ["| M | overlapped us | routed us | shared us | sequential us | saved us | vs max |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for tokens, t in rows.items():
        lines.append(f"| {tokens} | {t['overlapped']:.1f} | {t['routed']:.1f} | {t['shared']:.1f} | "
                     f"{t['sequential']:.1f} | {t['sequential'] - t['overlapped']:.1f} | "
                     f"{t['overlapped'] / max(t['routed'], t['shared']):.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="deepseek-v3-ep8-slice")
    parser.add_argument("--experts", default=None, help="force an experts backend (default: the oracle's)")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--no-graphs", action="store_true", help="time eager calls instead of graph replays")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU: the overlap is a second CUDA stream")
    with_shared, routed = build(args)
    rows = {tokens: measure(with_shared, routed, tokens, args) for tokens in sorted(args.tokens)}
    device = torch.cuda.get_device_name()
    kernels = ", ".join(sorted({str(k) for k in with_shared.kernels.values()}))
    print(f"{args.preset} + shared experts I={with_shared.shared_experts.intermediate_size}, bf16, {device}, "
          f"{kernels}, {'CUDA graph replays' if not args.no_graphs else 'eager calls'}, median of {args.reps}\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
