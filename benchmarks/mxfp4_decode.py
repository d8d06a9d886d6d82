"""The decode kernels (`moe/experts/_triton/decode.py`) on a CUDA GPU over a sweep of launch configs,
beside the Triton experts' grouped-GEMM path and FlashInfer CUTLASS.

    python benchmarks/mxfp4_decode.py [--out best.json] [--tokens 1,2,4,8,16,32,64] [--budget-s 200]
    python benchmarks/mxfp4_decode.py --preset qwen3-30b-a3b --quant nvfp4 --tokens 1,4,16

A preset's shape (default GPT-OSS-120B: E=128, k=4, H=I=2880, swiglu_oai, biases) and scheme (mxfp4 or
nvfp4 weight-only, or fp8_block W8A8), bf16 activations. Every call is
timed inside a CUDA graph (median of many replays, rotating 4 routings). Per M: each candidate
config's output is checked against the grouped-GEMM path's first (a wrong or failing config is
listed, never picked); the best config is found coordinate-wise (both GEMMs on one tile, then
GEMM2's tile alone). The roofline is the weight bytes of the experts hit (bits per weight: BITS) over
the memory bandwidth (H100 3.0 TB/s, H200 4.2 TB/s). Prints a markdown table; writes the best config per
M (`DecodeConfig` fields) and every timing as JSON to --out or $OUT/mxfp4_decode.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import moe.experts.triton as triton_experts  # noqa: E402
from moe.experts._triton import decode  # noqa: E402
from moe.experts._triton.decode import DecodeConfig, DecodeTile  # noqa: E402
from moe.presets import load_preset  # noqa: E402
from moe.registry import get_experts  # noqa: E402
from moe.tools.bench import backend_calls, build_weights, make_inputs, time_calls  # noqa: E402

BANDWIDTH_TBS = {"H100": 3.0, "H200": 4.2}
# bits per weight: the code and its share of the block scale (8 bits per 32 or 16; fp8: 32 per 128 x 128)
BITS = {"mxfp4": 4.25, "nvfp4": 4.5, "mxfp8": 8.25, "fp8_block": 8 + 32 / 128**2}
# (block_n, block_k, splits, num_warps, num_stages, asm); FMA tiles: the H200 sweeps' best of session 13
# (benchmarks/results/fp4_gemv_decode_nvidia-h200.md) and neighbours, each also with ``finish``; num_stages 1:
# with more, the pipeliner's shared-memory copies made them slower (45.0 -> 47.1-52.3 us at M = 1)
FMA_TILES = [(32, 128, 8, 4, 1, True), (32, 128, 4, 2, 1, True), (32, 64, 8, 2, 1, True), (32, 64, 4, 2, 1, True),
             (64, 64, 4, 2, 1, True), (32, 128, 4, 4, 1, True), (64, 128, 4, 4, 1, True), (32, 128, 4, 4, 1, False)]
DOT_TILES = [(32, 128, 1, 4, 3, True), (32, 128, 2, 4, 3, True), (64, 128, 1, 4, 3, True), (64, 128, 2, 4, 4, True),
             (32, 256, 2, 4, 3, True), (64, 256, 1, 8, 3, True), (16, 128, 2, 4, 4, True), (128, 128, 1, 8, 3, True),
             (64, 64, 4, 4, 4, True), (32, 128, 4, 4, 3, True), (128, 64, 2, 8, 4, True), (32, 128, 2, 4, 3, False),
             (64, 128, 1, 4, 3, False)]


# MMA-fragment tiles (splits, warps, unroll): 16 weight rows per warp, K steps of 64 (unroll of them loaded at a
# time), 8 tokens per pass (fp4 only)
MMA_TILES = [(1, 4, 1), (2, 4, 1), (4, 4, 2), (8, 4, 2), (2, 2, 2), (4, 2, 2), (8, 2, 2), (4, 4, 4), (2, 2, 4),
             (1, 4, 2), (8, 1, 2), (4, 8, 2)]


# MMA tiles that finish their own epilogue run a program per slot (`DecodeConfig.per_slot`): swept up to this M.
# On an H200 they won up to Qwen3's M = 8 and GPT-OSS's 9, and lost from 10 (session 25)
FINISH_TOKENS = 8


def mma_tile(splits: int, warps: int, unroll: int = 1, finish: int = 0) -> DecodeTile:
    """`decode.mma_tile` in the ``--tiles`` order (``mma:splits:warps[:unroll[:finish]]``)."""
    return decode.mma_tile(16 * warps, unroll, splits, finish == 1)


def parse_tiles(text: str) -> list[DecodeTile]:
    """``n:k:splits:block_m:warps:stages[:finish[:tma]]`` tiles, comma-separated (block_m 1..8: float32 FMAs, else
    tensor cores; finish 1: the tile applies the split epilogue itself; tma 1: an fp8 tensor-core tile loads its
    weights by TMA, `DecodeTile.tma`), all with the PTX dequantization;
    or ``mma:splits:warps[:unroll[:finish]]``, an MMA-fragment tile (`DecodeTile.mma`; unroll: K steps of 64 per
    load)."""
    tiles = []
    for item in text.split(","):
        if item.startswith("mma:"):
            tiles.append(mma_tile(*(int(v) for v in item[4:].split(":"))))
            continue
        fields = [int(v) for v in item.split(":")]
        if len(fields) not in (6, 7, 8):
            raise SystemExit(f"--tiles: {item!r} is not n:k:splits:block_m:warps:stages[:finish[:tma]]")
        n, k, splits, block_m, warps, stages = fields[:6]
        finish = len(fields) >= 7 and fields[6] == 1
        tma = len(fields) == 8 and fields[7] == 1
        tiles.append(DecodeTile(n, k, splits, block_m, block_m >= 16, True, warps, stages, finish, tma=tma))
    return tiles


# fp8 weights (n, k, splits, warps, stages): block_k divides 128, the scale group; no PTX dequantization.
# FMA tiles (block_m 1 at M = 1, else 4) only by --fp8-fma: on the H100 the best of 13 was 1.25x (Qwen3-30B-A3B,
# M = 1) to 5.7x (DeepSeek-V3 slice, M = 16) slower than the best tensor-core tile
# (benchmarks/results/fp8_decode_nvidia-h100.md)
FP8_FMA_TILES = [(64, 64, 4, 4, 3), (64, 128, 2, 4, 3), (32, 128, 4, 4, 3), (128, 64, 2, 4, 3), (64, 64, 2, 4, 3),
                 (32, 64, 4, 4, 3), (64, 128, 4, 4, 3), (128, 32, 4, 4, 3), (64, 32, 8, 4, 3), (32, 128, 2, 4, 4),
                 (128, 64, 4, 8, 3), (64, 128, 1, 4, 3), (32, 64, 2, 4, 3)]
# tensor-core tiles; for one token each split one also with ``finish`` (no epilogue launch)
FP8_DOT_TILES = [(64, 128, 1, 4, 3), (64, 128, 2, 4, 3), (128, 128, 1, 8, 3), (32, 128, 2, 4, 3), (64, 128, 4, 4, 3),
                 (128, 128, 2, 8, 3), (64, 64, 2, 4, 3), (128, 128, 4, 8, 3), (32, 128, 4, 4, 3), (64, 128, 8, 4, 3),
                 (32, 128, 8, 4, 3), (128, 128, 2, 4, 3)]


def candidates(tokens: int, only: list[DecodeTile] | None = None, quant: str = "mxfp4",
               fp8_fma: bool = False, tma: bool = False) -> list[DecodeTile]:
    if only:
        return list(only)
    if quant == "fp8_block":
        block_m = 1 if tokens == 1 else 4
        tiles = [DecodeTile(n, k, s, block_m, False, False, w, st) for n, k, s, w, st in FP8_FMA_TILES] \
            if fp8_fma and tokens <= 16 else []
        finishes = (False, True) if tokens == 1 else (False,)
        loads = (False, True) if tma else (False,)  # tensor-core tiles by pointers, and by TMA where asked
        return tiles + [DecodeTile(n, k, s, 16, True, False, w, st, finish, tma=by_tma)
                        for n, k, s, w, st in FP8_DOT_TILES for finish in finishes if s > 1 or not finish
                        for by_tma in loads]
    tiles = []
    if tokens <= 16:  # fp4 / MXFP8 FMA tiles take one row at a time (decode.py checks block_m == 1)
        tiles += [DecodeTile(n, k, s, 1, False, asm, w, st, finish) for n, k, s, w, st, asm in FMA_TILES
                  for finish in (True, False)]
    # tensor-core tiles at every M, one token too: the swapped MMA pads activation rows, not weight rows
    tiles += [DecodeTile(n, k, s, 16, True, asm, w, st) for n, k, s, w, st, asm in DOT_TILES]
    if quant in ("mxfp4", "nvfp4"):  # up to FINISH_TOKENS also finishing (a program per slot, no epilogue launch)
        finishes = (0, 1) if tokens <= FINISH_TOKENS else (0,)
        tiles += [mma_tile(*t, finish) for t in MMA_TILES for finish in finishes]
    return tiles


def bandwidth(device) -> float:
    name = torch.cuda.get_device_name(device)
    return next((tbs for key, tbs in BANDWIDTH_TBS.items() if key in name), 3.0) * 1e12


def roofline_us(problem, inputs, device, bits: float) -> float:
    hits = sum(t.ids.unique().numel() for _, t in inputs) / len(inputs)
    # w13 [w13_rows, H] and w2 [H, I] (session 7 fixed this: it read (w13_rows + H) * I, the same only where H = I)
    per_expert = problem.hidden_size * (problem.w13_rows + problem.intermediate_size) * bits / 8
    return hits * per_expert / bandwidth(device) * 1e6


def close(out: torch.Tensor, want: torch.Tensor) -> bool:
    return bool(torch.isfinite(out).all()) and float((out.float() - want.float()).norm() / want.float().norm()) < 0.02


class Sweep:
    """Times decode configs at one M on fixed inputs (monkeypatching the experts' config lookup)."""

    def __init__(self, problem, weights, inputs, device, want, deadline, fp8_fma=False, tma=False):
        self.fp8_fma, self.tma = fp8_fma, tma
        self.cls = triton_experts.TritonExperts
        self.experts = self.cls(problem)
        self.prepared = self.experts.prepare_weights(weights)
        self.problem, self.inputs, self.device, self.want, self.deadline = problem, inputs, device, want, deadline
        self.results: dict[str, float | str] = {}

    def time(self, config: DecodeConfig) -> float | None:
        key = json.dumps(dataclasses.asdict(config))
        if key in self.results:
            value = self.results[key]
            return value if isinstance(value, float) else None
        if time.monotonic() > self.deadline:
            return None
        triton_experts.decode_config = triton_experts.fp8_decode_config = lambda m, *table: config
        try:
            calls = backend_calls(self.cls, self.problem, None, self.inputs, self.device, experts=self.experts,
                                  prepared=self.prepared)
            out = calls[0]().out.clone()
            if not close(out, self.want):
                self.results[key] = "wrong result"
                return None
            us = time_calls(calls, True, budget_ms=60.0)
        except Exception as error:  # noqa: BLE001 -- e.g. out of shared memory or registers: listed, skipped
            self.results[key] = f"{type(error).__name__}: {str(error)[:200]}"
            return None
        self.results[key] = round(us, 2)
        return us

    def best(self, tokens: int, only: list[DecodeTile] | None = None) -> tuple[DecodeConfig | None, float]:
        tiles = candidates(tokens, only, self.problem.quant_name, self.fp8_fma, self.tma)
        timed = [(self.time(DecodeConfig(t, t)), t) for t in tiles]
        timed = [(us, t) for us, t in timed if us is not None]
        if not timed:
            return None, float("inf")
        us, first = min(timed, key=lambda x: x[0])
        best = (us, DecodeConfig(first, first))
        for t in tiles:
            us = self.time(DecodeConfig(first, t))
            if us is not None and us < best[0]:
                best = (us, DecodeConfig(first, t))
        return best[1], best[0]


def peer_us(name: str, problem, weights, inputs, device, platform) -> float | None:
    try:
        cls = get_experts(name)
        if cls.check(problem, platform):
            return None
        return time_calls(backend_calls(cls, problem, weights, inputs, device), cls.capabilities.cuda_graph_safe)
    except Exception as error:  # noqa: BLE001 -- a peer that cannot run here is reported as absent
        print(f"  {name}: {type(error).__name__}: {str(error)[:200]}", file=sys.stderr)
        return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="1,2,4,8,16,32,64")
    parser.add_argument("--out", default=None)
    parser.add_argument("--budget-s", type=float, default=200.0, help="stop sweeping configs after this")
    parser.add_argument("--preset", default="gpt-oss-120b")
    parser.add_argument("--quant", default="mxfp4", choices=sorted(BITS))
    parser.add_argument("--fp8-fma", action="store_true", help="fp8_block: sweep the FMA tiles too")
    parser.add_argument("--tma", action="store_true",
                        help="fp8_block: every tensor-core tile also loading its weights by TMA (SM90+)")
    parser.add_argument("--tiles", default=None,
                        help="sweep only these tiles: n:k:splits:block_m:warps:stages[:finish[:tma]],...")
    args = parser.parse_args(argv)
    import moe.experts.flashinfer_cutlass  # noqa: F401 -- registers the peer
    from moe.platform import Platform

    device = torch.device("cuda")
    platform = Platform.detect()
    preset = load_preset(args.preset)
    tokens = [int(t) for t in args.tokens.split(",")]
    problem = preset.problem(quant=args.quant, max_tokens=max(tokens))
    weights = build_weights(problem, device)
    deadline = time.monotonic() + args.budget_s
    rows, report = [], {"device": torch.cuda.get_device_name(device), "preset": args.preset, "quant": args.quant,
                        "configs": {}, "timings": {}}
    decode_config, uses_decode = triton_experts.decode_config, triton_experts.uses_decode
    fp8_decode_config = triton_experts.fp8_decode_config
    for m in tokens:
        torch.manual_seed(m)
        inputs = make_inputs(preset, problem, m, 4, device)
        roof = roofline_us(problem, inputs, device, BITS[args.quant])
        triton_experts.uses_decode = lambda *a: False  # the grouped-GEMM path, as before this kernel
        grouped_calls = backend_calls(triton_experts.TritonExperts, problem, weights, inputs, device)
        want = grouped_calls[0]().out.clone()
        grouped = time_calls(grouped_calls, True)
        triton_experts.uses_decode = uses_decode
        sweep = Sweep(problem, weights, inputs, device, want, deadline, args.fp8_fma, args.tma)
        config, best = sweep.best(m, parse_tiles(args.tiles) if args.tiles else None)
        triton_experts.decode_config, triton_experts.fp8_decode_config = decode_config, fp8_decode_config
        fi = peer_us("flashinfer_cutlass", problem, weights, inputs, device, platform)
        report["timings"][m] = sweep.results
        report["configs"][m] = None if config is None else dataclasses.asdict(config)
        rows.append((m, roof, best, config, grouped, fi))
        print(f"M={m}: decode {best:.1f} us, grouped {grouped:.1f} us, flashinfer {fi}", file=sys.stderr, flush=True)
    print(table(rows))
    out = Path(args.out) if args.out else Path(os.environ.get("OUT", ".")) / "mxfp4_decode.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nbest configs and all timings: {out}")
    return 0


def table(rows) -> str:
    lines = ["| M | roofline us | decode us | % roofline | triton grouped us | flashinfer us | vs flashinfer | best config |",
             "|---|---|---|---|---|---|---|---|"]
    for m, roof, best, config, grouped, fi in rows:
        cfg = "-" if config is None else f"g1 {_short(config.gemm1)}; g2 {_short(config.gemm2)}"
        vs = f"{fi / best:.2f}x" if fi else "-"
        lines.append(f"| {m} | {roof:.1f} | {best:.1f} | {roof / best:.0%} | {grouped:.1f} | "
                     f"{'-' if fi is None else f'{fi:.1f}'} | {vs} | {cfg} |")
    return "\n".join(lines)


def _short(t: DecodeTile) -> str:
    kind = f"mma m8 u{t.block_k // 64}" if t.mma else f"dot m{t.block_m}" if t.dot else f"fma m{t.block_m}"
    return (f"{kind} n{t.block_n} k{t.block_k} s{t.splits} w{t.num_warps} st{t.num_stages}{' asm' if t.asm else ''}"
            f"{' finish' if t.finish else ''}{' tma' if t.tma else ''}")


if __name__ == "__main__":
    raise SystemExit(main())
