"""Times the ``triton`` experts under several launch configs at one M, with the bench's method.

    python benchmarks/compare_configs.py --preset mixtral-8x7b --tokens 256 \
        --config '{"block_m": 128, "gemm1": {"block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 4}, ...}' \
        --config table

Each ``--config`` is a `LaunchConfig` as JSON (the tables' format; omitted tile fields take their
defaults) or ``table`` for what the shipped table picks. The tuner times the two GEMMs apart and
briefly; this times the whole experts stage (alignment and combine included) like ``python -m moe
bench`` -- CUDA-graph replays over rotating inputs, a 300 ms budget per config -- so a tuned choice
can be checked before it is committed. Configs run interleaved, ``--rounds`` times, and the median
of the rounds is printed, so a clock drift during the run hits every config alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe.bench import backend_calls, build_weights, make_inputs, time_calls  # noqa: E402
from moe.experts._triton import config as cfg  # noqa: E402
from moe.experts.triton import TritonExperts  # noqa: E402
from moe.presets import load_preset  # noqa: E402


def parse_config(text: str) -> cfg.LaunchConfig | None:
    if text == "table":
        return None
    data = json.loads(text)
    data.setdefault("gemm2", data["gemm1"])
    return cfg.LaunchConfig.from_dict(data)


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
    problem = preset.problem(quant=args.quant, max_tokens=args.tokens)
    weights = build_weights(problem, device)
    inputs = make_inputs(preset, problem, args.tokens, 4, device)
    configs = [parse_config(c) for c in args.config]
    table_lookup = cfg.ConfigTable.lookup
    times: dict[int, list[float]] = {i: [] for i in range(len(configs))}
    for _ in range(args.rounds):
        for i, config in enumerate(configs):
            cfg.ConfigTable.lookup = table_lookup if config is None else (lambda self, m, c=config: c)
            try:
                calls = backend_calls(TritonExperts, problem, weights, inputs, device)
                times[i].append(time_calls(calls, graphs=True))
            finally:
                cfg.ConfigTable.lookup = table_lookup
    for i, config in enumerate(configs):
        shown = "table: " + repr(table_lookup(TritonExperts(problem).prepare_weights(weights).configs, args.tokens)) \
            if config is None else repr(config)
        rounds = " ".join(f"{t:.1f}" for t in times[i])
        print(f"{statistics.median(times[i]):9.1f} us  (rounds {rounds})  {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
