"""What ``python -m moe bench`` writes: its records, the tables, the JSON and profile files, the plot,
and the peer targets it compares against (a data file under ``benchmarks/``, read when present).

A targets file (YAML) holds one peer's times and the goal against it::

    name: peer-kernel               # heads the peer's column
    quant: bf16                     # the scheme the times are for
    us: {qwen3-30b-a3b: {1: 40.0, 16: 210.0}}     # preset -> M -> microseconds
    baselines: [torch_grouped]      # backends timed as peers; every other backend is "ours"
    goal: {speedup: 1.1, match_at: 0.9}
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping

import yaml

from moe.errors import MoEConfigError
from moe.oracle.profile import ProfileEntry
from moe.oracle.profile import save_profile as write_profile
from moe.platform import Platform
from moe.presets import load_preset


@dataclass(frozen=True)
class Ceilings:
    """The device's rates the run measured (`moe.platform.Platform.measure_rates`), as the JSON records them."""

    device: str
    bandwidth: float  # bytes/s, device-to-device copy (read + write)
    bf16_flops: float  # FLOP/s, bf16 matrix product
    fp8_flops: float  # FLOP/s, e4m3 matrix product (the preset's ratio to bf16 where unmeasurable)

    @classmethod
    def of(cls, platform: Platform) -> "Ceilings":
        return cls(platform.name, platform.memory_bandwidth, platform.peak_flops("bf16"), platform.peak_flops("fp8"))


@dataclass(frozen=True)
class Record:
    """One backend timed on one (preset, scheme, M); rates and roofline from `moe.oracle.cost.roofline`."""

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
    target_us: float | None = None  # the peer's time from the targets file, where it has one
    rounds_us: list[float] | None = None  # each round's time where the backends took turns (``--rounds``); us: median


@dataclass(frozen=True)
class Targets:
    """One peer's times and the goal against it, read from a data file (`load_targets`)."""

    name: str
    quant: str
    us: Mapping[tuple[str, int], float]  # (preset, M) -> microseconds
    baselines: tuple[str, ...]  # this package's backends timed as peers
    speedup: float  # ours must run this many times faster than the better peer...
    match_at: float  # ...or as fast, where that peer already runs at this fraction of the roofline

    def time(self, preset: str, quant: str, tokens: int) -> float | None:
        return self.us.get((preset, tokens)) if quant == self.quant else None


def load_targets(path: str | Path) -> Targets:
    """The targets file at ``path`` (format in the module docstring); MoEConfigError naming the file
    and the field when it is malformed."""
    data = yaml.safe_load(Path(path).read_text())
    try:
        us = {(preset, int(m)): float(t) for preset, times in data["us"].items() for m, t in times.items()}
        targets = Targets(str(data["name"]), str(data["quant"]), us, tuple(data.get("baselines", ())),
                          float(data["goal"]["speedup"]), float(data["goal"]["match_at"]))
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise MoEConfigError(f"--targets {path}: needs name, quant, us (preset -> M -> microseconds) and "
                             f"goal.speedup / goal.match_at numbers ({type(error).__name__}: {error})") from None
    if targets.speedup < 1 or not 0 < targets.match_at <= 1:
        raise MoEConfigError(f"--targets {path}: goal.speedup must be >= 1 and goal.match_at in (0, 1] "
                             f"(got {targets.speedup}, {targets.match_at})")
    return targets


def format_table(records: list[Record], target: str = "target") -> str:
    """One markdown table per (preset, quant): backends side by side, the ``target`` peer's time where known."""
    lines = []
    for preset, quant in sorted({(r.preset, r.quant) for r in records}):
        rows = [r for r in records if (r.preset, r.quant) == (preset, quant)]
        names = list(dict.fromkeys(r.experts for r in rows))
        lines += ["", f"### {preset} {quant}", ""]
        head = "| M | " + " | ".join(f"{n} us | {n} TF/s | {n} GB/s | {n} %roof" for n in names)
        has_target = any(r.target_us for r in rows)
        head += f" | {target} us |" if has_target else " |"
        lines += [head, "|" + "---|" * (head.count("|") - 1)]
        for m in sorted({r.tokens for r in rows}):
            by_name = {r.experts: r for r in rows if r.tokens == m}
            cells = []
            for n in names:
                r = by_name.get(n)
                cells.append(f"{r.us:.1f} | {r.tflops:.1f} | {r.gbps:.0f} | {r.roofline_fraction:.0%}" if r else "- | - | - | -")
            peer = next((r.target_us for r in by_name.values() if r.target_us), None)
            lines.append(f"| {m} | " + " | ".join(cells) + (f" | {peer or '-'} |" if has_target else " |"))
    return "\n".join(lines)


def format_targets(records: list[Record], ceilings: Ceilings, targets: Targets) -> str:
    """The goal, cell by cell: our best backend (any but the targets' baselines) against the better of
    the peers (the targets' time and the measured baselines) -- ``targets.speedup`` times faster, or as
    fast where that better peer, whichever it is, already runs at ``targets.match_at`` of the roofline -- and
    where ours stands."""
    lines = []
    for preset in sorted({r.preset for r in records if r.target_us}):
        rows = [r for r in records if r.preset == preset and r.target_us]
        lines += ["", f"### {preset} {rows[0].quant}", "",
                  f"| M | ours us (backend) | {targets.name} us (its %roof) | best baseline us (backend) | need <= "
                  "| vs best peer | ours %roof | ours % of peak | met |", "|---|---|---|---|---|---|---|---|---|"]
        for m in sorted({r.tokens for r in rows}):
            cell = [r for r in rows if r.tokens == m]
            ours = min((r for r in cell if r.experts not in targets.baselines), key=lambda r: r.us, default=None)
            if ours is None:
                continue
            base = min((r for r in cell if r.experts in targets.baselines), key=lambda r: r.us, default=None)
            baseline = base.us if base else None
            peer = cell[0].target_us
            peer_roof = cell[0].roofline_us / peer
            best_peer = min(peer, baseline or peer)
            match = cell[0].roofline_us / best_peer >= targets.match_at  # the better peer is near the roofline
            need = best_peer if match else best_peer / targets.speedup
            met = "yes" + (" (match)" if match else "") if ours.us <= need else "no"
            lines.append(
                f"| {m} | {ours.us:.1f} ({ours.experts}) | {peer} ({peer_roof:.0%}) | "
                f"{f'{baseline:.1f} ({base.experts})' if base else '-'} | {need:.1f} | {best_peer / ours.us:.2f}x | "
                f"{ours.roofline_fraction:.0%} | {ours.tflops * 1e12 / ceilings.bf16_flops:.0%} | {met} |")
    return "\n".join(lines)


def format_against_bf16(records: list[Record]) -> str:
    """Each quantized scheme against bf16 where one run timed both for a preset and M: the fastest
    backend of each, and the speed-up (bf16 us / the scheme's us). A quantized layer moves fewer bytes
    (and, W8A8, runs faster tensor cores), so a speed-up below 1 marks a cell to fix."""
    fastest = {}
    for r in records:
        key = (r.preset, r.quant, r.tokens)
        if key not in fastest or r.us < fastest[key].us:
            fastest[key] = r
    lines = []
    for preset, quant in sorted({(p, q) for p, q, _ in fastest if q != "bf16"}):
        cells = sorted(m for p, q, m in fastest if (p, q) == (preset, quant) and (p, "bf16", m) in fastest)
        if not cells:
            continue
        lines += ["", f"### {preset}: {quant} against bf16", "",
                  f"| M | {quant} us (backend) | bf16 us (backend) | bf16 / {quant} | slower than bf16 |",
                  "|---|---|---|---|---|"]
        for m in cells:
            q, b = fastest[(preset, quant, m)], fastest[(preset, "bf16", m)]
            lines.append(f"| {m} | {q.us:.1f} ({q.experts}) | {b.us:.1f} ({b.experts}) | {b.us / q.us:.2f}x | "
                         f"{'yes' if q.us > b.us else 'no'} |")
    return "\n".join(lines)


def write_json(path: str | Path, ceilings: Ceilings, records: list[Record], machine: str) -> None:
    data = {"machine": machine, "ceilings": asdict(ceilings), "records": [asdict(r) for r in records]}
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def save_profile(path: str | Path, ceilings: Ceilings, records: list[Record]) -> None:
    """Writes the measurements in the oracle's profile format (moe/oracle/profile.py), merged into
    ``path`` if it exists; the oracle reads it through ``MOE_PROFILE=path`` or a policy's ``profiles``.
    The profile keeps the times: the oracle divides them into the same roofline the bench does."""
    platform = Platform.detect()
    entries = [
        ProfileEntry.measurement(r.experts, platform, load_preset(r.preset).problem(quant=r.quant, max_tokens=r.tokens),
                                 r.tokens, r.us, preset=r.preset,
                                 note=f"{r.roofline_fraction:.0%} of roofline on {ceilings.device}")
        for r in records
    ]
    write_profile(path, entries, description=f"measured by python -m moe bench on {ceilings.device}")


def plot(path: str | Path, records: list[Record], target: str = "target") -> None:
    """Microseconds (log-log) and %-roofline against M, one column per (preset, quant)."""
    import matplotlib  # optional: `--plot` checks that it is installed before the run

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
        peer = sorted((r.tokens, r.target_us) for r in rows if r.target_us and r.experts == rows[0].experts)
        if peer:
            axes[0][col].loglog(*zip(*peer), "k--", label=f"{target} (targets file)")
        axes[0][col].set_title(f"{preset} {quant}", fontsize=9)
        axes[0][col].set_ylabel("us")
        axes[1][col].set_ylabel("% of roofline")
        axes[1][col].set_xlabel("tokens M")
        axes[1][col].set_ylim(0, max(105, 5 + max(100 * r.roofline_fraction for r in rows)))
        axes[0][col].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
