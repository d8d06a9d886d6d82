"""Decode time of the whole MoE layer in one CUDA graph, beside its experts stage alone (issue 14).

    python benchmarks/layer_decode.py                                      # 3 presets, bf16, M = 1..64
    python benchmarks/layer_decode.py --preset qwen3-30b-a3b,gpt-oss-120b --quant bf16,nvfp4 --tokens 1,2,4,8,16
    python benchmarks/layer_decode.py --device cpu --dtype float32 --scale 16   # CPU smoke run: no graphs

For each preset, scheme, experts backend (``oracle``: the layer's own choice at each M, shown as
``oracle>NAME``; or a backend forced with ``FusedMoE(experts=NAME)``) and M, one `FusedMoE` on random
weights is timed two ways, each as ``python -m moe bench`` times (`moe.tools.bench.time_calls`: every
input set captured in one CUDA graph per M, replayed, the median replay divided by the sets):

- ``experts``: the experts stage alone -- `moe.tools.bench.backend_calls` on the layer's own kernel for M
  (its experts object and prepared weights), the routing computed beforehand;
- ``layer``: ``FusedMoE.forward(hidden, router_logits)`` -- router, prepare, experts (with their token
  sort / block alignment), sum over k.

``ratio`` = layer / experts (goal: <= 1.15 at M <= 64); ``vs bf16`` = layer / the fastest layer of the
unquantized scheme at the same preset and M (goal for weight-only schemes: <= 0.6 at M <= 16). Before
timing, each cell checks that both paths compute one thing: the layer's output against the kernel's
forward on the layer's routing, and the experts stage's output summed over k against the same (``err``:
the larger relative error). A cell that cannot run (a backend refusing the scheme on this device, a
failed capture) is listed with its error. The preset's shared experts are left out: the layer timed is
router + experts + sum over k.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe import FusedMoE  # noqa: E402
from moe.formats import ActivationFormat  # noqa: E402
from moe.prepare_finalize.local import LocalPrepareFinalize  # noqa: E402
from moe.presets import load_preset, preset_names  # noqa: E402
from moe.quant.scheme import SCHEME_NAMES, UNQUANTIZED  # noqa: E402
from moe.registry import experts_classes  # noqa: E402
from moe.synthetic import random_dense  # noqa: E402
from moe.tolerance import relative_error  # noqa: E402
from moe.tools.bench import backend_calls, time_calls  # noqa: E402
from moe.tools.cli_args import comma_separated, int_at_least, one_of  # noqa: E402

PRESETS = ("qwen3-30b-a3b", "gpt-oss-120b", "deepseek-v3-ep8-slice")
TOKENS = (1, 2, 4, 8, 16, 32, 64)
ORACLE = "oracle"  # the --experts entry that lets the layer's oracle choose
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclasses.dataclass
class Cell:
    """One (preset, scheme, backend, M): microseconds of each path, or why it could not run."""

    preset: str
    scheme: str  # the scheme that ran (an unquantized one runs as --dtype's)
    backend: str  # as requested: "oracle" or a forced name
    tokens: int
    experts: str = ""  # the experts backend that ran at this M
    experts_us: float = math.nan
    layer_us: float = math.nan
    ratio: float = math.nan  # layer / experts
    vs_base: float = math.nan  # layer / the fastest unquantized layer at this preset and M
    err: float = math.nan  # the larger relative error of the two agreement checks
    graphs: bool = False
    error: str = ""


def running_scheme(scheme: str, dtype: torch.dtype) -> str:
    """``scheme``, or for an unquantized one the unquantized name of ``dtype`` (bf16 runs as fp32 in float32)."""
    return next(n for n, d in UNQUANTIZED.items() if d == dtype) if scheme in UNQUANTIZED else scheme


def build_layer(preset, scheme: str, backend: str, args: argparse.Namespace) -> FusedMoE:
    """The preset's layer (no shared experts) for M <= max(--tokens), loaded with random weights (seed 0)."""
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    layer = FusedMoE(preset.num_experts, preset.top_k, preset.hidden_size, preset.intermediate_size,
                     activation=preset.activation, quant=scheme, routing=preset.routing, has_bias=preset.has_bias,
                     dtype=dtype, device=device, max_tokens=max(args.tokens),
                     experts=None if backend == ORACLE else backend, **preset.router_options())
    dense = random_dense(layer.problem, torch.Generator(device=device).manual_seed(0), device, dtype)
    layer.load_weights(**dense)
    return layer


def layer_inputs(layer: FusedMoE, tokens: int, rotations: int) -> list[tuple]:
    """``rotations`` triples (hidden [M, H], router_logits [M, E], the layer's TopK of those logits); like
    `moe.tools.bench.make_inputs`, but the layer needs the logits and routes with its own Router."""
    p, inputs = layer.problem, []
    for _ in range(rotations):
        hidden = torch.randn(tokens, p.hidden_size, device=layer.device, dtype=p.dtype)
        logits = torch.randn(tokens, p.num_experts, device=layer.device, dtype=p.dtype)
        inputs.append((hidden, logits, layer.router(logits)))
    return inputs


def agreement(layer: FusedMoE, kernel, inputs: list[tuple], stage_calls: list) -> float:
    """The larger relative error, on the first input set, of the layer's output and of the experts stage's
    output (summed over k; standard-format experts only) against ``kernel.forward`` on the same routing."""
    hidden, logits, topk = inputs[0]
    path = kernel(hidden, topk, validate=False)
    errors = [relative_error(layer(hidden, logits), path)]
    if ActivationFormat.STANDARD in type(kernel.experts).capabilities.formats:
        stage = LocalPrepareFinalize(kernel.problem).finalize(stage_calls[0](), None, None, topk)
        errors.append(relative_error(stage, path))
    return max(errors)


def time_cell(layer: FusedMoE, cell: Cell, args: argparse.Namespace) -> None:
    """Checks and times ``cell`` on ``layer``, filling its fields."""
    kernel = layer.kernel_for(cell.tokens)
    cell.experts = kernel.experts.name
    inputs = layer_inputs(layer, cell.tokens, args.rotations)
    stage = backend_calls(type(kernel.experts), kernel.problem, None, [(h, t) for h, _, t in inputs], layer.device,
                          experts=kernel.experts, prepared=kernel.prepared_weights)
    cell.err = agreement(layer, kernel, inputs, stage)
    whole = [lambda h=h, g=g: layer(h, g) for h, g, _ in inputs]
    cell.graphs = layer.device.type == "cuda"
    cell.experts_us = time_calls(stage, cell.graphs, args.budget_ms)
    cell.layer_us = time_calls(whole, cell.graphs, args.budget_ms)
    cell.ratio = cell.layer_us / cell.experts_us


def failed(cell: Cell, error: Exception) -> Cell:
    """``cell`` with ``error`` as its one-line reason (a refusal's reasons joined by '; ')."""
    reasons = "; ".join(line.strip(" -") for line in str(error).splitlines() if line.strip())
    cell.error = f"{type(error).__name__}: {reasons[:300]}"
    return cell


def label(cell: Cell) -> str:
    """The backend column: a forced backend's name, or ``oracle>NAME`` with the one it chose at this M."""
    return f"{cell.backend}>{cell.experts}" if cell.backend == ORACLE and cell.experts else cell.backend


def run_backend(preset, scheme: str, backend: str, args: argparse.Namespace, log) -> tuple[list[Cell], set[str]]:
    """Every M of one layer; and the backends it ran at all M (the oracle's, to skip forcing it again)."""
    cells = [Cell(preset.name, scheme, backend, m) for m in args.tokens]
    try:
        layer = build_layer(preset, scheme, backend, args)
    except Exception as error:  # noqa: BLE001 -- a refusal (or a failed load) is a row of the table, not the end
        log(f"  {preset.name} {scheme} {backend}: cannot build the layer ({failed(cells[0], error).error})")
        return [failed(c, error) for c in cells], set()
    for cell in cells:
        try:
            time_cell(layer, cell, args)
        except Exception as error:  # noqa: BLE001 -- e.g. a capture that fails: listed, the next cell runs
            failed(cell, error)
        log(f"  {preset.name} {scheme} {label(cell)} M={cell.tokens}: experts {cell.experts_us:.1f} us, "
            f"layer {cell.layer_us:.1f} us {cell.error}")
    ran = {c.experts for c in cells} if backend == ORACLE and all(not c.error for c in cells) else set()
    del layer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # one layer's weights at a time: gpt-oss-120b's take gigabytes
    return cells, ran


def run(args: argparse.Namespace, log=print) -> list[Cell]:
    """Every (preset, scheme, backend, M) of ``args``, with ``vs_base`` filled in."""
    dtype, cells = DTYPES[args.dtype], []
    with torch.inference_mode():
        for name in args.preset:
            preset = load_preset(name)
            if args.scale > 1:  # H and I divided (multiples of 32 kept, as mxfp4 scales need), E and k kept
                preset = preset.scaled(max_hidden=preset.hidden_size // args.scale,
                                       max_intermediate=preset.intermediate_size // args.scale,
                                       max_experts=preset.num_experts)
            for scheme in dict.fromkeys(running_scheme(s, dtype) for s in args.quant):
                oracle_ran: set[str] = set()
                for backend in args.experts:
                    if oracle_ran == {backend}:
                        log(f"  {preset.name} {scheme} {backend}: the oracle's choice at every M, timed as 'oracle'")
                        continue
                    new, ran = run_backend(preset, scheme, backend, args, log)
                    cells += new
                    oracle_ran |= ran
    base = running_scheme("bf16", dtype)
    for cell in cells:
        bases = [c.layer_us for c in cells if (c.preset, c.tokens, c.scheme) == (cell.preset, cell.tokens, base)]
        bases = [us for us in bases if math.isfinite(us)]
        cell.vs_base = cell.layer_us / min(bases) if bases else math.nan
    return cells


def format_table(cells: list[Cell], base: str) -> str:
    """The markdown table of ``cells``; a cell that failed shows its error."""
    lines = [f"| preset | scheme | backend | M | experts µs | layer µs | ratio | vs {base} | err |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        if c.error:
            lines.append(f"| {c.preset} | {c.scheme} | {label(c)} | {c.tokens} | {c.error} | | | | |")
            continue
        lines.append(f"| {c.preset} | {c.scheme} | {label(c)} | {c.tokens} | {c.experts_us:.1f} | {c.layer_us:.1f} | "
                     f"{c.ratio:.2f} | {c.vs_base:.2f} | {c.err:.0e} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", type=comma_separated(one_of(preset_names(), "preset"), "qwen3-30b-a3b"),
                        default=list(PRESETS), help="comma-separated presets (default: " + ",".join(PRESETS) + ")")
    parser.add_argument("--quant", type=comma_separated(one_of(SCHEME_NAMES, "scheme"), "bf16,nvfp4"),
                        default=["bf16"], help="comma-separated schemes (default bf16)")
    backends = (ORACLE, *experts_classes())
    parser.add_argument("--experts", type=comma_separated(one_of(backends, "experts backend"), "oracle,triton"),
                        default=[ORACLE, "triton"], help="'oracle' (the layer's choice) and/or forced backends")
    parser.add_argument("--tokens", type=comma_separated(int_at_least(1), "1,16,64"), default=list(TOKENS))
    parser.add_argument("--rotations", type=int_at_least(1), default=4, help="input sets rotated through")
    parser.add_argument("--budget-ms", type=float, default=300.0, help="timed repetitions per path and M")
    parser.add_argument("--device", default="cuda", help="cuda (CUDA graphs), or cpu for a smoke run")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    parser.add_argument("--scale", type=int_at_least(1), default=1, help="divide each preset's H and I by this")
    parser.add_argument("--json", default=None, help="write every cell here")
    parser.add_argument("--machine", default=None, help="machine kind recorded in --json (e.g. nvidia-h100)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[Cell]:
    args = parse_args(argv)
    if args.json and not Path(args.json).resolve().parent.is_dir():
        raise SystemExit(f"--json {args.json}: the folder {Path(args.json).resolve().parent} does not exist")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch finds no CUDA GPU here; use --device cpu --dtype float32 for a smoke run")
    cells = run(args, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(format_table(cells, running_scheme("bf16", DTYPES[args.dtype])))
    if args.json:
        device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
        meta = {"machine": args.machine or device, "device": device, "torch": torch.__version__,
                "dtype": args.dtype, "scale": args.scale, "rotations": args.rotations}
        cells_json = [{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                       for k, v in dataclasses.asdict(c).items()} for c in cells]
        Path(args.json).write_text(json.dumps({**meta, "cells": cells_json}, indent=1) + "\n")
    return cells


if __name__ == "__main__":
    main()
