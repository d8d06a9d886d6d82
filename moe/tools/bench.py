"""``python -m moe bench``: time Experts backends on model presets against the roofline.

For each preset, scheme and token count M, every chosen backend runs the experts stage (for the
Triton backends that includes the token sort / block alignment and any fp8 activation quantization;
the router's top-k is computed beforehand, outside the timed region) and is timed as the median of
many CUDA-graph replays (eager for backends whose calls do not capture), rotating among several input
sets whose routing differs, after warm-up.

Reported per (backend, M): microseconds, TFLOP/s, GB/s and the fraction of the roofline
``max(bytes / bandwidth, FLOPs / peak)``, where bytes = the weights (and scales) of the experts the
routing actually hits + activations in and out, FLOPs = 2 M k (H R + I H) with R = w13 rows, and
bandwidth and peak are measured at the start of the run (a device copy; an 8192^3 bf16 and, for fp8
schemes, fp8 matrix product).

``--json`` writes every record; ``--save-profile`` writes the per-backend efficiency profile the
oracle reads (``{"device", "ceilings", "entries": [{"experts", "quant", "preset", "tokens", "us",
"roofline_fraction"}]}``); ``--plot`` draws microseconds and %-roofline against M per backend.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from moe.errors import MoEConfigError, UnsupportedError

DEFAULT_PRESETS = ("qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-120b", "deepseek-v3-ep8-slice")
DEFAULT_TOKENS = (1, 16, 256, 1024, 4096, 16384)
DEFAULT_EXPERTS = ("triton", "torch_grouped")

# vLLM's fused MoE Triton kernel on an H200, bf16, tuned configs, CUDA graphs, routing and alignment
# outside the timed region (microseconds, measured by a teammate on an H200). Compared in the table when quant is bf16.
VLLM_H200_BF16_US = {
    "qwen3-30b-a3b": {1: 35.8, 16: 204.6, 256: 334.4, 1024: 410.4, 4096: 923.4, 16384: 3052.7},
    "mixtral-8x7b": {1: 189.5, 16: 663.0, 256: 791.0, 1024: 1760.6, 4096: 5524.6, 16384: 21891.4},
    "gpt-oss-120b": {1: 71.8, 16: 623.7, 256: 2338.3, 1024: 2732.4, 4096: 4259.9, 16384: 13999.4},
    "deepseek-v3-ep8-slice": {1: 204.8, 16: 704.4, 256: 1391.5, 1024: 3162.2, 4096: 12189.4, 16384: 44330.9},
}


@dataclass(frozen=True)
class Ceilings:
    """Measured at the start of a run on the device."""

    device: str
    bandwidth: float  # bytes/s, device-to-device copy (read + write)
    bf16_flops: float  # FLOP/s, bf16 matrix product
    fp8_flops: float  # FLOP/s, e4m3 matrix product (bf16_flops where unmeasurable)


@dataclass(frozen=True)
class Record:
    preset: str
    quant: str
    tokens: int
    experts: str
    us: float
    tflops: float
    gbps: float
    roofline_us: float
    roofline_fraction: float
    graphs: bool  # timed with CUDA graphs
    vllm_us: float | None = None  # the target table's vLLM time, where it applies


# --- ceilings and timing ---------------------------------------------------------------------------


def median_ms(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` after ``warmup`` calls: CUDA events on a GPU, the wall clock
    otherwise (CPU smoke runs of the benchmark scripts)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if not torch.cuda.is_available():
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure_ceilings(device: torch.device) -> Ceilings:
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() / (median_ms(lambda: dst.copy_(src), 20) * 1e-3)
    del src, dst
    n = 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    bf16 = 2 * n**3 / (median_ms(lambda: a @ b, 10) * 1e-3)
    fp8 = bf16
    if hasattr(torch, "_scaled_mm"):
        try:
            a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()
            one = torch.ones((), device=device)
            fp8 = 2 * n**3 / (median_ms(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16), 10) * 1e-3)
        except (RuntimeError, TypeError):  # no fp8 matrix product on this GPU / torch build
            pass
    return Ceilings(torch.cuda.get_device_name(device), bandwidth, bf16, fp8)


def time_calls(calls: list, graphs: bool, budget_ms: float = 300.0) -> float:
    """Median microseconds of one call, rotating through ``calls`` (each a no-argument function);
    about ``budget_ms`` of timed repetitions."""
    def run_all():
        for call in calls:
            call()

    run_all()  # compile / warm up
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
    first = median_ms(fn, 3, warmup=1)
    reps = int(min(2000, max(5, budget_ms / max(first, 1e-3))))
    return median_ms(fn, reps) * 1e3 / len(calls)


# --- problems, inputs, traffic -------------------------------------------------------------------


def build_weights(problem, device: torch.device):
    """Random canonical weights of ``problem`` (`moe.synthetic.random_dense`, seed 0), drawn on ``device``
    in the problem's dtype: a large layer never passes through the host in float32."""
    from moe.synthetic import random_dense
    from moe.weights import ExpertWeights

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


def traffic(problem, weights, topks: list) -> tuple[float, float]:
    """Average (bytes, FLOPs) of one call over the rotations; see the module docstring."""
    def nbytes(q):
        return q.data.nbytes + (q.scale.nbytes if q.scale is not None else 0)

    per_expert = (nbytes(weights.w13) + nbytes(weights.w2)) / weights.num_experts
    if weights.b13 is not None:
        per_expert += (weights.b13.nbytes + weights.b2.nbytes) / weights.num_experts
    to_local = torch.tensor(problem.parallel.global_to_local(problem.num_experts))
    act_bytes = torch.finfo(problem.dtype).bits // 8
    total = 0.0
    for topk in topks:
        local = to_local[topk.ids.cpu().long()]
        hit = local[local >= 0].unique().numel()
        total += hit * per_expert + 2 * topk.num_tokens * problem.hidden_size * act_bytes
    tokens = topks[0].num_tokens
    flops = 2.0 * tokens * problem.top_k * problem.hidden_size * (problem.w13_rows + problem.intermediate_size)
    return total / len(topks), flops


# --- one backend on one case ---------------------------------------------------------------------


def backend_calls(cls, problem, weights, inputs, device, *, experts=None, prepared=None) -> list:
    """No-argument functions, one per input set, that run ``cls``'s experts stage (on ``experts`` and
    its ``prepared`` weights when given: the tuner times one config that way)."""
    from moe.formats import ActivationFormat, DispatchShape
    from moe.kernel import activation_quant
    from moe.prepare_finalize.batched import BatchedPrepareFinalize
    from moe.prepare_finalize.local import LocalPrepareFinalize
    from moe.workspace import WorkspaceManager

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
    manager = WorkspaceManager(device)
    fmt = activation_quant(experts)
    calls = []
    for hidden, topk in inputs:
        pf_ws = WorkspaceManager(device).take(prepare.workspace_shapes(tokens), prepare.name)
        dispatched = prepare.prepare(hidden, topk, fmt, pf_ws)
        shapes = experts.workspace_shapes(DispatchShape(dispatched.format, dispatched.num_rows))
        workspace = manager.take(shapes, experts.name)
        calls.append(lambda d=dispatched, w=workspace: experts.apply(d, prepared, w))
    return calls


def bench_case(preset, quant: str, tokens: int, names: list[str], ceilings: Ceilings, device,
               rotations: int, weights_cache: dict, log) -> list[Record]:
    """Every backend in ``names`` that can serve (preset, quant) on this GPU, at M = ``tokens``."""
    from moe.platform import Platform
    from moe.registry import get_experts

    problem = preset.problem(quant=quant, max_tokens=tokens)
    key = (preset.name, quant)
    if key not in weights_cache:
        weights_cache.clear()  # one layer's weights at a time: they take gigabytes
        weights_cache[key] = build_weights(problem, device)
    weights = weights_cache[key]
    inputs = make_inputs(preset, problem, tokens, rotations, device)
    nbytes, flops = traffic(problem, weights, [t for _, t in inputs])
    peak = ceilings.fp8_flops if problem.quant.activation.value.startswith("fp8") else ceilings.bf16_flops
    roofline_us = max(nbytes / ceilings.bandwidth, flops / peak) * 1e6
    platform = Platform.detect(device)
    records = []
    for name in names:
        cls = get_experts(name)
        reasons = cls.check(problem, platform)
        if reasons:
            log(f"  {name}: skipped ({'; '.join(reasons)})")
            continue
        calls = backend_calls(cls, problem, weights, inputs, device)
        graphs = True  # also for classes that do not declare graph safety (allocating, say) but capture
        try:
            us = time_calls(calls, graphs=True)
        except RuntimeError as error:
            if cls.capabilities.cuda_graph_safe:
                raise
            log(f"  {name}: does not capture in a CUDA graph ({str(error).splitlines()[0][:100]}); timed eagerly")
            torch.cuda.synchronize()
            graphs, us = False, time_calls(calls, graphs=False)
        vllm = VLLM_H200_BF16_US.get(preset.name, {}).get(tokens) if quant == "bf16" else None
        records.append(Record(preset.name, quant, tokens, name, us, flops / us * 1e-6, nbytes / us * 1e-3,
                              roofline_us, roofline_us / us, graphs, vllm))
    return records


def run_bench(presets, quants, tokens, names, rotations: int = 4, log=print) -> tuple[Ceilings, list[Record]]:
    import moe.experts.triton  # noqa: F401 -- registers the Triton experts even where moe.experts does not
    import moe.experts.triton_batched  # noqa: F401
    from moe.presets import load_preset

    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    log(f"{ceilings.device}: {ceilings.bandwidth / 1e12:.2f} TB/s, bf16 {ceilings.bf16_flops / 1e12:.0f} "
        f"TFLOP/s, fp8 {ceilings.fp8_flops / 1e12:.0f} TFLOP/s")
    records, cache = [], {}
    for preset_name in presets:
        preset = load_preset(preset_name)
        for quant in quants:
            for m in tokens:
                rot = rotations if m <= 4096 else 2
                new = bench_case(preset, quant, m, names, ceilings, device, rot, cache, log)
                for r in new:
                    log(f"  {r.preset} {r.quant} M={m} {r.experts}: {r.us:.1f} us, "
                        f"{r.roofline_fraction:.0%} of roofline")
                records += new
    return ceilings, records


# --- output ----------------------------------------------------------------------------------------


PEERS = ("torch_grouped",)  # the baselines we must beat; every other backend is "ours"


def format_table(records: list[Record]) -> str:
    """One markdown table per (preset, quant): backends side by side, vLLM target where known."""
    lines = []
    groups = sorted({(r.preset, r.quant) for r in records}, key=lambda g: (g[0], g[1]))
    for preset, quant in groups:
        rows = [r for r in records if (r.preset, r.quant) == (preset, quant)]
        names = list(dict.fromkeys(r.experts for r in rows))
        lines += ["", f"### {preset} {quant}", ""]
        head = "| M | " + " | ".join(f"{n} us | {n} TF/s | {n} GB/s | {n} %roof" for n in names)
        has_vllm = any(r.vllm_us for r in rows)
        head += " | vLLM us |" if has_vllm else " |"
        lines += [head, "|" + "---|" * (head.count("|") - 1)]
        for m in sorted({r.tokens for r in rows}):
            by_name = {r.experts: r for r in rows if r.tokens == m}
            cells = []
            for n in names:
                r = by_name.get(n)
                cells.append(f"{r.us:.1f} | {r.tflops:.1f} | {r.gbps:.0f} | {r.roofline_fraction:.0%}" if r else "- | - | - | -")
            vllm = next((r.vllm_us for r in by_name.values() if r.vllm_us), None)
            lines.append(f"| {m} | " + " | ".join(cells) + (f" | {vllm or '-'} |" if has_vllm else " |"))
    return "\n".join(lines)


def format_targets(records: list[Record], ceilings: Ceilings, speedup: float = 1.1, match_at: float = 0.9) -> str:
    """Issue 4's goal, cell by cell: our best backend (any but the `PEERS`) against the better of
    the peers (vLLM's table and the measured baselines) -- ``speedup`` times faster, or as fast where
    that peer already runs at ``match_at`` of the roofline -- and where each of ours stands."""
    lines = []
    for preset in sorted({r.preset for r in records if r.vllm_us}):
        rows = [r for r in records if r.preset == preset and r.vllm_us]
        lines += ["", f"### {preset} {rows[0].quant}", "",
                  "| M | ours us (backend) | vLLM us (its %roof) | baseline us | need <= | vs best peer "
                  "| ours %roof | ours % of peak | met |", "|---|---|---|---|---|---|---|---|---|"]
        for m in sorted({r.tokens for r in rows}):
            cell = [r for r in rows if r.tokens == m]
            ours = min((r for r in cell if r.experts not in PEERS), key=lambda r: r.us, default=None)
            baseline = min((r.us for r in cell if r.experts in PEERS), default=None)
            vllm = cell[0].vllm_us
            vllm_roof = cell[0].roofline_us / vllm
            best_peer = min(vllm, baseline or vllm)
            match = best_peer == vllm and vllm_roof >= match_at
            need = best_peer if match else best_peer / speedup
            if ours is None:
                continue
            met = "yes" + (" (match)" if match else "") if ours.us <= need else "no"
            lines.append(
                f"| {m} | {ours.us:.1f} ({ours.experts}) | {vllm} ({vllm_roof:.0%}) | "
                f"{f'{baseline:.1f}' if baseline else '-'} | {need:.1f} | {best_peer / ours.us:.2f}x | "
                f"{ours.roofline_fraction:.0%} | {ours.tflops * 1e12 / ceilings.bf16_flops:.0%} | {met} |")
    return "\n".join(lines)


def write_json(path: str, ceilings: Ceilings, records: list[Record], machine: str) -> None:
    data = {"machine": machine, "ceilings": asdict(ceilings), "records": [asdict(r) for r in records]}
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def save_profile(path: str, ceilings: Ceilings, records: list[Record]) -> None:
    """Writes the measurements in the oracle's profile format (moe/oracle/profile.py), merged into
    ``path`` if it exists; the oracle reads it through ``MOE_PROFILE=path`` or a policy's ``profiles``."""
    from moe.oracle.profile import ProfileEntry
    from moe.oracle.profile import save_profile as write_profile
    from moe.platform import Platform
    from moe.presets import load_preset

    platform = Platform.detect()
    entries = [
        ProfileEntry.measurement(r.experts, platform, load_preset(r.preset).problem(quant=r.quant, max_tokens=r.tokens),
                                 r.tokens, r.us, preset=r.preset,
                                 note=f"{r.roofline_fraction:.0%} of roofline on {ceilings.device}")
        for r in records
    ]
    write_profile(path, entries, description=f"measured by python -m moe bench on {ceilings.device}")


def plot(path: str, records: list[Record]) -> None:
    """Microseconds (log-log) and %-roofline against M, one column per (preset, quant)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r.preset, r.quant) for r in records})
    fig, axes = plt.subplots(2, len(groups), figsize=(4.5 * len(groups), 7), squeeze=False)
    for col, (preset, quant) in enumerate(groups):
        rows = [r for r in records if (r.preset, r.quant) == (preset, quant)]
        for name in dict.fromkeys(r.experts for r in rows):
            mine = sorted((r for r in rows if r.experts == name), key=lambda r: r.tokens)
            ms = [r.tokens for r in mine]
            axes[0][col].loglog(ms, [r.us for r in mine], "o-", label=name)
            axes[1][col].semilogx(ms, [100 * r.roofline_fraction for r in mine], "o-", label=name)
        vllm = sorted((r.tokens, r.vllm_us) for r in rows if r.vllm_us and r.experts == rows[0].experts)
        if vllm:
            axes[0][col].loglog(*zip(*vllm), "k--", label="vLLM (target table)")
        axes[0][col].set_title(f"{preset} {quant}", fontsize=9)
        axes[0][col].set_ylabel("us")
        axes[1][col].set_ylabel("% of roofline")
        axes[1][col].set_xlabel("tokens M")
        axes[1][col].set_ylim(0, max(105, 5 + max(100 * r.roofline_fraction for r in rows)))
        axes[0][col].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# --- command line ----------------------------------------------------------------------------------


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    from moe.tools.cli_args import comma_separated, int_at_least, one_of
    from moe.presets import preset_names
    from moe.quant.scheme import SCHEME_NAMES

    parser.add_argument("--preset", type=comma_separated(one_of(preset_names(), "preset"), "qwen3-30b-a3b"),
                        default=list(DEFAULT_PRESETS),
                        help="comma-separated preset names (default: the four target presets)")
    parser.add_argument("--quant", type=comma_separated(one_of(SCHEME_NAMES, "scheme"), "bf16,fp8_block"),
                        default=["bf16"], help="comma-separated schemes (default bf16)")
    parser.add_argument("--tokens", type=comma_separated(int_at_least(1), "1,16,256"), default=list(DEFAULT_TOKENS),
                        help="comma-separated token counts M >= 1")
    parser.add_argument("--experts", default=",".join(DEFAULT_EXPERTS),
                        help="comma-separated experts backends, or 'all'")
    parser.add_argument("--rotations", type=int_at_least(1), default=4, help="input sets rotated through (default 4)")
    parser.add_argument("--save-profile", default=None, help="write the oracle's efficiency profile here")
    parser.add_argument("--json", default=None, help="write every record here")
    parser.add_argument("--plot", default=None, help="draw us and %%-roofline vs M here (.png; needs matplotlib)")
    parser.add_argument("--machine", default=None, help="machine kind recorded in --json (e.g. nvidia-h200)")


def _experts_names(text: str) -> list[str]:
    """The backends ``--experts`` names ('all': every registered one); MoEConfigError for unknown ones."""
    from moe.registry import experts_classes

    known = list(experts_classes())
    names = known if text.strip() == "all" else [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise MoEConfigError(f"--experts: unknown experts backend(s) {unknown or repr(text)}; "
                             f"choose from {', '.join(known)}, or 'all'")
    return names


def _check_outputs(args: argparse.Namespace) -> None:
    """Refuses, before any measurement, an output the run could not write at its end."""
    import importlib.util

    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise MoEConfigError(f"--plot {args.plot}: needs matplotlib, which is not installed (pip install matplotlib)")
    for flag, path in (("--json", args.json), ("--save-profile", args.save_profile), ("--plot", args.plot)):
        if path and not Path(path).resolve().parent.is_dir():
            raise MoEConfigError(f"{flag} {path}: the folder {Path(path).resolve().parent} does not exist")


def bench_command(args: argparse.Namespace) -> int:
    names = _experts_names(args.experts)
    _check_outputs(args)
    if not torch.cuda.is_available():
        raise UnsupportedError("needs a CUDA GPU, and torch finds none on this machine")
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    ceilings, records = run_bench(args.preset, args.quant, args.tokens, names, args.rotations, log)
    print(format_table(records))
    targets = format_targets(records, ceilings)
    if targets:
        print("\n## Against vLLM's kernel and the baseline (ours: the best backend that is not a baseline)" + targets)
    if args.json:
        write_json(args.json, ceilings, records, args.machine or ceilings.device)
    if args.save_profile:
        save_profile(args.save_profile, ceilings, records)
    if args.plot:
        plot(args.plot, records)
    return 0


def main_bench(argv: list[str] | None = None) -> int:
    """``python -m moe.tools.bench ARGS``: the same as ``python -m moe bench ARGS``, errors reported alike."""
    from moe.tools.cli import main

    return main(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main_bench())
