"""Cold and warm load times of a layer, and its first forward, with the tuning cache (``moe.cache``).

Each layer is loaded twice, each time in a fresh Python process, both with one temporary
``MOE_CACHE_DIR``: the first load tunes and fills the cache (cold), the second reads it (warm). Load
time is ``FusedMoE(...)`` plus ``load_weights`` (quantizing, preparing, warm-up/autotuning), with the
random weights (`moe.synthetic.random_dense`) drawn on the GPU beforehand; first forward is the first
call after the load, M=128 tokens, synchronized. The experts are the oracle's choice.

    PYTHONPATH=. python benchmarks/load_time.py            # both layers, a markdown table on stdout
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

LAYERS = {  # name -> (preset, scheme)
    "GPT-OSS-120B MXFP4": ("gpt-oss-120b", "mxfp4"),
    "Qwen3-30B-A3B bf16": ("qwen3-30b-a3b", "bf16"),
}
MAX_TOKENS = 4096
FORWARD_TOKENS = 128


def measure(name: str) -> dict:
    """One load and first forward of layer ``name`` in this process (the child's work)."""
    from moe import FusedMoE
    from moe.presets import load_preset
    from moe.synthetic import random_dense

    preset_name, quant = LAYERS[name]
    preset = load_preset(preset_name)
    device = torch.device("cuda")
    start = time.perf_counter()
    layer = FusedMoE(preset.num_experts, preset.top_k, preset.hidden_size, preset.intermediate_size,
                     activation=preset.activation, quant=quant, routing=preset.routing, has_bias=preset.has_bias,
                     dtype=torch.bfloat16, device=device, max_tokens=MAX_TOKENS, **preset.router_options())
    build_s = time.perf_counter() - start
    weights = random_dense(layer.problem, torch.Generator(device=device).manual_seed(1), device, torch.bfloat16)
    torch.cuda.synchronize()
    start = time.perf_counter()
    layer.load_weights(**weights)
    torch.cuda.synchronize()
    load_s = build_s + time.perf_counter() - start
    hidden = torch.randn(FORWARD_TOKENS, preset.hidden_size, device=device, dtype=torch.bfloat16)
    logits = torch.randn(FORWARD_TOKENS, preset.num_experts, device=device)
    torch.cuda.synchronize()
    start = time.perf_counter()
    layer(hidden, logits)
    torch.cuda.synchronize()
    return {"load_s": load_s, "forward_s": time.perf_counter() - start, "kernel": repr(layer.kernel)}


def in_fresh_process(name: str, cache_dir: str) -> dict:
    env = {**os.environ, "MOE_CACHE_DIR": cache_dir}
    done = subprocess.run([sys.executable, __file__, "--child", name], env=env, check=True,
                          stdout=subprocess.PIPE, text=True)  # stderr (the tuning bar) passes through
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", choices=list(LAYERS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child)))
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="moe-cache-") as cache_dir:
        for name in LAYERS:
            cold, warm = in_fresh_process(name, cache_dir), in_fresh_process(name, cache_dir)
            rows.append(f"| {name} | {cold['kernel']} | {cold['load_s']:.1f} | {warm['load_s']:.1f} | "
                        f"{cold['forward_s'] * 1e3:.1f} | {warm['forward_s'] * 1e3:.1f} |")
    print(f"{torch.cuda.get_device_name()}, max_tokens={MAX_TOKENS}, first forward M={FORWARD_TOKENS}\n")
    print("| layer | kernel | cold load (s) | warm load (s) | first forward, cold (ms) | first forward, warm (ms) |")
    print("| --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
