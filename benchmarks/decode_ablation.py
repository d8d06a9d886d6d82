"""Where one token's decode GEMMs spend their time: the experts stage timed with parts of the kernels taken out.

A profiler attributes stall samples to instructions; it does not say what a part costs the kernel pair end to end,
because the parts overlap. This script answers that directly. Each variant is a copy of this checkout's `moe/`
with a few source edits (`VARIANTS`) that remove one part of `moe/experts/_triton/_decode.py` /
`_decode_fp8.py` / `decode.py`. The copies' outputs are wrong by design; only their time is read. Every variant
runs in its own process (its own `moe`), in alternating rounds, each timing the cases as `moe bench` times the
experts (`backend_calls` + `time_calls`: a CUDA graph over 4 rotated routings, the tables' tiles).

    python benchmarks/decode_ablation.py --cases qwen3-30b-a3b:fp8_block,gpt-oss-120b:fp8_block \
        [--variants base,no_gemm1_finish,...] [--rounds 2] [--json out.json] [--plot out.png]
    python benchmarks/decode_ablation.py --replot a.json,b.json --plot out.png     # no GPU: redraw saved runs

The edits name the source they replace, so a kernel change that removes it fails the build of the copy (and
tests/test_decode_ablation_bench.py) instead of timing an unchanged kernel under a variant's name.

What it found (nvidia-h200, session 29, Triton 3.6; `benchmarks/results/fp8_decode_nvidia-h200.md`): at one token
both finishing epilogues together cost 2.8 µs of Qwen3-30B-A3B fp8_block's 18.9 and 2.6 of GPT-OSS-120B's 37.1,
2.0 of Qwen3 NVFP4's 17.4 and 3.4 of MXFP4's 16.6 (how that splits between GEMM1 and GEMM2 moved between calls); the
fp8 tiles' per-step activation quantization and weight scales 0.9-1.4 µs each; the expert-id load at most 0.5 µs;
the programmatic dependent launch saves 0.8-1.1 µs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_DECODE = "moe/experts/_triton/_decode.py"
_FP8 = "moe/experts/_triton/_decode_fp8.py"
_LAUNCH = "moe/experts/_triton/decode.py"

# the dot and FMA tiles' finish (in the K-split branch) and the MMA tiles' (after `mma_program`)
_FINISH_TESTS = ("            if FINISH != 0:  # the last program to arrive at the row's epilogue applies it",
                 "        if FINISH != 0 and not GROUPED:  # a program per slot: its one slot is `start`")


def _finish_kept(kept: str) -> list[tuple[str, str, str]]:
    """Edits that keep only the finish whose condition is ``kept`` (`_decode.FINISH_*`: "FINISH == 1" keeps
    GEMM1's, "FINISH == 2" GEMM2's, "False" none)."""
    return [(_DECODE, test, test.replace("FINISH != 0", kept).split("  #")[0] + "  # ablation")
            for test in _FINISH_TESTS]


_NO_QUANT = [
    (_FP8, "        x = _load_rows(a_rows_ptr + k0 + cols[None, :], row_ok, k0 + cols < K, EVEN_K)\n",
     "        x = tl.full([BLOCK_M, GROUP], 1.0, tl.float32)\n"),
    (_FP8, "            step_scale = _group_scales(x)\n",
     "            step_scale = tl.full([BLOCK_M], 1.0, tl.float32)\n"),
    (_FP8, "        q = _to_e4m3(xs, a_scale[:, None])\n", "        q = xs.to(tl.float8e4nv)\n"),
]
_NO_SCALES = [
    (_FP8, "_weight_scales(ws_ptrs, kk, stride_wsk, ROWWISE)", "tl.full([BLOCK_N], 1.0, tl.float32)"),
    (_FP8, "_weight_scales(ws_up_ptrs, kk, stride_wsk, ROWWISE)", "tl.full([BLOCK_N], 1.0, tl.float32)"),
    (_FP8, "        acc += part * (w_scale[:, None] * a_scale[None, :])\n", "        acc += part\n"),
]
# the slot's expert from the routing buffer's address instead of a load: experts that differ between the rotated
# routings, as loaded ones do (a fixed expert per slot would leave the same weights in L2 from call to call)
_NO_EXPERT_LOAD = [(_DECODE, """    expert = tl.load(ids_ptr + g)
    if HAS_MAP:
        expert = tl.load(map_ptr + expert)
    return expert, g, 1""", """    return ((ids_ptr.to(tl.int64) >> 9) * 8 + g) % num_local, g, 1""")]

# name: (what it takes out, edits (path, old text, new text))
VARIANTS: dict[str, tuple[str, list[tuple[str, str, str]]]] = {
    "base": ("nothing", []),
    "no_gemm1_finish": ("GEMM1's finishing epilogue (ticket, split sums, activation)", _finish_kept("FINISH == 2")),
    "no_gemm2_finish": ("GEMM2's finishing epilogue (ticket, split sums over k)", _finish_kept("FINISH == 1")),
    "no_finish": ("both finishing epilogues", _finish_kept("False")),
    "no_activation_quant": ("fp8: each K step's activation load, group scale and quantization", _NO_QUANT),
    "no_weight_scales": ("fp8: each K step's weight-scale load and scale multiply", _NO_SCALES),
    "no_expert_load": ("the slot's expert-id load at the program's start", _NO_EXPERT_LOAD),
    "no_pdl": ("the programmatic dependent launch of the two GEMMs",
               [(_LAUNCH, "    if per_slot and _decode.pdl_supported(x.device):", "    if False:  # ablation")]),
    "fp8_loop_only": ("all of the above but PDL: the fp8 tiles' TMA loads and wgmmas are left",
                      _NO_QUANT + _NO_SCALES + _finish_kept("False") + _NO_EXPERT_LOAD),
}


def build(name: str, into: Path) -> Path:
    """A copy of this checkout's `moe/` under ``into/name`` with variant ``name``'s edits; its directory."""
    if name not in VARIANTS:
        raise SystemExit(f"--variants: unknown variant {name!r}; one of {', '.join(VARIANTS)}")
    target = into / name
    shutil.copytree(ROOT / "moe", target / "moe", ignore=shutil.ignore_patterns("__pycache__"))
    for path, old, new in VARIANTS[name][1]:
        file = target / path
        text = file.read_text()
        if text.count(old) != 1:
            raise RuntimeError(f"variant {name!r}: {path} holds the text it replaces {text.count(old)} times, "
                               f"not once; the kernel changed, update VARIANTS: {old.strip()[:80]!r}")
        file.write_text(text.replace(old, new))
    return target


def time_cases(cases: list[str]) -> dict[str, float]:
    """µs of the experts stage at one token per ``preset:quant`` case, with the `moe` of the working directory
    (the variant's copy): the best of 5 timings."""
    sys.path.insert(0, os.getcwd())
    import torch

    import moe.experts.triton as triton_experts
    from moe.presets import load_preset
    from moe.tools.bench import backend_calls, build_weights, make_inputs, time_calls

    assert triton_experts.__file__.startswith(os.getcwd()), f"timing {triton_experts.__file__}, not the copy"
    device = torch.device("cuda")
    times = {}
    for case in cases:
        name, quant = case.split(":")
        preset = load_preset(name)
        problem = preset.problem(quant=quant, max_tokens=1)
        experts = triton_experts.TritonExperts(problem)
        prepared = experts.prepare_weights(build_weights(problem, device))
        torch.manual_seed(1)
        inputs = make_inputs(preset, problem, 1, 4, device)
        calls = backend_calls(triton_experts.TritonExperts, problem, None, inputs, device, experts=experts,
                              prepared=prepared)
        times[case] = min(time_calls(calls, True, budget_ms=80.0) for _ in range(5))
    return times


def run_variant(directory: Path, cases: list[str]) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH="")
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--time", ",".join(cases)], cwd=directory,
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{directory.name}: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(best: dict[str, dict[str, float]], cases: list[str]) -> str:
    """µs per variant and case, with the change against ``base`` where it ran."""
    base = best.get("base")
    lines = ["| variant | takes out | " + " | ".join(cases) + " |", "|---|---|" + "---|" * len(cases)]
    for name, times in best.items():
        cells = [f"{times[case]:.2f}" + (f" ({times[case] - base[case]:+.2f})" if base and name != "base" else "")
                 for case in cases]
        lines.append(f"| {name} | {VARIANTS[name][0]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(path: str | Path, best: dict[str, dict[str, float]]) -> None:
    """One panel per case: each variant's change in µs against ``base`` (what taking its part out saves)."""
    import matplotlib  # optional: `--plot` checks that it is installed first

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(case for times in best.values() for case in times))
    names = [name for name in best if name != "base"]
    fig, axes = plt.subplots(1, len(cases), figsize=(4.2 * len(cases), 0.45 * len(names) + 1.4), sharey=True,
                             squeeze=False)
    for ax, case in zip(axes[0], cases):
        deltas = [best[name].get(case, float("nan")) - best["base"][case] for name in names]
        ax.barh(names, deltas, color=["tab:green" if d < 0 else "tab:red" for d in deltas])
        ax.axvline(0, color="k", linewidth=0.8)
        ax.set_title(f"{case}: base {best['base'][case]:.2f} us", fontsize=9)
        ax.set_xlabel("us against base (taking the part out)")
    axes[0][0].invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="qwen3-30b-a3b:fp8_block,gpt-oss-120b:fp8_block",
                        help="preset:quant items, comma-separated")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None, help="draw each variant's change against base here (.png; matplotlib)")
    parser.add_argument("--replot", default=None, metavar="JSON[,JSON]",
                        help="no run: draw --plot from these --json files (their cases side by side)")
    parser.add_argument("--time", default=None, help=argparse.SUPPRESS)  # a variant's process: time these cases
    args = parser.parse_args(argv)
    if args.time:
        print(json.dumps(time_cases(args.time.split(","))))
        return 0
    if (args.plot or args.replot) and importlib.util.find_spec("matplotlib") is None:
        raise SystemExit("--plot: needs matplotlib, which is not installed (pip install matplotlib)")
    if args.replot:
        if not args.plot:
            raise SystemExit("--replot draws into --plot PATH; give one")
        best: dict[str, dict[str, float]] = {}
        for file in args.replot.split(","):
            for name, times in json.loads(Path(file).read_text())["best"].items():
                best.setdefault(name, {}).update(times)
        plot(args.plot, best)
        return 0
    import torch

    cases, names = args.cases.split(","), args.variants.split(",")
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1 (got {args.rounds})")
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        directories = {name: build(name, Path(tmp)) for name in names}  # names and edits checked before the GPU
        if not torch.cuda.is_available():
            print("decode_ablation.py times the decode kernels on a CUDA GPU; none is available here")
            return 1
        for round_ in range(args.rounds):
            for name in names:
                runs[name].append(run_variant(directories[name], cases))
                print(f"round {round_ + 1} {name}: {runs[name][-1]}", flush=True)
    best = {name: {case: min(r[case] for r in runs[name]) for case in cases} for name in names}
    print(table(best, cases))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), cases=cases, runs=runs,
                                                   best=best), indent=1))
    if args.plot:
        plot(args.plot, best)
    return 0


if __name__ == "__main__":
    sys.exit(main())
