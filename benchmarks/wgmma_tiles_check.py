"""GPU (SM90): fp8_block wgmma tiles against the pointer path of the shipped table, in one process: each tile's
first and second call against the pointer path and (M <= 4096) the float32 reference, and its time (CUDA graphs).

    python benchmarks/wgmma_tiles_check.py qwen3-30b-a3b,deepseek-v3-ep8-slice 1024,4096,16384 \\
        '[[64, 64, 128, 4, 4, 8], [128, 64, 128, 8, 4, 8, 1]]'
    # [block_m, gemm1 n, gemm2 n, warps, stages, group_m(, ws)]: ws 1 sets ws=True on both GEMMs (gemm_ws.py)

Writes $OUT/wg.json (µs per tile and M) and prints the registers and spills of every compiled wgmma kernel.
Session 9's runs: benchmarks/results/fp8_block_wgmma_nvidia-h100.md.
"""

import dataclasses
import json
import os
import sys

import torch
import triton

from moe.experts._triton import kernels
from moe.experts._triton.config import ConfigTable, LaunchConfig, TileConfig
from moe.experts.triton import TritonExperts
from moe.formats import ActivationFormat, Dispatched, DispatchShape
from moe.presets import load_preset
from moe.quant import QuantizedTensor
from moe.testing.tolerance import assert_close_moe, regime_for
from moe.tools.bench import build_weights
from moe.workspace import WorkspaceManager
from tests.gpu.test_triton_gpu import reference, topk_for


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def timed(experts, dispatched, prepared, ws) -> tuple[torch.Tensor, float]:
    """(the first call's output, µs per call under CUDA graphs)."""
    def call():
        return experts.apply(dispatched, prepared, ws)

    first = call().out.float().clone()
    # do_bench_cudagraph warms up on a new stream that does not wait for this one: without the sync its calls
    # overwrite the workspace while the first one still runs (what session 9 first took for a kernel bug)
    torch.cuda.synchronize()
    return first, triton.testing.do_bench_cudagraph(call, rep=int(os.environ.get("REP", "200"))) * 1000


def wgmma_config(block_m, gemm1_n, gemm2_n, warps, stages, group_m, ws=0) -> LaunchConfig:
    tile = TileConfig(gemm1_n, 128, group_m, warps, stages, tma=True, wgmma=True, ws=bool(ws))
    return LaunchConfig(block_m, tile, dataclasses.replace(tile, block_n=gemm2_n))


def main(presets: list[str], tokens_list: list[int], variants: list[list[int]]) -> dict:
    results = {}
    for preset in presets:
        p = load_preset(preset).problem(quant="fp8_block", max_tokens=max(tokens_list))
        weights = build_weights(p, torch.device("cuda"))
        experts = TritonExperts(p)
        prepared = experts.prepare_weights(weights)
        ws = WorkspaceManager("cuda").take(
            experts.workspace_shapes(DispatchShape(ActivationFormat.STANDARD, max(tokens_list))))
        for tokens in tokens_list:
            torch.manual_seed(tokens)
            x = torch.randn(tokens, p.hidden_size, device="cuda", dtype=p.dtype)
            topk = topk_for(p, tokens)
            dispatched = Dispatched(ActivationFormat.STANDARD, QuantizedTensor(data=x, scale=None, fmt="none"), topk)
            base, base_us = timed(experts, dispatched, prepared, ws)
            row = {"pointer": round(base_us, 1)}
            print(f"{preset} M={tokens} pointer {base_us:.1f} us ({prepared.configs.lookup(tokens)})", flush=True)
            ref = reference(p, x, topk, weights) if tokens <= 4096 else None
            for variant in variants:
                config = wgmma_config(*variant)
                only = dataclasses.replace(prepared, configs=ConfigTable(prepared.configs.key, ((tokens, config),)))
                got, us = timed(experts, dispatched, only, ws)
                again = experts.apply(dispatched, only, ws).out.float()
                verdict = ""
                if ref is not None:
                    try:
                        assert_close_moe(got, ref, regime_for(p), context="wgmma")
                        verdict = "reference ok"
                    except AssertionError as error:
                        verdict = f"REFERENCE FAILS: {str(error)[:200]}"
                print(f"   {variant} {us:.1f} us ({base_us / us:.2f}x); first call vs pointer "
                      f"{relative(got, base):.2e}, second call vs pointer {relative(again, base):.2e}; {verdict}",
                      flush=True)
                row[str(tuple(variant))] = round(us, 1)
            results[f"{preset} {tokens}"] = row
    for kernel_fn in (kernels("gemm_wgmma").moe_gemm_fp8_wgmma_kernel, kernels("gemm_ws").moe_gemm_fp8_ws_kernel):
        for caches in kernel_fn.device_caches.values():
            for kernel in caches[0].values():
                print(f"compiled {kernel.name}: {kernel.n_regs} registers, {kernel.n_spills} spills, "
                      f"{kernel.metadata.num_warps} warps")
    return results


if __name__ == "__main__":
    found = main(sys.argv[1].split(","), [int(t) for t in sys.argv[2].split(",")], json.loads(sys.argv[3]))
    out = os.environ.get("OUT", "/tmp")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "wg.json"), "w") as f:
        json.dump(found, f, indent=1)
