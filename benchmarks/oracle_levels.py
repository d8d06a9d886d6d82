"""Which measurement predicts a cell better: the same platform's measurements of other shapes, or a sibling
platform's measurement of the same shape? For every (backend, scheme, shape, M) both committed measured profiles
hold (one GPU), the oracle's time from each alone against the time measured there.

    python benchmarks/oracle_levels.py [--backends flashinfer_cutlass,triton] [--cells]

Needs no GPU: it reads moe/oracle/profiles/measured-*.yaml. The order of `Profile.points`' measured levels rests
on it (benchmarks/results/oracle_levels_s42.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from projection_error import measured_on_both  # noqa: E402

from moe.oracle.cost import estimate_experts  # noqa: E402
from moe.oracle.profile import PROFILE_DIR, Profile, load_profile  # noqa: E402
from moe.platform import Platform  # noqa: E402


def level_rows(target: str, source: str, backends: set[str]) -> list[dict]:
    """One row per cell measured on both: ``other_shapes`` (``target``'s profile without this backend's
    measurements of this shape in this scheme) and ``sibling`` (``source``'s profile alone), each over the
    measurement. Cells where the first has nothing at other shapes reaching M are left out."""
    ours, theirs = (load_profile(PROFILE_DIR / f"measured-{k}.yaml") for k in (target, source))
    platform = Platform.preset(target)
    rows = []
    for e in measured_on_both(ours, theirs, backends):
        problem = e.shape.problem(e.quant, max(e.tokens, 1))
        others = Profile(tuple(x for x in ours.entries
                               if not (x.backend == e.backend and x.quant == e.quant and x.shape.same_layer(e.shape))))
        other_shapes = estimate_experts(e.backend, problem, platform, e.tokens, others)
        if not other_shapes.basis.startswith("measured at other shapes"):
            continue
        sibling = estimate_experts(e.backend, problem, platform, e.tokens, theirs)
        rows.append({"backend": e.backend, "quant": e.quant, "shape": e.shape.preset or str(e.shape),
                     "tokens": e.tokens, "measured_us": e.measured_us,
                     "other_shapes": other_shapes.us / e.measured_us, "sibling": sibling.us / e.measured_us})
    return sorted(rows, key=lambda r: (r["backend"], r["quant"], r["shape"], r["tokens"]))


def summary(ratios: list[float]) -> str:
    return (f"median |error| {statistics.median(abs(r - 1) for r in ratios):.1%}, more than 10% off in "
            f"{sum(abs(r - 1) > 0.1 for r in ratios)} of {len(ratios)}, ratio {min(ratios):.2f}-{max(ratios):.2f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="flashinfer_cutlass,triton")
    parser.add_argument("--cells", action="store_true", help="print every cell, not only the summary")
    args = parser.parse_args(argv)
    for target, source in (("h100", "h200"), ("h200", "h100")):
        rows = level_rows(target, source, set(args.backends.split(",")))
        if not rows:
            print(f"{target}: no cell measured on both {target} and {source}")
            continue
        print(f"{target}, {len(rows)} cells: own other shapes: {summary([r['other_shapes'] for r in rows])}")
        print(f"{target}, {len(rows)} cells: {source} at this shape: {summary([r['sibling'] for r in rows])}")
        if args.cells:
            print(f"| backend | scheme | shape | M | {target} us | other shapes / measured | {source} / measured |")
            print("|---|---|---|---|---|---|---|")
            for r in rows:
                print(f"| {r['backend']} | {r['quant']} | {r['shape']} | {r['tokens']} | {r['measured_us']:.1f} | "
                      f"{r['other_shapes']:.2f} | {r['sibling']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
