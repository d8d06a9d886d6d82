"""Sweeps tma_a=True tiles (A rows gathered in sorted order, A and W by TMA: gemm_tma_a.py) against the
shipped table's config and FlashInfer's CUTLASS MoE, the whole experts stage per cell, on one SM90 GPU in
one run (~5 min)::

    timeout 590 python3 benchmarks/tma_a_gemm.py --out $OUT/tma_a_gemm.json   # cells also print as they finish

For each preset and M: every candidate config is run once (a tile that does not fit the GPU, or does not
compile, is reported and dropped), then the table's config and the survivors take turns
(`moe.tools.tune.time_configs`: CUDA graphs, median of ``--rounds``); FlashInfer CUTLASS is timed the way
``python -m moe bench`` times it, when it imports and serves the problem. Prints a markdown table (the best
tma_a config per cell, its speed-up over the table's config and over FlashInfer) and writes every time as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe.experts._triton.config import ConfigTable, LaunchConfig, TileConfig  # noqa: E402
from moe.experts.triton import TritonExperts  # noqa: E402
from moe.platform import Platform  # noqa: E402
from moe.presets import load_preset  # noqa: E402
from moe.registry import get_experts  # noqa: E402
from moe.tools.bench import backend_calls, build_weights, time_calls  # noqa: E402
from moe.tools.tune import make_case, time_configs  # noqa: E402

PRESETS = ("mixtral-8x7b", "deepseek-v3-ep8-slice", "qwen3-30b-a3b")
TOKENS = (256, 1024, 4096)
# (block_m, gemm1 (block_n, num_warps, num_stages), gemm2's, gemm2 tma_a). 4 or 8 warps is a tuning choice
# (on the H100, 8 won at BLOCK_M 128, 4 at BLOCK_M 64). A gated 128 x 256 tile does not fit in shared memory
# (248 KB at 3 stages): 256 columns for gemm2 only. Each kernel compiles per preset (E_PAD differs): seconds
# each, most of a cold run's time.
CANDIDATES = (
    (128, (128, 4, 4), (128, 4, 4), True),
    (128, (128, 4, 4), (256, 4, 3), True),
    (64, (128, 4, 4), (128, 4, 4), True),
    (64, (128, 4, 4), (256, 4, 3), True),
    (128, (128, 4, 3), (128, 4, 3), True),
    (128, (128, 8, 3), (128, 8, 3), True),
    (128, (128, 4, 4), (128, 4, 4), False),
)


def tma_a_config(block_m: int, first: tuple, second: tuple, gemm2_tma_a: bool) -> LaunchConfig:
    def tile(block_n, num_warps, num_stages, tma_a):
        return TileConfig(block_n, 64, 8, num_warps, num_stages, tma=True, tma_a=tma_a)

    return LaunchConfig(block_m, tile(*first, True), tile(*second, gemm2_tma_a))


def label(config: LaunchConfig) -> str:
    t1, t2 = config.gemm1, config.gemm2
    return (f"m{config.block_m} n{t1.block_n}/{t2.block_n} w{t1.num_warps} s{t1.num_stages}/{t2.num_stages}"
            + ("" if t2.tma_a else " (gemm2 pointer)"))


def runnable(case, config: LaunchConfig) -> str | None:
    """None when ``config`` runs (compiling it on the way), else why not."""
    tokens = case.inputs[0][0].shape[0]
    only = dataclasses.replace(case.weights, configs=ConfigTable(case.weights.configs.key, ((tokens, config),)))
    try:
        backend_calls(TritonExperts, case.problem, None, case.inputs, case.inputs[0][0].device,
                      experts=case.experts, prepared=only)[0]()
        torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 -- out of shared memory, a compile failure: reported, dropped
        lines = str(error).strip().splitlines() or [""]
        return f"{type(error).__name__}: {lines[0][:160]}"
    return None


def flashinfer_us(case, weights, platform) -> float | None:
    try:
        cls = get_experts("flashinfer_cutlass")
        if cls.check(case.problem, platform):
            return None
        return time_calls(backend_calls(cls, case.problem, weights, case.inputs, case.inputs[0][0].device), graphs=True)
    except Exception as error:  # noqa: BLE001 -- flashinfer absent or refusing: the column stays empty
        print(f"  flashinfer_cutlass: {type(error).__name__}: {str(error)[:160]}", file=sys.stderr)
        return None


def sweep_cell(preset, tokens: int, weights, platform, rounds: int) -> dict:
    device = torch.device("cuda")
    case = make_case(preset, "bf16", tokens, weights, device)
    table = case.weights.configs.lookup(tokens)
    configs, skipped = [], {}
    for candidate in CANDIDATES:
        config = tma_a_config(*candidate)
        why = runnable(case, config)
        if why is None:
            configs.append(config)
        else:
            skipped[label(config)] = why
    times = time_configs(case, [table, *configs], rounds)
    tma_a_times = {label(c): us for c, us in zip(configs, times[1:])}
    best = min(tma_a_times, key=tma_a_times.get) if tma_a_times else None
    return dict(preset=preset.name, tokens=tokens, table_config=table.to_dict(), table_us=times[0],
                tma_a_us=tma_a_times, skipped=skipped, best_tma_a=best, best_tma_a_us=tma_a_times.get(best),
                flashinfer_us=flashinfer_us(case, weights, platform))


def markdown(cells: list[dict]) -> str:
    lines = ["| preset | M | table µs | best tma_a config | tma_a µs | tma_a vs table | FlashInfer µs "
             "| tma_a vs FlashInfer |", "|---|---|---|---|---|---|---|---|"]
    for c in cells:
        us = c["best_tma_a_us"]
        fi = c["flashinfer_us"]
        vs_table = f"{c['table_us'] / us:.3f}x" if us else "-"
        vs_fi = f"{fi / us:.3f}x" if us and fi else "-"
        lines.append(f"| {c['preset']} | {c['tokens']} | {c['table_us']:.1f} | {c['best_tma_a'] or '-'} | "
                     f"{us or float('nan'):.1f} | {vs_table} | {fi or float('nan'):.1f} | {vs_fi} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", nargs="+", default=list(PRESETS))
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, help="JSON file for every time")
    args = parser.parse_args(argv)
    platform = Platform.detect()
    cells, start = [], time.time()
    for name in args.presets:
        preset = load_preset(name)
        weights = build_weights(preset.problem(quant="bf16", max_tokens=max(args.tokens)), torch.device("cuda"))
        for tokens in args.tokens:
            cell = sweep_cell(preset, tokens, weights, platform, args.rounds)
            cells.append(cell)
            print(f"{name} M={tokens}: table {cell['table_us']:.1f} us, best tma_a {cell['best_tma_a']} "
                  f"{cell['best_tma_a_us']} us, flashinfer {cell['flashinfer_us']} ({time.time() - start:.0f} s)",
                  file=sys.stderr, flush=True)
            if args.out:  # after every cell: a run cut short keeps what it measured
                write_json(args.out, cells)
        del weights
        torch.cuda.empty_cache()
    print(markdown(cells))
    return 0


def write_json(path: Path, cells: list[dict]) -> None:
    import triton

    meta = dict(device=torch.cuda.get_device_name(), triton=triton.__version__, torch=torch.__version__,
                date=time.strftime("%Y-%m-%d"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(meta=meta, cells=cells), indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
