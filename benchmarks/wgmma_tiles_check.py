"""GPU (SM90): fp8_block wgmma tiles against the pointer path of the shipped table, in one process: each tile's
first and second call against the pointer path and (M <= 4096) the float32 reference, and its time (CUDA graphs).

    python benchmarks/wgmma_tiles_check.py qwen3-30b-a3b,deepseek-v3-ep8-slice 1024,4096,16384 \
        '[[64, 64, 128, 4, 4, 8], [128, 64, 128, 8, 4, 8]]'     # [block_m, gemm1 n, gemm2 n, warps, stages, group_m]

Writes $OUT/wg.json (µs per tile and M). Session 9's runs: benchmarks/results/fp8_block_wgmma_nvidia-h100.md.
"""
import dataclasses, sys, json, os
import torch, triton
from moe.experts._triton.config import ConfigTable, LaunchConfig, TileConfig
from moe.experts.triton import TritonExperts
from moe.formats import ActivationFormat, Dispatched, DispatchShape
from moe.presets import load_preset
from moe.quant import QuantizedTensor
from moe.tools.bench import build_weights
from moe.workspace import WorkspaceManager
from tests.gpu.test_triton_gpu import reference, topk_for
from moe.testing.tolerance import assert_close_moe, regime_for

presets = sys.argv[1].split(",")
tokens_list = [int(t) for t in sys.argv[2].split(",")]
variants = json.loads(sys.argv[3])  # list of [block_m, bn1, bn2, warps, stages, group_m]
out = {}
for preset in presets:
    p = load_preset(preset).problem(quant="fp8_block", max_tokens=max(tokens_list))
    weights = build_weights(p, torch.device("cuda"))
    experts = TritonExperts(p)
    prepared = experts.prepare_weights(weights)
    checksum = (prepared.w13.data.view(torch.uint8).sum().item(), prepared.w2.data.view(torch.uint8).sum().item())
    ws = WorkspaceManager("cuda").take(experts.workspace_shapes(DispatchShape(ActivationFormat.STANDARD, max(tokens_list))))
    for tokens in tokens_list:
        torch.manual_seed(tokens)
        x = torch.randn(tokens, p.hidden_size, device="cuda", dtype=p.dtype)
        topk = topk_for(p, tokens)
        d = Dispatched(ActivationFormat.STANDARD, QuantizedTensor(data=x, scale=None, fmt="none"), topk)
        def timed(prep):
            fn = lambda: experts.apply(d, prep, ws)
            res = fn().out.float().clone()
            # do_bench_cudagraph's warm-up runs on a side stream that does not wait for this one: without the
            # sync it overwrites the workspace while this call still runs (what session 9 first took for a bug)
            torch.cuda.synchronize()
            return res, triton.testing.do_bench_cudagraph(fn, rep=int(os.environ.get('REP', '200'))) * 1000
        base, t_base = timed(prepared)
        row = {"pointer": round(t_base, 1)}
        print(f"{preset} M={tokens} pointer {t_base:.1f} us  cfg={prepared.configs.lookup(tokens)}", flush=True)
        if tokens <= 4096:
            ref = reference(p, x, topk, weights)
        for bm, bn1, bn2, w, st, gm in variants:
            cfg = LaunchConfig(bm, TileConfig(bn1, 128, gm, w, st, tma=True, wgmma=True), TileConfig(bn2, 128, gm, w, st, tma=True, wgmma=True))
            prep = dataclasses.replace(prepared, configs=ConfigTable(prepared.configs.key, ((tokens, cfg),)))
            try:
                got, t = timed(prep)
            except Exception as e:
                print("  ", (bm, bn1, bn2, w, st, gm), "FAILED", type(e).__name__, str(e)[:300], flush=True)
                continue
            again = experts.apply(d, prep, ws).out.float().clone()
            base2 = experts.apply(d, prepared, ws).out.float().clone()
            cs = (prepared.w13.data.view(torch.uint8).sum().item(), prepared.w2.data.view(torch.uint8).sum().item())
            print(f"      again==got {torch.equal(again, got)} again-vs-base {((again - base).abs().max() / base.abs().max()).item():.2e} base2==base {torch.equal(base2, base)} weights {cs == checksum}", flush=True)
            err = ((got - base).abs().max() / base.abs().max()).item()
            ok = torch.isfinite(got).all().item()
            msg = ""
            if tokens <= 4096:
                try:
                    assert_close_moe(got, ref, regime_for(p), context="wgmma"); msg = "ref ok"
                except AssertionError as e:
                    msg = "REF FAIL " + str(e)[:200]
            print(f"   {(bm, bn1, bn2, w, st, gm)} {t:.1f} us ({t_base / t:.2f}x) rel err vs pointer {err:.2e} finite {ok} {msg}", flush=True)
            row[str((bm, bn1, bn2, w, st, gm))] = round(t, 1)
        out[f"{preset} {tokens}"] = row
from moe.experts._triton import kernels
k = kernels("gemm_wgmma").moe_gemm_fp8_wgmma_kernel
for dev, caches in k.device_caches.items():
    for key, kern in caches[0].items():
        print("compiled:", kern.n_regs, "regs", kern.n_spills, "spills", kern.metadata.num_warps, "warps", str(key)[:0])
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "wg.json"), "w"), indent=1)
