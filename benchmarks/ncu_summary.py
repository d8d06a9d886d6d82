"""A short table per kernel from Nsight Compute's CSV: what bounds it (throughputs, issue, occupancy, registers) and
where its warps stall, small enough to read in a device call's reply (which keeps only its last 12,000 characters;
`ncu --set full` prints ~200 lines a kernel).

    ncu --profile-from-start off --set full --metrics "$(python benchmarks/ncu_summary.py --stall-metrics)" \\
        -k regex:decode_gemm --launch-count 2 --csv --page details \\
        python benchmarks/kernel_breakdown.py --preset gpt-oss-120b --quant mxfp4 --tokens 64 --ncu > $OUT/ncu.csv
    python benchmarks/ncu_summary.py $OUT/ncu.csv            # or --json, for a file to commit beside the CSV

Reads ``--csv --page details`` output (one row per metric: "ID", "Kernel Name", "Metric Name", "Metric Unit",
"Metric Value"; ncu's own log lines around it are skipped). The stall reasons are ncu's
``smsp__warp_issue_stalled_<reason>_per_warp_active.pct`` metrics, which ``--set full`` does not print by name:
``--stall-metrics`` gives the list to pass to ``--metrics``. Session 37 read the MXFP4 decode GEMMs this way
(benchmarks/results/fp4_gemv_decode_nvidia-h200.md).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

# the details page's metrics worth a line each, in this order
METRICS = (
    "Duration", "DRAM Throughput", "L2 Cache Throughput", "Compute (SM) Throughput", "Issue Slots Busy",
    "Executed Ipc Active", "Registers Per Thread", "Block Limit Registers", "Block Limit Shared Mem",
    "Theoretical Occupancy", "Achieved Occupancy", "Eligible Warps Per Scheduler", "Warp Cycles Per Issued Instruction",
    "L2 Hit Rate", "Grid Size", "Block Size",
)
STALLS = ("long_scoreboard", "short_scoreboard", "wait", "math_pipe_throttle", "not_selected", "selected", "barrier",
          "mio_throttle", "lg_throttle", "tex_throttle", "dispatch_stall", "branch_resolving", "membar", "drain",
          "imc_miss", "no_instruction")
_STALL_PREFIX, _STALL_SUFFIX = "smsp__warp_issue_stalled_", "_per_warp_active.pct"


def stall_metrics() -> str:
    """The ``--metrics`` value that makes ncu report every stall reason of `STALLS`."""
    return ",".join(f"{_STALL_PREFIX}{reason}{_STALL_SUFFIX}" for reason in STALLS)


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def read(text: str, source: str = "input") -> list[dict]:
    """Per profiled kernel launch, in ncu's order: ``{"id", "kernel", "metrics": {name: (value, unit)}, "stalls":
    {reason: percent}}``. Raises ValueError naming ``source`` where no CSV row is found."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    rows = list(csv.DictReader(lines))
    if not rows or "Metric Name" not in rows[0]:
        raise ValueError(f"{source}: no ncu CSV rows (expected the output of ncu --csv --page details)")
    kernels: dict[str, dict] = {}
    for row in rows:
        entry = kernels.setdefault(row["ID"], {"id": row["ID"], "kernel": row.get("Kernel Name", ""), "metrics": {},
                                               "stalls": {}})
        name, value = row["Metric Name"], row.get("Metric Value", "")
        if name.startswith(_STALL_PREFIX) and name.endswith(_STALL_SUFFIX):
            percent = _number(value)
            if percent is not None:
                entry["stalls"][name[len(_STALL_PREFIX):-len(_STALL_SUFFIX)]] = percent
        elif name in METRICS:
            entry["metrics"][name] = (value, row.get("Metric Unit", ""))
    return list(kernels.values())


def table(kernels: list[dict], top: int = 6) -> str:
    """One markdown table, a column per kernel: `METRICS` found, then the ``top`` stall reasons of each."""
    header = "| | " + " | ".join(f"{k['id']}: {k['kernel'][:40]}" for k in kernels) + " |"
    lines = [header, "|---" * (len(kernels) + 1) + "|"]
    for name in METRICS:
        if any(name in k["metrics"] for k in kernels):
            cells = [" ".join(k["metrics"].get(name, ("-", ""))).strip() for k in kernels]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if any(k["stalls"] for k in kernels):
        cells = [", ".join(f"{reason} {pct:.1f}" for reason, pct in
                           sorted(k["stalls"].items(), key=lambda item: -item[1])[:top]) or "-" for k in kernels]
        lines.append("| top stalls (% per active warp) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("csv", nargs="?", help="ncu --csv --page details output (default: standard input)")
    parser.add_argument("--json", action="store_true", help="print the kernels as JSON instead of a table")
    parser.add_argument("--stall-metrics", action="store_true", help="print the --metrics list for ncu and exit")
    args = parser.parse_args(argv)
    if args.stall_metrics:
        print(stall_metrics())
        return 0
    source = args.csv or "standard input"
    try:
        text = Path(args.csv).read_text() if args.csv else sys.stdin.read()
        kernels = read(text, source)
    except (OSError, ValueError) as error:
        print(f"ncu_summary: {error}", file=sys.stderr)
        return 2
    print(json.dumps(kernels, indent=1) if args.json else table(kernels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
