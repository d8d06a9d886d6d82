"""GPU, fp8_block, in one process: the fp8 decode choices of a preset's shipped table against the alternatives, each
side timed under CUDA graphs alternately (round after round), its output compared with the table's.

Sides: ``table`` (what the table's ``decode`` section picks: its tiles, "grouped" or the shared config), ``shared``
(`decode.FP8_DECODE_CONFIGS`, the section unread) and ``grouped`` (the grouped GEMMs, no decode kernels)::

    python benchmarks/decode_tables_ab.py deepseek-v3-ep8-slice,qwen3-30b-a3b 2,4,5,6,7,8 [table,shared,grouped]

``ROUNDS`` (default 3) sets the rounds. Writes ``$OUT/decode_tables_ab.json``: µs per side and round, per cell, and
each side's largest difference from the table's output relative to its largest value. Results:
benchmarks/results/fp8_decode_nvidia-h200.md.
"""

import json
import os
import sys
from contextlib import contextmanager

import torch

from moe.experts import triton as triton_experts
from moe.experts._triton import decode
from moe.experts.triton import TritonExperts
from moe.formats import ActivationFormat, Dispatched, DispatchShape
from moe.presets import load_preset
from moe.quant import QuantizedTensor
from moe.tools.bench import build_weights
from moe.workspace import WorkspaceManager
from tests.gpu.test_triton_gpu import topk_for
from tests.helpers import benchmark_script

SIDES = {
    "table": None,  # the experts' own lookup
    "shared": lambda m, *table: decode.fp8_decode_config(m),
    "grouped": lambda m, *table: None,
}


@contextmanager
def side(name: str):
    """The experts' fp8 decode choice replaced by side ``name``'s (`SIDES`) while the block runs."""
    if name not in SIDES:
        raise ValueError(f"side must be one of {', '.join(SIDES)} (got {name!r})")
    saved = triton_experts.fp8_decode_config
    if SIDES[name] is not None:
        triton_experts.fp8_decode_config = SIDES[name]
    try:
        yield
    finally:
        triton_experts.fp8_decode_config = saved


def main(presets: list[str], tokens_list: list[int], sides: list[str], rounds: int) -> dict:
    timed = benchmark_script("wgmma_tiles_check").timed
    relative = benchmark_script("wgmma_tiles_check").relative
    results = {}
    for preset in presets:
        p = load_preset(preset).problem(quant="fp8_block", max_tokens=max(tokens_list))
        experts = TritonExperts(p)
        prepared = experts.prepare_weights(build_weights(p, torch.device("cuda")))
        ws = WorkspaceManager("cuda").take(
            experts.workspace_shapes(DispatchShape(ActivationFormat.STANDARD, max(tokens_list))))
        for tokens in tokens_list:
            torch.manual_seed(tokens)
            x = torch.randn(tokens, p.hidden_size, device="cuda", dtype=p.dtype)
            dispatched = Dispatched(ActivationFormat.STANDARD, QuantizedTensor(data=x, scale=None, fmt="none"),
                                    topk_for(p, tokens))
            row = {name: [] for name in sides}
            outputs = {}
            for _ in range(rounds):
                for name in sides:
                    with side(name):
                        outputs[name], us = timed(experts, dispatched, prepared, ws)
                    row[name].append(round(us, 1))
            if "table" in outputs:
                row["vs_table"] = {name: relative(out, outputs["table"]) for name, out in outputs.items()}
            best = min(sides, key=lambda name: min(row[name]))
            print(f"{preset} M={tokens}: " + ", ".join(f"{name} {row[name]}" for name in sides)
                  + f" -> fastest {best}; vs table {row.get('vs_table')}", flush=True)
            results[f"{preset} {tokens}"] = row
    return results


if __name__ == "__main__":
    chosen = sys.argv[3].split(",") if len(sys.argv) > 3 else list(SIDES)
    for name in chosen:
        if name not in SIDES:
            raise SystemExit(f"side must be one of {', '.join(SIDES)} (got {name!r})")
    found = main(sys.argv[1].split(","), [int(t) for t in sys.argv[2].split(",")], chosen,
                 int(os.environ.get("ROUNDS", "3")))
    out = os.environ.get("OUT", "/tmp")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "decode_tables_ab.json"), "w") as f:
        json.dump(found, f, indent=1)
