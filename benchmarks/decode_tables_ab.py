"""GPU, in one process: the decode choices of a preset's shipped table against the alternatives, each side timed
alternately (round after round) as `moe bench` times the experts stage (its inputs, rotated through, its CUDA-graph
timer), its output compared with the table's.

Sides: ``table`` (what the table's ``decode`` section picks: its tiles, "grouped" or the shared config), ``shared``
(the section unread: `decode.FP8_DECODE_CONFIGS`, or for the weight-only formats the bucket of `decode.DECODE_CONFIGS`),
``per_expert`` (the table's pick with ``finish`` off on its MMA and tensor-core tiles: from two tokens their programs
take an expert's slots, as before session 24, rather than one slot each; `decode.DecodeConfig.per_slot`) and
``predicated`` / ``unpredicated`` (the table's pick with `decode.DecodeTile.unpredicated` off / on on its MMA tiles)
and ``grouped`` (the grouped GEMMs, no decode kernels)::

    python benchmarks/decode_tables_ab.py deepseek-v3-ep8-slice,qwen3-30b-a3b 2,4,5,6,7,8 [table,shared,grouped]

``QUANT`` (default fp8_block; mxfp4, nvfp4 or mxfp8 for the weight-only path) sets the scheme; ``ROUNDS`` (default
3) the rounds; ``ROTATIONS`` (default 4, `moe bench`'s) the input sets, each with its own
routing, that every timing rotates through. Session 20's runs used one input set and the test suite's routing; at
M = 3 they timed the same choice 5-13% faster than `moe bench` did, and two of the choices made on them lost over
four routings in session 21 (benchmarks/results/fp8_decode_nvidia-h200.md).
Writes ``$OUT/decode_tables_ab.json``: µs per side and round, per cell, and each side's largest difference from the
table's output relative to its largest value.
"""

import dataclasses
import json
import os
import sys
from contextlib import contextmanager

import torch

from moe.experts import triton as triton_experts
from moe.experts._triton import decode
from moe.experts.triton import TritonExperts
from moe.presets import load_preset
from moe.tools.bench import backend_calls, build_weights, make_inputs, time_calls


def _retiled(config: decode.DecodeConfig | None, change) -> decode.DecodeConfig | None:
    """``config`` with ``change`` (DecodeTile -> DecodeTile) applied to both GEMMs' tiles (not its fallback's)."""
    if config is None:
        return None
    return dataclasses.replace(config, gemm1=change(config.gemm1), gemm2=change(config.gemm2))


def per_expert(config: decode.DecodeConfig | None) -> decode.DecodeConfig | None:
    """``config`` with ``finish`` off on its MMA and tensor-core tiles (not `DecodeConfig.per_slot`)."""
    return _retiled(config, lambda t: dataclasses.replace(t, finish=t.finish and not t.takes_expert_slots))


def loads(config: decode.DecodeConfig | None, unpredicated: bool) -> decode.DecodeConfig | None:
    """``config`` with its MMA tiles' weight loads `unpredicated` or not (`decode.DecodeTile.unpredicated`)."""
    return _retiled(config, lambda t: dataclasses.replace(t, unpredicated=unpredicated and t.mma))


# side: (fp8's choice by tokens, the weight-only formats' by rows per expert); None: the experts' own lookup
SIDES = {
    "table": None,
    "shared": (lambda m, *table: decode.fp8_decode_config(m), lambda rows, *table: decode.decode_config(rows)),
    "per_expert": (lambda m, *table: per_expert(decode.fp8_decode_config(m, *table)),
                   lambda rows, *table: per_expert(decode.decode_config(rows, *table))),
    **{name: (lambda m, *table, on=on: loads(decode.fp8_decode_config(m, *table), on),
              lambda rows, *table, on=on: loads(decode.decode_config(rows, *table), on))
       for name, on in (("predicated", False), ("unpredicated", True))},
    "grouped": (lambda m, *table: None, lambda rows, *table: None),
}


def check_side(name: str) -> None:
    if name not in SIDES:
        raise ValueError(f"side must be one of {', '.join(SIDES)} (got {name!r})")


@contextmanager
def side(name: str):
    """The experts' decode choices replaced by side ``name``'s (`SIDES`) while the block runs."""
    check_side(name)
    saved = triton_experts.fp8_decode_config, triton_experts.decode_config
    if SIDES[name] is not None:
        triton_experts.fp8_decode_config, triton_experts.decode_config = SIDES[name]
    try:
        yield
    finally:
        triton_experts.fp8_decode_config, triton_experts.decode_config = saved


def time_sides(calls: list, sides: list[str], rounds: int, timer=time_calls, graphs: bool = True) -> dict:
    """µs per side and round of ``calls`` (`moe.tools.bench.backend_calls`' experts stage on each input set, timed
    together by ``timer``), sides alternating within each round, and (with ``table`` among them) each side's
    largest difference from the table's output of the first input set, relative to its largest value."""
    row = {name: [] for name in sides}
    outputs = {}
    for _ in range(rounds):
        for name in sides:
            with side(name):  # a CUDA graph captures the side's launches inside the block
                outputs[name] = calls[0]().out.float().clone()
                row[name].append(round(timer(calls, graphs), 1))
    if "table" in outputs:
        scale = outputs["table"].abs().max().clamp_min(1e-30)
        row["vs_table"] = {name: ((out - outputs["table"]).abs().max() / scale).item() for name, out in outputs.items()}
    return row


def main(presets: list[str], tokens_list: list[int], sides: list[str], rounds: int, rotations: int,
         quant: str = "fp8_block") -> dict:
    device = torch.device("cuda")
    results = {}
    for name in presets:
        preset = load_preset(name)
        p = preset.problem(quant=quant, max_tokens=max(tokens_list))
        weights = build_weights(p, device)
        experts = TritonExperts(p)
        prepared = experts.prepare_weights(weights)
        for tokens in tokens_list:
            torch.manual_seed(tokens)
            inputs = make_inputs(preset, p, tokens, rotations, device)
            calls = backend_calls(TritonExperts, p, weights, inputs, device, experts=experts, prepared=prepared)
            row = time_sides(calls, sides, rounds)
            best = min(sides, key=lambda s: min(row[s]))
            print(f"{name} M={tokens}: " + ", ".join(f"{s} {row[s]}" for s in sides)
                  + f" -> fastest {best}; vs table {row.get('vs_table')}", flush=True)
            results[f"{name} {tokens}"] = row
    return results


if __name__ == "__main__":
    chosen = sys.argv[3].split(",") if len(sys.argv) > 3 else list(SIDES)
    try:
        for side_name in chosen:
            check_side(side_name)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    found = main(sys.argv[1].split(","), [int(t) for t in sys.argv[2].split(",")], chosen,
                 int(os.environ.get("ROUNDS", "3")), int(os.environ.get("ROTATIONS", "4")),
                 os.environ.get("QUANT", "fp8_block"))
    out = os.environ.get("OUT", "/tmp")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "decode_tables_ab.json"), "w") as f:
        json.dump(found, f, indent=1)
