"""Times one MoE layer under expert parallelism against the same layer on one GPU, per M and transport.

    python benchmarks/ep_all_to_all.py --preset deepseek-v3 --ep 2 --tokens 1,16,64,256,1024 \
        --quant bf16,fp8_block --experts triton,flashinfer_cutlass \
        --json benchmarks/results/ep2_deepseek-v3_nvidia-h200.json --machine nvidia-h200 \
        --save-profile ep2_profile.yaml

Every rank holds E/ep experts and M tokens; ``all_to_all`` and ``all_to_all_batched`` (NCCL) and, on
GPUs with flashinfer installed, ``flashinfer_a2a`` (NVLink) move them. For each (scheme, prepare/finalize,
experts, M) it reports, slowest rank, median of CUDA-event timings: the forward, and inside the same
forwards its dispatch (``prepare``), experts (``apply``) and combine (``finalize``; `PhaseTimer`), the time one GPU holding all E experts takes for the ep x M tokens of all ranks (behind
``local``, or ``batched`` for batched experts), and the relative error of the sharded output against that
unsharded one. Weights are the preset's shapes, random values, in the scheme. No CUDA graphs: the NCCL
transports exchange counts through the host.

``--save-profile`` writes each transport's prepare + finalize time (forward minus experts; the smallest
over the experts backends it ran with) as PrepareFinalize measurements at ``ep_size`` ranks
(`moe.oracle.profile`), which ``benchmarks/make_measured_profile.py`` also reads from a committed
``--json`` file: the oracle's ``plan --ep N`` then ranks the transports per bucket by these times.

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
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe.tools.bench import build_weights  # noqa: E402
from moe.kernel import ModularKernel  # noqa: E402
from moe.oracle.profile import ProfileEntry, save_profile  # noqa: E402
from moe.sharding import shard_weights  # noqa: E402
from moe.tools.ep_demo import launch_ranks  # noqa: E402
from moe.platform import Platform, median_ms, preset_named  # noqa: E402
from moe.formats import ActivationFormat  # noqa: E402
from moe.prepare_finalize.batched import BatchedPrepareFinalize  # noqa: E402
from moe.prepare_finalize.local import LocalPrepareFinalize  # noqa: E402
from moe.presets import load_preset, preset_names  # noqa: E402
from moe.problem import MoEProblem, ParallelConfig  # noqa: E402
from moe.registry import get_experts, get_prepare_finalize  # noqa: E402
from moe.router import TopK  # noqa: E402
from moe.testing import relative_error  # noqa: E402

NCCL_TRANSPORTS = ("all_to_all", "all_to_all_batched")
FLASHINFER_TRANSPORT = "flashinfer_a2a"


def transports(device: str) -> tuple[str, ...]:
    """The prepare/finalize backends to time: FlashInfer's NVLink all-to-all too where it can run."""
    if device == "cuda" and importlib.util.find_spec("flashinfer") is not None:
        import moe.prepare_finalize.flashinfer_a2a  # noqa: F401 -- registers flashinfer_a2a

        return NCCL_TRANSPORTS + (FLASHINFER_TRANSPORT,)
    return NCCL_TRANSPORTS


def rank_inputs(preset, problem, tokens: int, world: int, device: str):
    """Every rank's (hidden, TopK), seeded per rank, on this device (the unsharded run needs them all)."""
    router = preset.router(torch.zeros(problem.num_experts, device=device) if preset.has_correction_bias else None)
    inputs = []
    for rank in range(world):
        gen = torch.Generator(device=device).manual_seed(1000 + rank)
        hidden = torch.randn(tokens, problem.hidden_size, device=device, generator=gen).to(problem.dtype)
        inputs.append((hidden, router(torch.randn(tokens, problem.num_experts, device=device, generator=gen))))
    return inputs


def bench_rank(rank: int, world: int, preset_name: str, quants: list[str], tokens: list[int],
               experts_names: list[str], device: str = "cuda") -> list[dict]:
    preset = load_preset(preset_name)
    if device == "cpu":  # a smoke run of this script's logic
        preset = preset.scaled(max_hidden=256, max_intermediate=128, max_experts=16)
    platform = Platform.detect(device)
    records = []
    for quant in quants:
        full = preset.problem(quant=quant, max_tokens=max(tokens) * world)
        sharded = dataclasses.replace(full, parallel=ParallelConfig(world, rank), max_tokens=max(tokens))
        weights = build_weights(full, torch.device(device))
        local_weights = shard_weights(weights, sharded)
        for name in experts_names:
            cls = get_experts(name)
            if cls.check(sharded, platform) or cls.check(full, platform):
                continue
            standard = ActivationFormat.STANDARD in cls.capabilities.formats
            single_pf = LocalPrepareFinalize(full) if standard else BatchedPrepareFinalize(full)
            single = ModularKernel(single_pf, cls(full), device=device)
            single.load(weights)
            for pf_name in transports(device):
                pf_cls = get_prepare_finalize(pf_name)
                if pf_cls.format not in cls.capabilities.formats or pf_cls.check(sharded, platform):
                    continue
                kernel = ModularKernel(pf_cls(sharded), cls(sharded), device=device)
                kernel.load(local_weights)
                for m in tokens:
                    record = _measure(rank, world, preset, full, kernel, single, m, device)
                    records.append({"preset": preset.name, "shape": _shape(full), "quant": full.quant_name,
                                    "ep": world, "experts": name, "prepare_finalize": pf_name, **record})
                del kernel
                _free(device)
            del single
            _free(device)
    return records


def _shape(problem) -> dict:
    """The layer's sizes, as `MoEProblem.create` takes them (a CPU smoke run's preset is scaled down)."""
    return {"num_experts": problem.num_experts, "top_k": problem.top_k, "hidden_size": problem.hidden_size,
            "intermediate_size": problem.intermediate_size, "activation": problem.activation.name}


def _free(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()


class PhaseTimer:
    """Times the phases inside a kernel's forwards: prepare (dispatch), apply (experts) and finalize (combine),
    each bracketed by CUDA events on a GPU (the wall clock on a CPU). Inside one forward, not by calling a
    phase again: a transport may hold state from prepare to finalize (FlashInfer's MoeAlltoAll asserts that
    dispatch and combine alternate)."""

    PHASES = (("dispatch", "prepare_finalize", "prepare"), ("experts", "experts", "apply"),
              ("combine", "prepare_finalize", "finalize"))

    def __init__(self, kernel: ModularKernel, cuda: bool):
        self.kernel, self.cuda, self.marks = kernel, cuda, []

    def __enter__(self) -> "PhaseTimer":
        for phase, owner, method in self.PHASES:
            obj = getattr(self.kernel, owner)
            setattr(obj, method, self._timed(phase, getattr(obj, method)))
        return self

    def __exit__(self, *exc) -> None:
        for _, owner, method in self.PHASES:
            delattr(getattr(self.kernel, owner), method)  # the instance's wrapper; the class method again

    def _timed(self, phase: str, fn):
        def call(*args, **kwargs):
            start = self._mark()
            result = fn(*args, **kwargs)
            self.marks.append((phase, start, self._mark()))
            return result
        return call

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def medians(self, forward, reps: int = 20, warmup: int = 3) -> dict[str, float]:
        """Median milliseconds of each phase over ``reps`` forwards after ``warmup``."""
        for _ in range(warmup):
            forward()
        self.marks.clear()
        for _ in range(reps):
            forward()
            if self.cuda:
                torch.cuda.synchronize()
        spans = {phase: [] for phase, _, _ in self.PHASES}
        for phase, start, end in self.marks:
            spans[phase].append(start.elapsed_time(end) if self.cuda else 1e3 * (end - start))
        return {f"{phase}_ms": statistics.median(times) for phase, times in spans.items()}


def _measure(rank, world, preset, full, kernel, single, m, device) -> dict:
    inputs = rank_inputs(preset, full, m, world, device)
    hidden, topk = inputs[rank]
    forward = lambda: kernel.forward(hidden, topk, validate=False)  # noqa: E731
    dist.barrier()
    ep_ms = median_ms(forward)
    dist.barrier()
    with PhaseTimer(kernel, device == "cuda") as timer:  # collective phases: every rank runs the same forwards
        phases = timer.medians(forward)
    dist.barrier()
    # one GPU, all experts, every rank's tokens
    all_hidden = torch.cat([h for h, _ in inputs])
    all_topk = TopK(torch.cat([t.ids for _, t in inputs]), torch.cat([t.weights for _, t in inputs]))
    single_ms = median_ms(lambda: single.forward(all_hidden, all_topk, validate=False))
    out = forward()
    truth = single.forward(all_hidden, all_topk, validate=False)[rank * m:(rank + 1) * m]
    return {"tokens_per_rank": m, "rank": rank, "ep_ms": ep_ms, **phases, "single_gpu_ms": single_ms,
            "relative_error": relative_error(out, truth)}


TIMES = ("ep_ms", "dispatch_ms", "experts_ms", "combine_ms", "single_gpu_ms", "relative_error")


def summarize(per_rank: list[list[dict]]) -> list[dict]:
    """Slowest rank per (scheme, experts, prepare/finalize, M) and phase; largest error."""
    rows = []
    for records in zip(*per_rank):
        row = {k: v for k, v in records[0].items() if k != "rank"}
        row.update({key: max(r[key] for r in records) for key in TIMES})
        rows.append(row)
    return rows


def table(rows: list[dict], world: int) -> str:
    lines = [f"| scheme | experts | prepare/finalize | M per rank | EP{world} forward ms | dispatch ms | experts ms | "
             f"combine ms | 1 GPU, {world}xM tokens ms | rel. error |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['quant']} | {r['experts']} | {r['prepare_finalize']} | {r['tokens_per_rank']} | "
                     f"{r['ep_ms']:.3f} | {r['dispatch_ms']:.3f} | {r['experts_ms']:.3f} | {r['combine_ms']:.3f} | "
                     f"{r['single_gpu_ms']:.3f} | {r['relative_error']:.1e} |")
    return "\n".join(lines)


def transport_entries(rows: list[dict], platform: Platform, note: str = "") -> list[ProfileEntry]:
    """Each transport's prepare + finalize time per (scheme, preset, ranks, M) as a PrepareFinalize
    measurement: forward minus experts, the smallest over the experts backends it ran with (the transport's
    own cost; a slower experts backend's tail would only add its wait to it)."""
    best: dict[tuple, float] = {}
    for r in rows:
        key = (r["prepare_finalize"], r["quant"], r["preset"], tuple(sorted(r["shape"].items())), r["ep"],
               r["tokens_per_rank"])
        us = 1000.0 * max(r["ep_ms"] - r["experts_ms"], 1e-3)
        best[key] = min(best.get(key, us), us)
    entries = []
    for (pf_name, quant, preset, shape, ep, m), us in best.items():
        problem = MoEProblem.create(**dict(shape), quant=quant, max_tokens=m, parallel=ParallelConfig(ep))
        label = preset if preset in preset_names() else None  # a scaled smoke-run preset: its sizes instead
        entries.append(ProfileEntry.measurement(pf_name, platform, problem, m, us, preset=label, note=note,
                                                parallel=True))
    return entries


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="deepseek-v3")
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--quant", default="bf16", help="comma-separated schemes")
    parser.add_argument("--tokens", default="16,128,512,1024")
    parser.add_argument("--experts", default="torch_grouped,triton,triton_batched")
    parser.add_argument("--json", default=None)
    parser.add_argument("--machine", default=None, help="machine kind recorded in --json (e.g. nvidia-h200-x2)")
    parser.add_argument("--save-profile", default=None, help="write the transports' times as oracle measurements")
    parser.add_argument("--timeout", type=float, default=500)
    parser.add_argument("--device", default="cuda", help="cuda (NCCL), or cpu (gloo, scaled preset: a smoke run)")
    args = parser.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    run = (args.preset, args.quant.split(","), tokens, args.experts.split(","), args.device)
    per_rank = launch_ranks(bench_rank, args.ep, run, backend="nccl" if args.device == "cuda" else "gloo",
                            timeout_s=args.timeout)
    rows = summarize(per_rank)
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (scaled preset, smoke run)"
    print(f"{args.preset}, EP{args.ep} on {where}")
    print(table(rows, args.ep))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": args.machine, "device": where, "ep": args.ep,
                                               "records": rows}, indent=1))
    if args.save_profile:
        platform = Platform.detect(args.device)
        if args.device == "cuda" and preset_named(platform.name):
            platform = Platform.preset(preset_named(platform.name))  # named as the oracle's presets are
        save_profile(args.save_profile, transport_entries(rows, platform, note=args.json or ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
