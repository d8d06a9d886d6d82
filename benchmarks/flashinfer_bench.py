"""Times ``flashinfer_cutlass`` (W4A16 MXFP4 and BF16) against ``triton`` on a model preset, per M.

    python benchmarks/flashinfer_bench.py --preset gpt-oss-20b --quant mxfp4,bf16 \
        --tokens 1,16,64,256,1024,4096 --json results.json

Same method as ``python -m moe bench`` (its helpers: random routing from the preset's router, four input
rotations, median of CUDA-graph replays, the experts stage only: prepare and the router outside the
timed region) with one difference: each backend is built once for the largest M and warmed up first
-- ``flashinfer_cutlass`` autotunes its GEMM tactics for exactly the benchmarked M buckets -- then timed
at every M. Prints a table with the roofline fraction and the M where the faster backend changes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe.tools.bench import build_weights, make_inputs, time_calls, traffic  # noqa: E402
from moe.formats import ActivationFormat, DispatchShape  # noqa: E402
from moe.compose import activation_quant  # noqa: E402
from moe.platform import Platform  # noqa: E402
from moe.prepare_finalize.local import LocalPrepareFinalize  # noqa: E402
from moe.presets import load_preset  # noqa: E402
from moe.registry import get_experts  # noqa: E402
from moe.workspace import WorkspaceManager  # noqa: E402


def timed_backend(name, problem, weights, preset, tokens, platform, log, tune=True):
    """Records for one backend at every M (an empty list when it cannot serve)."""
    cls = get_experts(name)
    reasons = cls.check(problem, platform)
    if reasons:
        log(f"  {name}: skipped ({'; '.join(reasons)})")
        return []
    experts = cls(problem)
    prepared = experts.prepare_weights(weights)
    start = time.perf_counter()
    if tune and hasattr(experts, "warmup"):
        experts.warmup(prepared, buckets=tuple(tokens))
    torch.cuda.synchronize()
    log(f"  {name}: prepared, warm-up {time.perf_counter() - start:.1f} s")
    records = []
    for m in tokens:
        inputs = make_inputs(preset, problem, m, 4, torch.device("cuda"))
        calls, manager, pf = [], WorkspaceManager("cuda"), LocalPrepareFinalize(problem)
        for hidden, topk in inputs:
            dispatched, _ = pf.prepare(hidden, topk, activation_quant(cls, problem),
                                       WorkspaceManager("cuda").take(pf.workspace_shapes(m)))
            workspace = manager.take(experts.workspace_shapes(DispatchShape(ActivationFormat.STANDARD, m)))
            calls.append(lambda d=dispatched, w=workspace: experts.apply(d, prepared, w))
        graphs = cls.capabilities.cuda_graph_safe
        try:
            us = time_calls(calls, graphs)
        except RuntimeError as error:  # report, then time eagerly: a capture failure is a finding
            log(f"  {name} M={m}: CUDA-graph capture failed ({str(error)[:120]}); timing eagerly")
            graphs, us = False, time_calls(calls, False)
        roofline = traffic(problem, platform, [t for _, t in inputs]).us  # the bench's: moe.oracle.cost
        label = name if tune or not hasattr(experts, "warmup") else f"{name} (untuned)"
        records.append(dict(experts=label, quant=problem.quant_name, tokens=m, us=round(us, 2),
                            roofline_us=round(roofline, 2), roofline_fraction=round(roofline / us, 3), graphs=graphs))
        log(f"  {name} {problem.quant_name} M={m}: {us:.1f} us ({roofline / us:.0%} of roofline)")
    return records


def crossovers(records: list[dict]) -> dict[str, str]:
    """Per scheme: which backend is faster at each M, and where that changes."""
    result = {}
    for quant in sorted({r["quant"] for r in records}):
        rows = {}
        for r in records:
            if r["quant"] == quant:
                rows.setdefault(r["tokens"], {})[r["experts"]] = r["us"]
        winners = [(m, min(t, key=t.get)) for m, t in sorted(rows.items()) if len(t) > 1]
        changes = [f"{a[1]} -> {b[1]} between M={a[0]} and M={b[0]}"
                   for a, b in zip(winners, winners[1:]) if a[1] != b[1]]
        result[quant] = "; ".join(changes) or (f"{winners[0][1]} at every M" if winners else "one backend only")
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt-oss-20b")
    parser.add_argument("--quant", default="mxfp4,bf16")
    parser.add_argument("--tokens", default="1,16,64,256,1024,4096")
    parser.add_argument("--experts", default="flashinfer_cutlass,triton")
    parser.add_argument("--json", default=None)
    parser.add_argument("--no-tune", action="store_true", help="skip the autotuning warm-up (default tactics)")
    args = parser.parse_args(argv)
    import moe.experts.flashinfer_cutlass  # noqa: F401 -- registers the backends benchmarked here
    import moe.experts.triton  # noqa: F401

    tokens = [int(t) for t in args.tokens.split(",")]
    preset = load_preset(args.preset)
    platform = Platform.detect("cuda").measure_rates("cuda")
    print(f"{platform.name}: {platform.memory_bandwidth / 1e12:.2f} TB/s, "
          f"bf16 {platform.peak_flops('bf16') / 1e12:.0f} TFLOP/s")
    records = []
    for quant in args.quant.split(","):
        problem = preset.problem(quant=quant, max_tokens=max(tokens))
        weights = build_weights(problem, torch.device("cuda"))
        for name in args.experts.split(","):
            records += timed_backend(name, problem, weights, preset, tokens, platform, print, tune=not args.no_tune)
        del weights
        torch.cuda.empty_cache()
    print("\n| experts | quant | " + " | ".join(f"M={m}" for m in tokens) + " |")
    print("|---|---|" + "---|" * len(tokens))
    for key in sorted({(r["experts"], r["quant"]) for r in records}):
        us = {r["tokens"]: r["us"] for r in records if (r["experts"], r["quant"]) == key}
        print(f"| {key[0]} | {key[1]} | " + " | ".join(f"{us.get(m, float('nan')):.1f}" for m in tokens) + " |")
    cross = crossovers(records)
    for quant, text in cross.items():
        print(f"crossover {quant}: {text}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": platform.name, "preset": args.preset, "unit": "us",
                                               "records": records, "crossovers": cross}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
