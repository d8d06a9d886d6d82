"""A new `python -m moe bench --json` file against the shipped measured profile of its machine: the records that
ran slower than the profile's time for the same backend, scheme, shape and M by more than a tolerance.

    python benchmarks/check_regressions.py new.json --machine nvidia-h100 [--tolerance 0.15]

Prints every compared cell as a markdown table (regressions first) and exits with status 1 when any cell
regressed, so a GPU session can run it right after its bench. Cells the profile has no time for are listed
as new. The profile is what `make_measured_profile.py` made of the committed results: run on a GPU, a bench of
the shipped code should land within run-to-run noise (a few %) of it. Session 8 found a 1.5x slowdown of
the fp8 grouped GEMM (Qwen3-30B-A3B, M = 4096) that had gone unnoticed for a session; this script flags it
(`tests/test_check_regressions.py`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe.errors import MoEConfigError  # noqa: E402
from moe.oracle.profile import PROFILE_DIR, ProfileEntry, load_profile  # noqa: E402
from moe.platform import Platform  # noqa: E402
from moe.presets import load_preset  # noqa: E402


def _machines() -> dict:
    """make_measured_profile.MACHINES: each machine kind's platform and result files."""
    path = Path(__file__).with_name("make_measured_profile.py")
    spec = importlib.util.spec_from_file_location("make_measured_profile", path)
    module = sys.modules.get(spec.name) or importlib.util.module_from_spec(spec)
    if spec.name not in sys.modules:
        sys.modules[spec.name] = module  # its dataclass looks its module up while being defined
        spec.loader.exec_module(module)
    return module.MACHINES


@dataclass(frozen=True)
class Cell:
    """One record of the new file beside the profile's time for it (None: the profile has none)."""

    preset: str
    quant: str
    tokens: int
    backend: str
    new_us: float
    profile_us: float | None
    source: str  # the committed result file the profile's time came from

    @property
    def ratio(self) -> float | None:
        """new / profile: above 1 is slower."""
        return None if self.profile_us is None else self.new_us / self.profile_us


def compare(records: list[dict], machine: str) -> list[Cell]:
    """Each bench record beside the shipped ``measured-<kind>.yaml`` time of ``machine`` for the same
    backend, scheme, preset shape and M."""
    machines = _machines()
    if machine not in machines:
        raise MoEConfigError(f"--machine must be one of {sorted(machines)} (got {machine!r})")
    kind = machines[machine].kind
    platform = Platform.preset(kind)
    shipped = {e.key(): e for e in load_profile(PROFILE_DIR / f"measured-{kind}.yaml").entries}
    cells = []
    for r in records:
        problem = load_preset(r["preset"]).problem(quant=r["quant"], max_tokens=max(r["tokens"], 1))
        key = ProfileEntry.measurement(r["experts"], platform, problem, r["tokens"], r["us"], preset=r["preset"]).key()
        old = shipped.get(key)
        cells.append(Cell(r["preset"], r["quant"], r["tokens"], r["experts"], r["us"],
                          None if old is None else old.measured_us, "" if old is None else old.note))
    return cells


def regressions(cells: list[Cell], tolerance: float) -> list[Cell]:
    """The cells slower than the profile by more than ``tolerance`` (0.15: 15%)."""
    if not 0 <= tolerance < 10:
        raise MoEConfigError(f"tolerance must be in [0, 10), a fraction of the profile's time (got {tolerance})")
    return [c for c in cells if c.ratio is not None and c.ratio > 1 + tolerance]


def table(cells: list[Cell], tolerance: float) -> str:
    slow = set(regressions(cells, tolerance))
    lines = ["| preset | scheme | M | backend | profile us | new us | new / profile | |",
             "|---|---|---|---|---|---|---|---|"]
    ordered = sorted(cells, key=lambda c: (c not in slow, c.preset, c.quant, c.backend, c.tokens))
    for c in ordered:
        verdict = "REGRESSED" if c in slow else ("new" if c.ratio is None else "")
        old = "-" if c.profile_us is None else f"{c.profile_us:.1f}"
        ratio = "-" if c.ratio is None else f"{c.ratio:.2f}x"
        lines.append(f"| {c.preset} | {c.quant} | {c.tokens} | {c.backend} | {old} | {c.new_us:.1f} | {ratio} | {verdict} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bench_json", help="a `python -m moe bench --json` file")
    parser.add_argument("--machine", required=True, help="the machine kind it ran on, e.g. nvidia-h100")
    parser.add_argument("--tolerance", type=float, default=0.15, help="allowed slowdown (default 0.15 = 15%%)")
    args = parser.parse_args(argv)
    path = Path(args.bench_json)
    if not path.is_file():
        raise MoEConfigError(f"bench_json {str(path)!r} is not a file; pass what `python -m moe bench --json` wrote")
    records = json.loads(path.read_text()).get("records")
    if not records:
        raise MoEConfigError(f"bench_json {str(path)!r} holds no 'records'; pass what `python -m moe bench --json` wrote")
    cells = compare(records, args.machine)
    print(table(cells, args.tolerance))
    slow = regressions(cells, args.tolerance)
    print(f"\n{len(slow)} of {len(cells)} cells slower than measured-{_machines()[args.machine].kind}.yaml "
          f"by more than {args.tolerance:.0%}")
    return 1 if slow else 0


if __name__ == "__main__":
    raise SystemExit(main())
