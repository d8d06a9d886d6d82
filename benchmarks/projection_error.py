"""How well the oracle carries a measurement from one machine to another: for every backend, scheme, shape and M
measured on both, the time the oracle would give on ``--to`` from ``--from``'s measurement alone (an efficiency
against ``--from``'s ceilings, applied to ``--to``'s: moe/oracle/profile.py), against ``--to``'s own measurement.

    python benchmarks/projection_error.py [--from h100] [--to h200] [--backends flashinfer_cutlass,triton]

Prints one row per cell (projected / measured: below 1, the projection was optimistic) and the spread. Needs no GPU:
it reads the committed profiles (moe/oracle/profiles/measured-*.yaml).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe.oracle.cost import estimate_experts  # noqa: E402
from moe.oracle.profile import PROFILE_DIR, Profile, ProfileEntry, load_profile  # noqa: E402
from moe.platform import Platform  # noqa: E402


def measured_on_both(ours: Profile, theirs: Profile, backends: set[str]) -> list[ProfileEntry]:
    """``ours``' measurements (one GPU: ep_size 1) of each (backend, scheme, shape, M) that ``theirs`` measured too."""
    return [e for e in ours.entries
            if e.measured and e.backend in backends and e.shape.ep_size == 1
            and any(t.measured and (t.backend, t.quant, t.tokens) == (e.backend, e.quant, e.tokens)
                    and t.shape.same_layer(e.shape) for t in theirs.entries)]


def projection_rows(source: str, target: str, backends: set[str]) -> list[dict]:
    """One row per (backend, scheme, shape, M) measured on both machines (one GPU: ep_size 1)."""
    theirs = load_profile(PROFILE_DIR / f"measured-{source}.yaml")
    ours = load_profile(PROFILE_DIR / f"measured-{target}.yaml")
    platform = Platform.preset(target)
    rows = []
    for e in measured_on_both(ours, theirs, backends):
        projected = estimate_experts(e.backend, e.shape.problem(e.quant, max(e.tokens, 1)), platform, e.tokens, theirs)
        rows.append({"backend": e.backend, "quant": e.quant, "shape": e.shape.preset or str(e.shape), "tokens": e.tokens,
                     "measured_us": e.measured_us, "projected_us": projected.us,
                     "ratio": projected.us / e.measured_us})
    return sorted(rows, key=lambda r: (r["backend"], r["quant"], r["shape"], r["tokens"]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="source", default="h100")
    parser.add_argument("--to", dest="target", default="h200")
    parser.add_argument("--backends", default="flashinfer_cutlass,triton")
    args = parser.parse_args(argv)
    rows = projection_rows(args.source, args.target, set(args.backends.split(",")))
    if not rows:
        print(f"no cell is measured on both {args.source} and {args.target}", file=sys.stderr)
        return 1
    print(f"| backend | scheme | shape | M | {args.target} measured us | projected from {args.source} | ratio |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['backend']} | {r['quant']} | {r['shape']} | {r['tokens']} | {r['measured_us']:.1f} | "
              f"{r['projected_us']:.1f} | {r['ratio']:.2f} |")
    ratios = [r["ratio"] for r in rows]
    outside = sum(abs(r - 1) > 0.1 for r in ratios)
    print(f"\n{len(rows)} cells: ratio {min(ratios):.2f}-{max(ratios):.2f}, median {statistics.median(ratios):.2f}; "
          f"{outside} more than 10% off")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
