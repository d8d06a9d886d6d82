"""Times the ``triton`` experts under several launch configs or tables at one or more M, end to end, like the bench.

    python benchmarks/compare_configs.py --preset mixtral-8x7b --tokens 256 --config table \\
        --config '{"block_m": 128, "gemm1": {"block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 4, "tma": true}}'
    python benchmarks/compare_configs.py --preset mixtral-8x7b --tokens 128,256,384,512,1024 --rounds 5 \\
        --config table --config /tmp/tuned/E=8,k=2,H=4096,I=14336,silu,bf16,standard,NVIDIA_H200.json --json ab.json

Each ``--config`` is one of:

- ``table``: what a load takes at each M (the tuning cache's table, else the packaged one);
- a table file, as ``python -m moe tune --out DIR`` writes them: the config its lookup takes at each M (its key's
  shapes, activation, scheme and format must be the problem's; the GPU may differ);
- a `LaunchConfig` as JSON (the tables' format; omitted tile fields take their defaults, an omitted ``gemm2``
  copies ``gemm1``), the same at every M.

At each M the configs take turns, ``--rounds`` times (`moe.tools.tune.time_configs`, the tuner's rounds), so a
re-tuned table can be checked against the shipped one before it is committed -- at the buckets and between them,
where a lookup takes the nearest bucket's config. An M where every config is the same is not timed. The first
config is the baseline of the ratio column.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe.errors import MoEConfigError, UnsupportedError  # noqa: E402
from moe.experts._triton.config import ConfigKey, ConfigTable, LaunchConfig  # noqa: E402
from moe.experts._triton.support import config_key  # noqa: E402
from moe.presets import load_preset  # noqa: E402
from moe.tools.bench import build_weights  # noqa: E402
from moe.tools.tune import make_case, time_configs  # noqa: E402


def config_source(text: str, key: ConfigKey, table: ConfigTable):
    """``--config``'s value as a function of M: the loaded ``table``'s lookup, a table file's, or one config."""
    if text == "table":
        return table.lookup
    inline = text.lstrip().startswith("{")
    if not inline and not Path(text).is_file():
        raise MoEConfigError(f"--config {text}: not 'table', a LaunchConfig as JSON, or an existing table file")
    try:
        data = json.loads(text if inline else Path(text).read_text())
        if inline:
            data.setdefault("gemm2", data["gemm1"])
            config = LaunchConfig.from_dict(data)
            return lambda tokens: config
        theirs = ConfigKey(**data["key"])
        theirs_table = ConfigTable.from_json(theirs, data)
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        what = "a LaunchConfig as JSON" if inline else "a table file as moe tune writes it"
        raise MoEConfigError(f"--config {text}: not {what} ({type(error).__name__}: {error})") from None
    if dataclasses.replace(theirs, device=key.device) != key:
        raise MoEConfigError(f"--config {text}: the table is for {theirs}, not this problem's {key} "
                             "(only the device may differ)")
    return theirs_table.lookup


def compare(case_for, sources: list, tokens: list[int], rounds: int, timer=time_configs) -> list[dict]:
    """For each M, the configs the ``sources`` take there, timed in turn (``timer``); rows of M, configs and us
    (None where every source takes the same config)."""
    rows = []
    for m in tokens:
        configs = [source(m) for source in sources]
        us = None if len(set(configs)) == 1 else timer(case_for(m), configs, rounds=rounds)
        rows.append({"tokens": m, "us": us, "configs": [c.to_dict() for c in configs]})
    return rows


def format_row(row: dict, labels: list[str]) -> str:
    if row["us"] is None:
        return f"M = {row['tokens']:>6}: the same config under {', '.join(labels)}"
    base = row["us"][0]
    return f"M = {row['tokens']:>6}: " + ", ".join(
        f"{label} {us:.1f} us" + ("" if i == 0 else f" ({us / base:.3f}x)")
        for i, (label, us) in enumerate(zip(labels, row["us"], strict=True)))


def plot_ratios(path: str | Path, series: dict[str, list[tuple[int, float]]], title: str,
                ylabel: str = "time / the first config's (< 1: faster)") -> None:
    """Each series' (M, time / baseline's time) against M, log-x, with the line where they are equal."""
    import matplotlib  # optional: --plot checks that it is installed before the run

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, points in series.items():
        ms, ratios = zip(*sorted(points), strict=True)
        ax.semilogx(ms, ratios, "o-", label=label)
    ax.axhline(1.0, color="k", linewidth=0.8)
    ms = sorted({m for points in series.values() for m, _ in points})
    ax.set_xticks(ms, [str(m) for m in ms], minor=False)
    ax.set_xticks([], minor=True)
    ax.set_xlabel("tokens M")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ratio_series(rows: list[dict], labels: list[str]) -> dict[str, list[tuple[int, float]]]:
    """Each config after the first: (M, its time / the first's) at the M where they were timed."""
    return {label: [(row["tokens"], row["us"][i] / row["us"][0]) for row in rows if row["us"] is not None]
            for i, label in enumerate(labels) if i > 0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", required=True)
    parser.add_argument("--quant", default="bf16")
    parser.add_argument("--tokens", required=True, help="comma-separated token counts M >= 1")
    parser.add_argument("--config", action="append", required=True,
                        help="'table', a table file, or a LaunchConfig as JSON (repeat: each is timed)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the rows (M, each config and its us) to this file")
    parser.add_argument("--plot", default=None, help="draw each config's time over the first's against M (.png)")
    args = parser.parse_args(argv)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise MoEConfigError(f"--plot {args.plot}: needs matplotlib, which is not installed (pip install matplotlib)")
    try:
        tokens = sorted({int(t) for t in args.tokens.split(",")})
    except ValueError:
        raise MoEConfigError(f"--tokens {args.tokens}: expected comma-separated integers >= 1") from None
    if tokens[0] < 1:
        raise MoEConfigError(f"--tokens {args.tokens}: every M must be >= 1")
    if args.rounds < 1:
        raise MoEConfigError(f"--rounds {args.rounds}: must be >= 1")
    if not torch.cuda.is_available():
        raise UnsupportedError("compare_configs.py needs a CUDA GPU, and torch finds none on this machine")
    device = torch.device("cuda")
    preset = load_preset(args.preset)
    problem = preset.problem(quant=args.quant, max_tokens=max(tokens))
    weights = build_weights(problem, device)
    table = ConfigTable.load(config_key(problem, "standard", device))  # what TritonExperts.prepare_weights loads
    sources = [config_source(text, table.key, table) for text in args.config]
    rows = compare(lambda m: make_case(preset, args.quant, m, weights, device), sources, tokens, args.rounds)
    labels = ["table" if text == "table" else f"#{i + 1}" for i, text in enumerate(args.config)]
    for label, text in zip(labels, args.config, strict=True):
        if label != text:
            print(f"{label}: {text}")
    for row in rows:
        print(format_row(row, labels))
    if args.plot:
        plot_ratios(args.plot, ratio_series(rows, labels), f"{args.preset} {args.quant}: against {labels[0]}")
    if args.json:
        Path(args.json).write_text(json.dumps({"preset": args.preset, "quant": args.quant, "rounds": args.rounds,
                                               "configs": args.config, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
