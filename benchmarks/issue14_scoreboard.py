"""Issue 14's goals, cell by cell, from committed result files: which are met, by how much, on which run.

    python benchmarks/issue14_scoreboard.py benchmarks/results/issue14_s26_bench_nvidia-h200.json \\
        --layer benchmarks/results/issue14_s26_layer_decode_nvidia-h200.json

Reads `python -m moe bench --json` files (several are merged: they should come from one machine, one call)
and, optionally, `benchmarks/layer_decode.py --json` files. Prints one markdown table per goal; a goal whose
cells the files do not hold is listed as not measured. The goals (issue 14, H200):

- **bf16 against the peers**: `moe bench`'s own goal table (`benchmarks/peer_targets.yaml`: vLLM's times, and
  the backends it names as baselines -- torch_grouped and FlashInfer's CUTLASS MoE -- timed in the run).
- **bf16 at large M, Qwen3-30B-A3B**: >= 70% of the measured bf16 peak at M >= 4096.
- **MXFP4 W4A16 decode, GPT-OSS-120B, M <= 64**: ours >= 1.3x FlashInfer's CUTLASS; <= 35 us at M = 1;
  >= 60% of the roofline (memory-bound there) at M = 16 and 64.
- **Weight-only schemes (MXFP4, NVFP4) at M <= 16**: <= 0.6x the time of the same preset's bf16 at that M (the
  fastest backend of each, experts stage).
- **fp8 128-block W8A8**: >= 60% of the roofline at M >= 1024; never slower than bf16 at the same cell; decode
  (M = 1) >= 80% of the roofline.
- **The whole layer at decode**: layer / experts stage <= 1.15 at M <= 64 (`layer_decode.py`).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe.tools.bench import CHECKOUT_TARGETS  # noqa: E402
from moe.tools.bench_report import Ceilings, Record, format_targets, load_targets  # noqa: E402

OURS = "triton"  # the backends of this package a goal counts as ours, besides the oracle's choice in a layer
PEER = "flashinfer_cutlass"
WEIGHT_ONLY = ("mxfp4", "nvfp4")


@dataclass(frozen=True)
class Row:
    """One cell of a goal: what was measured, the bound, and whether it holds."""

    cell: str
    measured: str
    bound: str
    met: bool


def load_bench(paths: list[str]) -> tuple[Ceilings, list[Record]]:
    """The records of every ``moe bench --json`` file (the first file's ceilings); ValueError naming a file whose
    machine differs from the first's."""
    ceilings, machine, records = None, None, []
    for path in paths:
        data = json.loads(Path(path).read_text())
        if machine is not None and data["machine"] != machine:
            raise ValueError(f"{path}: machine {data['machine']!r}, but {paths[0]} is {machine!r}; "
                             "a scoreboard reads one machine's runs")
        machine = data["machine"]
        ceilings = ceilings or Ceilings(**data["ceilings"])
        records += [Record(**r) for r in data["records"]]
    if ceilings is None:
        raise ValueError("no bench file given")
    return ceilings, records


def _fastest(records: list[Record]) -> dict[tuple[str, str, int], Record]:
    """(preset, quant, M) -> the fastest record of ours (not the peer's)."""
    best = {}
    for r in records:
        key = (r.preset, r.quant, r.tokens)
        if r.experts != PEER and (key not in best or r.us < best[key].us):
            best[key] = r
    return best


def _pick(records: list[Record], preset: str, quant: str, tokens: int, experts: str) -> Record | None:
    return next((r for r in records if (r.preset, r.quant, r.tokens, r.experts) == (preset, quant, tokens, experts)),
                None)


def bf16_large_m(ceilings: Ceilings, records: list[Record]) -> list[Row]:
    best = _fastest(records)
    return [Row(f"qwen3-30b-a3b M = {m}", f"{r.us:.1f} us ({r.experts}), {r.tflops * 1e12 / ceilings.bf16_flops:.0%}",
                ">= 70% of peak", r.tflops * 1e12 >= 0.7 * ceilings.bf16_flops)
            for (p, q, m), r in sorted(best.items()) if p == "qwen3-30b-a3b" and q == "bf16" and m >= 4096]


def mxfp4_decode(records: list[Record]) -> list[Row]:
    rows = []
    cells = {r.tokens for r in records if r.preset == "gpt-oss-120b" and r.quant == "mxfp4" and r.tokens <= 64}
    for m in sorted(cells):
        ours = _pick(records, "gpt-oss-120b", "mxfp4", m, OURS)
        peer = _pick(records, "gpt-oss-120b", "mxfp4", m, PEER)
        if ours is None:
            continue
        if peer is not None:
            rows.append(Row(f"M = {m}: against FlashInfer",
                            f"{ours.us:.1f} / {peer.us:.1f} us = {peer.us / ours.us:.2f}x", ">= 1.3x",
                            peer.us >= 1.3 * ours.us))
        if m == 1:
            rows.append(Row("M = 1: time", f"{ours.us:.1f} us", "<= 35 us", ours.us <= 35.0))
        if m in (16, 64):
            rows.append(Row(f"M = {m}: roofline", f"{ours.roofline_fraction:.0%}", ">= 60%",
                            ours.roofline_fraction >= 0.6))
    return rows


def weight_only(records: list[Record]) -> list[Row]:
    best = _fastest(records)
    rows = []
    for (p, q, m), r in sorted(best.items()):
        bf16 = best.get((p, "bf16", m))
        if q in WEIGHT_ONLY and m <= 16 and bf16 is not None:
            rows.append(Row(f"{p} {q} M = {m}", f"{r.us:.1f} / {bf16.us:.1f} us = {r.us / bf16.us:.2f}", "<= 0.6",
                            r.us <= 0.6 * bf16.us))
    return rows


def fp8_block(records: list[Record]) -> list[Row]:
    best = _fastest(records)
    rows = []
    for (p, q, m), r in sorted(best.items()):
        if q != "fp8_block":
            continue
        if m >= 1024:
            rows.append(Row(f"{p} M = {m}: roofline", f"{r.us:.1f} us, {r.roofline_fraction:.0%}", ">= 60%",
                            r.roofline_fraction >= 0.6))
        if m == 1:
            rows.append(Row(f"{p} M = 1: roofline", f"{r.us:.1f} us, {r.roofline_fraction:.0%}", ">= 80%",
                            r.roofline_fraction >= 0.8))
        bf16 = best.get((p, "bf16", m))
        if bf16 is not None:
            rows.append(Row(f"{p} M = {m}: against bf16", f"{r.us:.1f} / {bf16.us:.1f} us", "fp8 <= bf16",
                            r.us <= bf16.us))
    return rows


def layer(cells: list[dict]) -> list[Row]:
    return [Row(f"{c['preset']} {c['scheme']} M = {c['tokens']} ({c['backend']})",
                f"{c['layer_us']:.1f} / {c['experts_us']:.1f} us = {c['ratio']:.2f}", "<= 1.15", c["ratio"] <= 1.15)
            for c in cells if not c.get("error") and c["tokens"] <= 64]


def format_rows(title: str, rows: list[Row]) -> str:
    if not rows:
        return f"\n## {title}\n\nnot measured in these files\n"
    met = sum(r.met for r in rows)
    lines = [f"\n## {title}: {met} of {len(rows)} met\n", "| cell | measured | bound | met |", "|---|---|---|---|"]
    lines += [f"| {r.cell} | {r.measured} | {r.bound} | {'yes' if r.met else '**no**'} |" for r in rows]
    return "\n".join(lines) + "\n"


def scoreboard(bench_paths: list[str], layer_paths: list[str] = ()) -> str:
    ceilings, records = load_bench(bench_paths)
    cells = [c for path in layer_paths for c in json.loads(Path(path).read_text())["cells"]]
    targets = load_targets(CHECKOUT_TARGETS)
    out = [f"# Issue 14 scoreboard ({ceilings.device}: {ceilings.bandwidth / 1e12:.2f} TB/s, bf16 "
           f"{ceilings.bf16_flops / 1e12:.0f} TFLOP/s, fp8 {ceilings.fp8_flops / 1e12:.0f} TFLOP/s measured)\n",
           "Files: " + ", ".join(Path(p).name for p in [*bench_paths, *layer_paths]) + "\n"]
    bf16_goal = format_targets([r for r in records if r.quant == "bf16"], ceilings, targets)
    verdicts = [line.rsplit("|", 2)[1].strip() for line in bf16_goal.splitlines() if line.startswith("| ") and
                not line.startswith("| M ")]
    met = sum(v.startswith("yes") for v in verdicts)
    timed = [b for b in targets.baselines if any(r.experts == b and r.quant == "bf16" for r in records)]
    missing = [b for b in targets.baselines if b not in timed]
    peers = f"{', '.join(timed)} timed in the run" if timed else "no baseline timed in the run"
    untimed = f"\n{', '.join(missing)}: not timed in these files, so no bar here counts them.\n" if missing else ""
    out.append(f"\n## bf16 against the peers (vLLM's table; {peers}): {met} of {len(verdicts)} met\n" + untimed
               + (bf16_goal or "\nnot measured in these files\n"))
    out.append(format_rows("bf16 at large M (Qwen3-30B-A3B)", bf16_large_m(ceilings, records)))
    out.append(format_rows("MXFP4 W4A16 decode (GPT-OSS-120B)", mxfp4_decode(records)))
    out.append(format_rows("Weight-only at M <= 16, time over bf16's", weight_only(records)))
    out.append(format_rows("fp8 128-block W8A8", fp8_block(records)))
    out.append(format_rows("The whole layer at decode, layer over experts stage", layer(cells)))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench", nargs="+", help="moe bench --json files (one machine)")
    parser.add_argument("--layer", action="append", default=[], help="benchmarks/layer_decode.py --json files")
    args = parser.parse_args(argv)
    print(scoreboard(args.bench, args.layer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
