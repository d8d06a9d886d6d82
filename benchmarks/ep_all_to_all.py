"""Times one MoE layer under expert parallelism over NCCL against the same layer on one GPU, per M.

    python benchmarks/ep_all_to_all.py --preset deepseek-v3 --ep 2 --tokens 16,128,512,1024 \
        --experts torch_grouped,triton,triton_batched --json ep2.json

Every rank holds E/ep experts and M tokens; ``all_to_all`` and ``all_to_all_batched`` move them. For
each (prepare/finalize, experts, M) it reports the median forward time (CUDA events, slowest rank),
the experts' share of it (``apply`` alone on the same dispatched rows), and the time one GPU holding
all E experts takes for the ep x M tokens of all ranks (behind ``local``, or ``batched`` for batched
experts) -- and the relative error of the sharded
output against that unsharded one. Weights are bf16 (the preset's shapes, random values).

Measured 2026-11-22 on nvidia-h200-x2 (2 x H200, NV18), DeepSeek-V3 routed experts (E=256, k=8,
H=7168, I=2048, grouped sigmoid routing), 128 experts per GPU, median of 20, slowest rank:

| experts | prepare/finalize | M per rank | EP2 forward ms | experts ms | comm+glue ms | 1 GPU, 2xM tokens ms |
|---|---|---|---|---|---|---|
| torch_grouped | all_to_all | 16 / 128 / 512 / 1024 | 4.90 / 6.30 / 7.32 / 8.36 | 3.61 / 5.08 / 6.00 / 6.87 | 1.30 / 1.22 / 1.32 / 1.49 | 6.14 / 8.79 / 9.70 / 10.53 |
| triton | all_to_all | 16 / 128 / 512 / 1024 | 3.23 / 3.95 / 5.73 / 6.69 | 1.96 / 3.00 / 3.97 / 5.10 | 1.27 / 0.95 / 1.75 / 1.59 | 4.06 / 5.97 / 7.94 / 9.92 |
| triton_batched | all_to_all_batched | 16 / 128 / 512 / 1024 | 8.17 / 9.41 / 8.82 / 9.89 | 3.06 / 4.35 / 3.78 / 4.72 | 5.12 / 5.06 / 5.03 / 5.17 | 9.05 / 10.00 / 9.81 / 12.60 |

Relative error against one GPU: torch_grouped <= 1.6e-5 (float32 partial sums), triton and triton_batched
2.8e-3 (their partial sums travel in bf16). The batched transport is sized by its capacity, not by M
(max_tokens_per_rank = 1024 here, so every call moves and combines ep x 1024 rows): size it to the
decode batch. Its ~5 ms of glue was not profiled further.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe.tools.bench import build_weights  # noqa: E402
from moe.kernel import ModularKernel  # noqa: E402
from moe.sharding import shard_weights  # noqa: E402
from moe.tools.ep_demo import launch_ranks  # noqa: E402
from moe.platform import Platform, median_ms  # noqa: E402
from moe.formats import ActivationFormat  # noqa: E402
from moe.prepare_finalize.batched import BatchedPrepareFinalize  # noqa: E402
from moe.prepare_finalize.local import LocalPrepareFinalize  # noqa: E402
from moe.presets import load_preset  # noqa: E402
from moe.problem import ParallelConfig  # noqa: E402
from moe.registry import get_experts, get_prepare_finalize  # noqa: E402
from moe.router import TopK  # noqa: E402
from moe.testing import relative_error  # noqa: E402

PREPARE_FINALIZE = ("all_to_all", "all_to_all_batched")


def rank_inputs(preset, problem, tokens: int, world: int, device: str):
    """Every rank's (hidden, TopK), seeded per rank, on this device (the unsharded run needs them all)."""
    router = preset.router(torch.zeros(problem.num_experts, device=device) if preset.has_correction_bias else None)
    inputs = []
    for rank in range(world):
        gen = torch.Generator(device=device).manual_seed(1000 + rank)
        hidden = torch.randn(tokens, problem.hidden_size, device=device, generator=gen).to(problem.dtype)
        inputs.append((hidden, router(torch.randn(tokens, problem.num_experts, device=device, generator=gen))))
    return inputs


def bench_rank(rank: int, world: int, preset_name: str, tokens: list[int], experts_names: list[str],
               device: str = "cuda") -> list[dict]:
    preset = load_preset(preset_name)
    if device == "cpu":  # a smoke run of this script's logic
        preset = preset.scaled(max_hidden=256, max_intermediate=128, max_experts=16)
    full = preset.problem(quant="bf16", max_tokens=max(tokens) * world)
    sharded = dataclasses.replace(full, parallel=ParallelConfig(world, rank), max_tokens=max(tokens))
    weights = build_weights(full, torch.device(device))
    local_weights = shard_weights(weights, sharded)
    records = []
    for name in experts_names:
        cls = get_experts(name)
        if cls.check(sharded, Platform.detect(device)):
            continue
        standard = ActivationFormat.STANDARD in cls.capabilities.formats
        single_pf = LocalPrepareFinalize(full) if standard else BatchedPrepareFinalize(full)
        single = ModularKernel(single_pf, cls(full), device=device)
        single.load(weights)
        for pf_name in PREPARE_FINALIZE:
            pf_cls = get_prepare_finalize(pf_name)
            if pf_cls.format not in cls.capabilities.formats:
                continue
            kernel = ModularKernel(pf_cls(sharded), cls(sharded), device=device)
            kernel.load(local_weights)
            for m in tokens:
                records.append(_measure(rank, world, preset, full, kernel, single, name, pf_name, m, device))
            del kernel
            _free(device)
        del single
        _free(device)
    return records


def _free(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()


def _measure(rank, world, preset, full, kernel, single, name, pf_name, m, device) -> dict:
    inputs = rank_inputs(preset, full, m, world, device)
    hidden, topk = inputs[rank]
    forward = lambda: kernel.forward(hidden, topk, validate=False)  # noqa: E731
    dist.barrier()
    ep_ms = median_ms(forward)
    # the experts' share: apply alone on rows dispatched once (prepare/finalize are collective)
    views = kernel.workspace.take_sections(kernel.workspace_shapes(m))
    dispatched, _ = kernel.prepare_finalize.prepare(hidden, topk, kernel.quantize_to, views["prepare_finalize"])
    prepared = kernel.prepared_weights
    experts_ms = median_ms(lambda: kernel.experts.apply(dispatched, prepared, views["experts"]))
    dist.barrier()
    # one GPU, all experts, every rank's tokens
    all_hidden = torch.cat([h for h, _ in inputs])
    all_topk = TopK(torch.cat([t.ids for _, t in inputs]), torch.cat([t.weights for _, t in inputs]))
    single_ms = median_ms(lambda: single.forward(all_hidden, all_topk, validate=False))
    out = forward()
    truth = single.forward(all_hidden, all_topk, validate=False)[rank * m:(rank + 1) * m]
    return {"experts": name, "prepare_finalize": pf_name, "tokens_per_rank": m, "rank": rank,
            "ep_ms": ep_ms, "experts_ms": experts_ms, "single_gpu_ms": single_ms,
            "relative_error": relative_error(out, truth)}


def summarize(per_rank: list[list[dict]]) -> list[dict]:
    """Slowest rank per (experts, prepare/finalize, M); largest error."""
    rows = []
    for records in zip(*per_rank):
        row = dict(records[0])
        row.pop("rank")
        for key in ("ep_ms", "experts_ms", "single_gpu_ms", "relative_error"):
            row[key] = max(r[key] for r in records)
        rows.append(row)
    return rows


def table(rows: list[dict], world: int) -> str:
    lines = [f"| experts | prepare/finalize | M per rank | EP{world} forward ms | experts ms | comm+glue ms | "
             f"1 GPU, {world}xM tokens ms | rel. error |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['experts']} | {r['prepare_finalize']} | {r['tokens_per_rank']} | {r['ep_ms']:.3f} | "
                     f"{r['experts_ms']:.3f} | {r['ep_ms'] - r['experts_ms']:.3f} | {r['single_gpu_ms']:.3f} | "
                     f"{r['relative_error']:.1e} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="deepseek-v3")
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--tokens", default="16,128,512,1024")
    parser.add_argument("--experts", default="torch_grouped,triton,triton_batched")
    parser.add_argument("--json", default=None)
    parser.add_argument("--timeout", type=float, default=500)
    parser.add_argument("--device", default="cuda", help="cuda (NCCL), or cpu (gloo, scaled preset: a smoke run)")
    args = parser.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    per_rank = launch_ranks(bench_rank, args.ep, (args.preset, tokens, args.experts.split(","), args.device),
                            backend="nccl" if args.device == "cuda" else "gloo", timeout_s=args.timeout)
    rows = summarize(per_rank)
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (scaled preset, smoke run)"
    print(f"{args.preset}, bf16, EP{args.ep} on {where}")
    print(table(rows, args.ep))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
