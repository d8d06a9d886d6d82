"""``python -m moe bench``: time Experts backends on model presets against the roofline.

For each preset, scheme and token count M, every chosen backend runs the experts stage (for the
Triton backends that includes the token sort / block alignment and any fp8 activation quantization;
the router's top-k is computed beforehand, outside the timed region) and is timed as the median of
many CUDA-graph replays (eager for backends whose calls do not capture), rotating among several input
sets whose routing differs, after warm-up.

Reported per (backend, M): microseconds, TFLOP/s, GB/s and the fraction of the roofline. The roofline
is the oracle's (`moe.oracle.cost.roofline`: the formulas are in that module's docstring), with the
experts the routing actually hits in place of the number expected for random routing, on the device's
rates measured at the start of the run (`moe.platform.Platform.measure_rates`: a device copy, 8192³
bf16 and fp8 matrix products). So "% of roofline" here and the efficiency the oracle derives from a
measured profile point are one quantity (the oracle's at the preset's rates and expected hits).

``--rounds R`` times each cell's backends in turn R times and reports each one's median round (the rounds go
to ``--json``), so that the clocks' drift under the GPU's power cap reaches them alike; by default each is timed
once, as soon as it is captured.

``--json`` writes every record; ``--save-profile`` writes the per-backend profile the oracle reads
(``moe.tools.bench_report.save_profile``); ``--plot`` draws microseconds and %-roofline against M per
backend. Where a targets file is given or the checkout has ``benchmarks/peer_targets.yaml``, a
peer's times are compared too (``moe.tools.bench_report.load_targets``). When a run times bf16 and a
quantized scheme (``--quant bf16,fp8_block``), a last table sets each quantized cell's fastest backend
against bf16's (``moe.tools.bench_report.format_against_bf16``): where the scheme is slower than bf16.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from collections.abc import Callable, Hashable
from pathlib import Path

import torch

from moe.compose import activation_quant
from moe.errors import MoEConfigError, UnsupportedError
from moe.formats import ActivationFormat, DispatchShape
from moe.oracle.cost import Roofline, roofline
from moe.platform import Platform, median_ms
from moe.prepare_finalize.batched import BatchedPrepareFinalize
from moe.prepare_finalize.local import LocalPrepareFinalize
from moe.presets import load_preset, preset_names
from moe.quant.scheme import SCHEME_NAMES
from moe.registry import experts_classes, get_experts
from moe.synthetic import random_dense
from moe.tools.bench_report import (Ceilings, Record, Targets, format_against_bf16, format_table, format_targets,
                                    load_targets, plot, save_profile, write_json)
from moe.tools.cli_args import comma_separated, int_at_least, one_of
from moe.weights import ExpertWeights
from moe.workspace import WorkspaceManager

DEFAULT_PRESETS = ("qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-120b", "deepseek-v3-ep8-slice")
DEFAULT_TOKENS = (1, 16, 256, 1024, 4096, 16384)
DEFAULT_EXPERTS = ("triton", "torch_grouped")
# the peer targets of a source checkout; an installed package has none, and the bench runs without
CHECKOUT_TARGETS = Path(__file__).resolve().parents[2] / "benchmarks" / "peer_targets.yaml"


# --- timing --------------------------------------------------------------------------------------


def graph_timer(calls: list, graphs: bool, budget_ms: float = 300.0) -> Callable[[], float]:
    """``calls`` (each a no-argument function) warmed up once and, with ``graphs``, captured in one CUDA graph.
    Returns a timer: each call of it times about ``budget_ms`` of repetitions, rotating through ``calls``, and
    gives the median microseconds of one call. Without ``graphs`` it also runs where torch has no CUDA (wall
    clock; benchmarks' CPU smoke runs)."""
    def run_all():
        for call in calls:
            call()

    run_all()  # compile / warm up
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    fn = run_all
    if graphs:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            run_all()  # warm-up on the capture stream, as torch recommends
            with torch.cuda.graph(graph, stream=stream):
                run_all()
        torch.cuda.synchronize()
        fn = graph.replay

    def timed() -> float:
        first = median_ms(fn, 3, warmup=1)
        reps = int(min(2000, max(5, budget_ms / max(first, 1e-3))))
        return median_ms(fn, reps) * 1e3 / len(calls)

    return timed


def time_calls(calls: list, graphs: bool, budget_ms: float = 300.0) -> float:
    """Median microseconds of one call, rotating through ``calls``: one round of `graph_timer`."""
    return graph_timer(calls, graphs, budget_ms)()


def time_in_turns(timers: dict[Hashable, Callable[[], float]], rounds: int) -> dict[Hashable, list[float]]:
    """Each timer's microseconds over ``rounds`` rounds, the timers taking turns within a round (A, B, A, B, ...):
    a drift of the GPU's clocks during the cell (its power cap, say) reaches every backend alike instead of the
    one timed last."""
    times: dict[str, list[float]] = {name: [] for name in timers}
    for _ in range(rounds):
        for name, timer in timers.items():
            times[name].append(timer())
    return times


# --- problems, inputs, traffic -------------------------------------------------------------------


def build_weights(problem, device: torch.device) -> ExpertWeights:
    """Random canonical weights of ``problem`` (`moe.synthetic.random_dense`, seed 0), drawn on ``device``
    in the problem's dtype: a large layer never passes through the host in float32."""
    dense = random_dense(problem, torch.Generator(device=device).manual_seed(0), device, problem.dtype)
    return ExpertWeights.from_dense(**dense, quant=problem.quant, dtype=problem.dtype)


def make_inputs(preset, problem, tokens: int, rotations: int, device: torch.device) -> list:
    """``rotations`` pairs (hidden [M, H], TopK) with independent random routing."""
    router = preset.router(
        torch.zeros(problem.num_experts, device=device) if preset.has_correction_bias else None
    )
    inputs = []
    for _ in range(rotations):
        hidden = torch.randn(tokens, problem.hidden_size, device=device, dtype=problem.dtype)
        inputs.append((hidden, router(torch.randn(tokens, problem.num_experts, device=device))))
    return inputs


def experts_hit(problem, topks: list) -> float:
    """Distinct local experts the routing of each ``TopK`` hits, averaged over ``topks``."""
    to_local = torch.tensor(problem.parallel.global_to_local(problem.num_experts))
    hits = []
    for topk in topks:
        local = to_local[topk.ids.cpu().long()]
        hits.append(local[local >= 0].unique().numel())
    return sum(hits) / len(hits)


def traffic(problem, platform: Platform, topks: list) -> Roofline:
    """The oracle's roofline of one call on ``platform``, for the experts ``topks`` hit (on average)."""
    return roofline(problem, platform, topks[0].num_tokens, hits=experts_hit(problem, topks))


# --- one backend on one case ---------------------------------------------------------------------


def backend_calls(cls, problem, weights, inputs, device, *, experts=None, prepared=None) -> list:
    """No-argument functions, one per input set, that run ``cls``'s experts stage (on ``experts`` and
    its ``prepared`` weights when given: the tuner times one config that way)."""
    tokens = inputs[0][0].shape[0]
    if experts is None:
        experts = cls(problem)
        prepared = experts.prepare_weights(weights)
        experts.warmup(prepared, (tokens,))  # libraries that autotune pick their tactic for this M here
    if ActivationFormat.STANDARD in cls.capabilities.formats:
        prepare = LocalPrepareFinalize(problem)
    else:  # batched: capacity = the largest expert load of these inputs, so buffers stay small
        most = max(int(torch.bincount(t.ids.flatten().long(), minlength=problem.num_experts).max())
                   for _, t in inputs)
        prepare = BatchedPrepareFinalize(problem, max_tokens_per_expert=max(16, -(-most // 16) * 16))
        prepare.load(device)
    manager = WorkspaceManager(device)
    fmt = activation_quant(cls, problem)
    calls = []
    for hidden, topk in inputs:
        pf_ws = WorkspaceManager(device).take(prepare.workspace_shapes(tokens), prepare.name)
        dispatched, _ = prepare.prepare(hidden, topk, fmt, pf_ws)
        shapes = experts.workspace_shapes(DispatchShape(dispatched.format, dispatched.num_rows))
        workspace = manager.take(shapes, experts.name)
        calls.append(lambda d=dispatched, w=workspace: experts.apply(d, prepared, w))
    return calls


def bench_case(preset, quant: str, tokens: int, names: list[str], platform: Platform, device,
               rotations: int, weights_cache: dict, log, targets: Targets | None = None,
               rounds: int = 1) -> list[Record]:
    """Every backend in ``names`` that can serve (preset, quant) on ``platform`` (this GPU, its rates
    measured), at M = ``tokens``. With ``rounds`` > 1 every backend is captured first, then they are timed in
    turns (`time_in_turns`) and each records its median round (its graph and workspace stay allocated through
    the cell); with one round each is timed as soon as it is captured."""
    problem = preset.problem(quant=quant, max_tokens=tokens)
    key = (preset.name, quant)
    if key not in weights_cache:
        weights_cache.clear()  # one layer's weights at a time: they take gigabytes
        weights_cache[key] = build_weights(problem, device)
    weights = weights_cache[key]
    inputs = make_inputs(preset, problem, tokens, rotations, device)
    roof = traffic(problem, platform, [t for _, t in inputs])
    nbytes = roof.weight_bytes + roof.activation_bytes
    timers, graphed, times = {}, {}, {}
    for name in names:
        cls = get_experts(name)
        reasons = cls.check(problem, platform)
        if reasons:
            log(f"  {name}: skipped ({'; '.join(reasons)})")
            continue
        calls = backend_calls(cls, problem, weights, inputs, device)
        graphed[name] = True  # also for classes that do not declare graph safety (allocating, say) but capture
        try:
            timer = graph_timer(calls, graphs=True)
        except RuntimeError as error:
            if cls.capabilities.cuda_graph_safe:
                raise
            log(f"  {name}: does not capture in a CUDA graph ({str(error).splitlines()[0][:100]}); timed eagerly")
            torch.cuda.synchronize()
            graphed[name], timer = False, graph_timer(calls, graphs=False)
        if rounds == 1:
            times[name] = [timer()]
        else:
            timers[name] = timer
    times.update(time_in_turns(timers, rounds))
    records = []
    for name, graphs in graphed.items():
        us = statistics.median(times[name])
        target = targets.time(preset.name, quant, tokens) if targets else None
        records.append(Record(preset.name, quant, tokens, name, us, roof.flops / us * 1e-6, nbytes / us * 1e-3,
                              roof.us, roof.us / us, graphs, target, times[name] if rounds > 1 else None))
    return records


def run_bench(presets, quants, tokens, names, rotations: int = 4, log=print,
              targets: Targets | None = None, rounds: int = 1) -> tuple[Ceilings, list[Record]]:
    device = torch.device("cuda")
    platform = Platform.detect(device).measure_rates(device)
    ceilings = Ceilings.of(platform)
    log(f"{ceilings.device}: {ceilings.bandwidth / 1e12:.2f} TB/s, bf16 {ceilings.bf16_flops / 1e12:.0f} "
        f"TFLOP/s, fp8 {ceilings.fp8_flops / 1e12:.0f} TFLOP/s")
    records, cache = [], {}
    for preset_name in presets:
        preset = load_preset(preset_name)
        for quant in quants:
            for m in tokens:
                rot = rotations if m <= 4096 else 2
                new = bench_case(preset, quant, m, names, platform, device, rot, cache, log, targets, rounds)
                for r in new:
                    spread = f" (median of {min(r.rounds_us):.1f}-{max(r.rounds_us):.1f})" if r.rounds_us else ""
                    log(f"  {r.preset} {r.quant} M={m} {r.experts}: {r.us:.1f} us{spread}, "
                        f"{r.roofline_fraction:.0%} of roofline")
                records += new
    return ceilings, records


# --- command line ----------------------------------------------------------------------------------


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", type=comma_separated(one_of(preset_names(), "preset"), "qwen3-30b-a3b"),
                        default=list(DEFAULT_PRESETS),
                        help="comma-separated preset names (default: " + ", ".join(DEFAULT_PRESETS) + ")")
    parser.add_argument("--quant", type=comma_separated(one_of(SCHEME_NAMES, "scheme"), "bf16,fp8_block"),
                        default=["bf16"], help="comma-separated schemes (default bf16)")
    parser.add_argument("--tokens", type=comma_separated(int_at_least(1), "1,16,256"), default=list(DEFAULT_TOKENS),
                        help="comma-separated token counts M >= 1")
    parser.add_argument("--experts", default=",".join(DEFAULT_EXPERTS),
                        help="comma-separated experts backends, or 'all'")
    parser.add_argument("--rotations", type=int_at_least(1), default=4, help="input sets rotated through (default 4)")
    parser.add_argument("--rounds", type=int_at_least(1), default=1,
                        help="time each cell's backends in turn this many times and report each one's median round "
                             "(default 1; every backend's graph and workspace then stay allocated through the cell)")
    parser.add_argument("--targets", default=None,
                        help="a peer's times to compare against (YAML; default: the checkout's "
                             "benchmarks/peer_targets.yaml where it exists)")
    parser.add_argument("--save-profile", default=None, help="write the oracle's efficiency profile here")
    parser.add_argument("--json", default=None, help="write every record here")
    parser.add_argument("--plot", default=None, help="draw us and %%-roofline vs M here (.png; needs matplotlib)")
    parser.add_argument("--machine", default=None, help="machine kind recorded in --json (e.g. nvidia-h200)")


def _experts_names(text: str) -> list[str]:
    """The backends ``--experts`` names ('all': every registered one); MoEConfigError for unknown ones."""
    known = list(experts_classes())
    names = known if text.strip() == "all" else [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise MoEConfigError(f"--experts: unknown experts backend(s) {unknown or repr(text)}; "
                             f"choose from {', '.join(known)}, or 'all'")
    return names


def _targets(path: str | None) -> Targets | None:
    """The ``--targets`` file, else the checkout's where it exists, else None (no comparison)."""
    if path is None:
        return load_targets(CHECKOUT_TARGETS) if CHECKOUT_TARGETS.is_file() else None
    if not Path(path).is_file():
        raise MoEConfigError(f"--targets {path}: no such file")
    return load_targets(path)


def _check_outputs(args: argparse.Namespace) -> None:
    """Refuses, before any measurement, an output the run could not write at its end."""
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise MoEConfigError(f"--plot {args.plot}: needs matplotlib, which is not installed (pip install matplotlib)")
    for flag, path in (("--json", args.json), ("--save-profile", args.save_profile), ("--plot", args.plot)):
        if path and not Path(path).resolve().parent.is_dir():
            raise MoEConfigError(f"{flag} {path}: the folder {Path(path).resolve().parent} does not exist")


def bench_command(args: argparse.Namespace) -> int:
    names = _experts_names(args.experts)
    targets = _targets(args.targets)
    _check_outputs(args)
    if not torch.cuda.is_available():
        raise UnsupportedError("needs a CUDA GPU, and torch finds none on this machine")
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    ceilings, records = run_bench(args.preset, args.quant, args.tokens, names, args.rotations, log, targets,
                                  args.rounds)
    peer = targets.name if targets else "target"
    print(format_table(records, peer))
    goal = format_targets(records, ceilings, targets) if targets else ""
    if goal:
        print(f"\n## Against {peer} and the baselines ({', '.join(targets.baselines) or 'none'}); "
              "ours: the best backend that is not a baseline" + goal)
    against_bf16 = format_against_bf16(records)
    if against_bf16:
        print("\n## Quantized schemes against bf16 (the fastest backend of each, same run)" + against_bf16)
    if args.json:
        write_json(args.json, ceilings, records, args.machine or ceilings.device)
    if args.save_profile:
        save_profile(args.save_profile, ceilings, records)
    if args.plot:
        plot(args.plot, records, peer)
    return 0
