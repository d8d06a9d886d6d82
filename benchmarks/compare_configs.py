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
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe.errors import MoEConfigError, UnsupportedError  # noqa: E402
from moe.experts._triton.config import ConfigKey, ConfigTable, LaunchConfig  # noqa: E402
from moe.presets import load_preset  # noqa: E402
from moe.tools.bench import build_weights  # noqa: E402
from moe.tools.tune import make_case, time_configs  # noqa: E402


def config_source(text: str, key: ConfigKey, table: ConfigTable):
    """``--config``'s value as a function of M: the loaded ``table``'s lookup, a table file's, or one config."""
    if text == "table":
        return table.lookup
    if not text.lstrip().startswith("{"):
        path = Path(text)
        if not path.is_file():
            raise MoEConfigError(f"--config {text}: not 'table', a LaunchConfig as JSON, or an existing table file")
        data = json.loads(path.read_text())
        theirs = ConfigKey(**data["key"])
        if dataclasses.replace(theirs, device=key.device) != key:
            raise MoEConfigError(f"--config {text}: the table is for {theirs}, not this problem's {key} "
                                 "(only the device may differ)")
        return ConfigTable.from_json(theirs, data).lookup
    data = json.loads(text)
    data.setdefault("gemm2", data["gemm1"])
    config = LaunchConfig.from_dict(data)
    return lambda tokens: config


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", required=True)
    parser.add_argument("--quant", default="bf16")
    parser.add_argument("--tokens", required=True, help="comma-separated token counts M >= 1")
    parser.add_argument("--config", action="append", required=True,
                        help="'table', a table file, or a LaunchConfig as JSON (repeat: each is timed)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the rows (M, each config and its us) to this file")
    args = parser.parse_args(argv)
    try:
        tokens = sorted({int(t) for t in args.tokens.split(",")})
    except ValueError:
        raise MoEConfigError(f"--tokens {args.tokens}: expected comma-separated integers >= 1") from None
    if tokens[0] < 1:
        raise MoEConfigError(f"--tokens {args.tokens}: every M must be >= 1")
    if not torch.cuda.is_available():
        raise UnsupportedError("compare_configs.py needs a CUDA GPU, and torch finds none on this machine")
    device = torch.device("cuda")
    preset = load_preset(args.preset)
    weights = build_weights(preset.problem(quant=args.quant, max_tokens=max(tokens)), device)
    table = make_case(preset, args.quant, tokens[0], weights, device).weights.configs
    sources = [config_source(text, table.key, table) for text in args.config]
    rows = compare(lambda m: make_case(preset, args.quant, m, weights, device), sources, tokens, args.rounds)
    labels = ["table" if text == "table" else f"#{i + 1}" for i, text in enumerate(args.config)]
    for label, text in zip(labels, args.config, strict=True):
        if label != text:
            print(f"{label}: {text}")
    for row in rows:
        print(format_row(row, labels))
    if args.json:
        Path(args.json).write_text(json.dumps({"preset": args.preset, "quant": args.quant, "rounds": args.rounds,
                                               "configs": args.config, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
