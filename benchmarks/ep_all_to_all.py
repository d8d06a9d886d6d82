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
unsharded one. Weights are the preset's shapes, random values, in the scheme. Where the transport and the
experts capture in a CUDA graph (``flashinfer_a2a``, ``all_to_all_batched``; not ``all_to_all``, which reads
its counts on the host) the whole forward is also timed as a graph replay, as are the experts' apply alone and
the one-GPU layer.

``--save-profile`` writes each transport's prepare + finalize time (forward minus experts, graph replays
where they capture; the smallest over the experts backends it ran with, `transport_entries`) as PrepareFinalize
measurements at ``ep_size`` ranks
(`moe.oracle.profile`), which ``benchmarks/make_measured_profile.py`` also reads from a committed
``--json`` file: the oracle's ``plan --ep N`` then ranks the transports per bucket by these times.

Measured 2026-11-28 on nvidia-h200-x2 (2 x H200, NV18), slowest rank, median of 20; everything in
results/ep2_nvidia-h200-x2.md. DeepSeek-V3 bf16, triton experts, 128 experts per GPU, ms:

| M per rank | flashinfer_a2a graph | its experts (graph) | all_to_all eager | 1 GPU, 2xM tokens, graph |
|---|---|---|---|---|
| 1 | 0.295 | 0.265 | 1.000 | 0.343 |
| 16 | 1.711 | 1.681 | 2.764 | 3.254 |
| 1024 | 4.579 | 4.463 | 5.547 | 8.811 |
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


def graph_ms(forward, *, collective: bool) -> float:
    """Median milliseconds of one replay of ``forward`` captured in a CUDA graph (warmed up on the capture
    stream first). ``collective``: every rank captures and replays the same forward, in step."""
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()
        with torch.cuda.graph(graph, stream=stream):
            forward()
    torch.cuda.synchronize()
    if collective:
        dist.barrier()
    return median_ms(graph.replay)


def _experts_graph_ms(kernel: ModularKernel, forward) -> float:
    """The experts' apply alone as a CUDA-graph replay, on the rows one forward dispatched to this rank: the
    experts' own GPU time, without the host gaps between their launches that the eager phase holds."""
    experts, kept = kernel.experts, {}
    apply = experts.apply

    def keep(*args, **kwargs):
        kept.update(args=args, kwargs=kwargs)
        return apply(*args, **kwargs)

    experts.apply = keep  # an instance attribute over the class's method, for one forward (every rank's)
    try:
        forward()
    finally:
        del experts.apply
    return graph_ms(lambda: apply(*kept["args"], **kept["kwargs"]), collective=False)


def _captures(kernel: ModularKernel) -> bool:
    """Whether the kernel's forward can be timed as a CUDA-graph replay."""
    return kernel.prepare_finalize.captures_in_cuda_graph and kernel.experts.capabilities.cuda_graph_safe


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
    cuda = device == "cuda"
    ep_graph_ms = graph_ms(forward, collective=True) if cuda and _captures(kernel) else None
    dist.barrier()
    experts_graph_ms = _experts_graph_ms(kernel, forward) if cuda and kernel.experts.capabilities.cuda_graph_safe \
        else None
    dist.barrier()
    # one GPU, all experts, every rank's tokens
    all_hidden = torch.cat([h for h, _ in inputs])
    all_topk = TopK(torch.cat([t.ids for _, t in inputs]), torch.cat([t.weights for _, t in inputs]))
    single_forward = lambda: single.forward(all_hidden, all_topk, validate=False)  # noqa: E731
    single_ms = median_ms(single_forward)
    single_graph_ms = graph_ms(single_forward, collective=False) if cuda and _captures(single) else None
    out = forward()
    truth = single.forward(all_hidden, all_topk, validate=False)[rank * m:(rank + 1) * m]
    return {"tokens_per_rank": m, "rank": rank, "ep_ms": ep_ms, **phases, "ep_graph_ms": ep_graph_ms,
            "experts_graph_ms": experts_graph_ms,
            "single_gpu_ms": single_ms, "single_gpu_graph_ms": single_graph_ms,
            "relative_error": relative_error(out, truth)}


TIMES = ("ep_ms", "dispatch_ms", "experts_ms", "combine_ms", "ep_graph_ms", "experts_graph_ms", "single_gpu_ms",
         "single_gpu_graph_ms", "relative_error")


def summarize(per_rank: list[list[dict]]) -> list[dict]:
    """Slowest rank per (scheme, experts, prepare/finalize, M) and phase; largest error. A time no rank took
    (no CUDA graph) stays None."""
    rows = []
    for records in zip(*per_rank):
        row = {k: v for k, v in records[0].items() if k != "rank"}
        for key in TIMES:
            values = [r.get(key) for r in records]
            row[key] = None if None in values else max(values)
        rows.append(row)
    return rows


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def table(rows: list[dict], world: int) -> str:
    lines = [f"| scheme | experts | prepare/finalize | M per rank | EP{world} forward ms | dispatch ms | experts ms | "
             f"combine ms | EP{world} graph ms | experts graph ms | 1 GPU, {world}xM tokens ms | 1 GPU graph ms | "
             "rel. error |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['quant']} | {r['experts']} | {r['prepare_finalize']} | {r['tokens_per_rank']} | "
                     f"{r['ep_ms']:.3f} | {r['dispatch_ms']:.3f} | {r['experts_ms']:.3f} | {r['combine_ms']:.3f} | "
                     f"{_ms(r.get('ep_graph_ms'))} | {_ms(r.get('experts_graph_ms'))} | {r['single_gpu_ms']:.3f} | "
                     f"{_ms(r.get('single_gpu_graph_ms'))} | "
                     f"{r['relative_error']:.1e} |")
    return "\n".join(lines)


def transport_entries(rows: list[dict], platform: Platform, note: str = "") -> list[ProfileEntry]:
    """Each transport's prepare + finalize time per (scheme, preset, ranks, M) as a PrepareFinalize
    measurement: forward minus experts, the smallest over the experts backends it ran with (the transport's
    own cost; a slower experts backend's tail would only add its wait to it). The forward is the CUDA-graph
    replay where the transport captures (as an engine runs decode), the eager call otherwise; the experts
    are their apply alone as a graph replay where they capture (what the oracle's experts measurements
    time), the eager phase otherwise."""
    best: dict[tuple, float] = {}
    for r in rows:
        key = (r["prepare_finalize"], r["quant"], r["preset"], tuple(sorted(r["shape"].items())), r["ep"],
               r["tokens_per_rank"])
        forward = r["ep_graph_ms"] if r.get("ep_graph_ms") is not None else r["ep_ms"]
        experts = r["experts_graph_ms"] if r.get("experts_graph_ms") is not None else r["experts_ms"]
        us = 1000.0 * max(forward - experts, 1e-3)
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
