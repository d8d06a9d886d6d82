"""Times the ``triton`` experts under several launch configs at one M, end to end, like the bench.

    python benchmarks/compare_configs.py --preset mixtral-8x7b --tokens 256 --config table \
        --config '{"block_m": 128, "gemm1": {"block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 4, "tma": true}}'

Each ``--config`` is a `LaunchConfig` as JSON (the tables' format; omitted tile fields take their
defaults, an omitted ``gemm2`` copies ``gemm1``) or ``table`` for what the shipped table picks. The
configs take turns, ``--rounds`` times (`moe.tools.tune.time_configs`, the tuner's final round), so a hand
choice can be checked against the table before it is committed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe.tools.bench import build_weights  # noqa: E402
from moe.experts._triton.config import LaunchConfig  # noqa: E402
from moe.presets import load_preset  # noqa: E402
from moe.tools.tune import make_case, time_configs  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", required=True)
    parser.add_argument("--quant", default="bf16")
    parser.add_argument("--tokens", type=int, required=True)
    parser.add_argument("--config", action="append", required=True, help="LaunchConfig JSON, or 'table'")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    preset = load_preset(args.preset)
    weights = build_weights(preset.problem(quant=args.quant, max_tokens=args.tokens), device)
    case = make_case(preset, args.quant, args.tokens, weights, device)
    configs = []
    for text in args.config:
        if text == "table":
            configs.append(case.weights.configs.lookup(args.tokens))
            continue
        data = json.loads(text)
        data.setdefault("gemm2", data["gemm1"])
        configs.append(LaunchConfig.from_dict(data))
    for us, config, text in zip(time_configs(case, configs, args.rounds), configs, args.config):
        print(f"{us:9.1f} us  {'table: ' if text == 'table' else ''}{config!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
