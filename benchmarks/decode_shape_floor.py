"""The floor under one token's fp8 decode GEMMs at their program shape: their TMA loads and wgmmas, nothing else.

At one token the fp8 decode tiles (`moe/experts/_triton/_decode.py`, ``tma=True``) give each program an (item, K
split), item = (expert, tile of ``block_n`` gate rows); the program loops over its split's K steps of 128 columns
(``per = cdiv(steps, splits)`` each), loads each ``[block_n, 128]`` e4m3 weight box by TMA descriptor (gated: the
gate box and the up box N rows further) and runs a wgmma of it against the token's activations. The kernel here does
that and no more -- no activation quantization, scales, partial sums or epilogue: it multiplies each box by a
constant e4m3 activation tile of 16 rows (the token, padded as the tiles pad it) and stores the sum of the program's
products (one float, so no load is dropped). The weights come in two layouts of the same bytes:

- ``rows``: ``[E * R, K]`` (R = 2N gated, else N), as the decode tiles read them, a box's 128-byte rows K bytes
  apart;
- ``blocked``: each (expert, tile, K step, gate / up) box's ``block_n * 128`` bytes contiguous, in that order, the
  buffer read as ``[bytes / 128, 128]`` (`weight_boxes`: the boxes the rows layout loads, TMA's zero fill included).

Shapes: the preset's one-token fp8_block problem over the experts `moe bench`'s routing hits; GEMM1 gated with
N = I, K = H; GEMM2 N = H, K = I. K steps and N tiles round up (GPT-OSS-120B's 2880): TMA zero-fills the boxes'
columns past K and rows past the weights, as for the real tiles. Timed as `moe bench` times the experts: a CUDA graph
rotating through buffers that together exceed `stream_floor.MIN_ROTATED_BYTES`, the median replay's time per launch;
the two layouts alternate twice and each keeps its faster time. TB/s is the weights' bytes (E * R * K) over that
time.

Measured (nvidia-h200, 1980 MHz, Triton 3.6, session 29; `results/fp8_decode_s29_shape_floor_nvidia-h200.json`),
rows / blocked, µs per launch:

    preset          GEMM  tile        rows   blocked
    qwen3-30b-a3b   1     128:4:2:4   9.68   9.56
    qwen3-30b-a3b   2     128:4:2:4   5.79   5.71
    gpt-oss-120b    1     128:4:2:4   21.15  20.04
    gpt-oss-120b    2     128:4:3:8   11.33  11.31

So contiguous boxes save 0-5%, and at the tables' M = 1 tiles a stream with the decode tiles' shape and wgmmas but
nothing else takes 15.5 µs (Qwen3-30B-A3B, 58% of the memory roofline) and 32.5 µs (GPT-OSS-120B, 73%) for both
GEMMs. `decode_ablation.py`'s ``fp8_loop_only`` (the real kernels with everything but those loads and wgmmas taken
out) took 15.6 and 32.5 µs on the same machine; the real kernels 18.9 and 37.1.

    python benchmarks/decode_shape_floor.py [--preset qwen3-30b-a3b,gpt-oss-120b,deepseek-v3-ep8-slice]
        [--tiles 128:4:2:4,128:4:3:8,128:4:3:4] [--json out.json]

Each ``--tiles`` item (block_n:splits:stages:warps) runs on both GEMMs; the default is the tables' M = 1 tile of
Qwen3's GEMMs and GPT-OSS's GEMM1 (GPT-OSS's GEMM2 has 128:4:3:8; DeepSeek's table starts at M = 3).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from stream_floor import MIN_ROTATED_BYTES  # noqa: E402

BLOCK_K = 128  # a K step: one fp8_block group, the box's 128 bytes of a row
BLOCK_M = 16  # the activation tile's rows: the wgmma's narrow side, as the decode tiles pad one token
LAYOUTS = ("rows", "blocked")
DEFAULT_TILE = "128:4:2:4"  # the H200 tables' M = 1 tile of Qwen3-30B-A3B's GEMMs and GPT-OSS-120B's GEMM1


@dataclass(frozen=True)
class Gemm:
    """One decode GEMM's weights as the stream reads them: ``experts`` e4m3 matrices ``[rows, k]``, a gated one's
    gate rows then its up rows."""

    name: str  # "gemm1" or "gemm2"
    experts: int  # the experts one token hits: the matrices streamed
    n: int  # output columns of one half: I for GEMM1, H for GEMM2
    k: int  # the reduction: H for GEMM1, I for GEMM2
    gated: bool  # GEMM1: a gate and an up box per K step

    @property
    def rows(self) -> int:
        return 2 * self.n if self.gated else self.n

    @property
    def halves(self) -> int:
        return 2 if self.gated else 1

    @property
    def steps(self) -> int:
        return triton.cdiv(self.k, BLOCK_K)

    @property
    def nbytes(self) -> int:
        """The weights' bytes, E * R * K (the rows layout's buffer)."""
        return self.experts * self.rows * self.k

    def tiles(self, block_n: int) -> int:
        return triton.cdiv(self.n, block_n)

    def blocked_bytes(self, block_n: int) -> int:
        """The blocked layout's bytes: every box whole."""
        return self.experts * self.tiles(block_n) * self.steps * self.halves * block_n * BLOCK_K


@dataclass(frozen=True)
class Tile:
    """The fields of a `moe.experts._triton.decode.DecodeTile` that shape the stream."""

    block_n: int  # gate rows per item
    splits: int  # K splits: programs per item
    stages: int  # the K loop's pipeline depth (num_stages)
    warps: int

    @classmethod
    def parse(cls, text: str) -> Tile:
        """``"128:4:2:4"`` -> Tile(128, 4, 2, 4)."""
        try:
            tile = cls(*(int(part) for part in text.split(":")))
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(
                f"a tile is block_n:splits:stages:warps, e.g. 128:4:2:4 (got {text!r})") from None
        if tile.block_n not in (64, 128, 256) or min(tile.splits, tile.stages, tile.warps) < 1:
            raise argparse.ArgumentTypeError(f"block_n must be 64, 128 or 256 and the rest positive (got {text!r})")
        return tile

    def __str__(self) -> str:
        return f"{self.block_n}:{self.splits}:{self.stages}:{self.warps}"


@triton.jit
def decode_shape_kernel(desc, act_ptr, out_ptr, N, R, steps, splits, tiles,
                        GATED: tl.constexpr, BLOCKED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        BLOCK_M: tl.constexpr):
    """Program ``item * splits + split`` (item = expert * tiles + tile) loads its K steps' ``[BLOCK_N, BLOCK_K]``
    boxes from ``desc`` -- ``BLOCKED``: box ``(item * steps + step) * halves + half`` of the contiguous boxes; else
    rows ``expert * R + tile * BLOCK_N`` (and ``N`` further, the up box) at column ``step * BLOCK_K`` -- multiplies
    each by ``act [BLOCK_M, BLOCK_K]`` transposed and stores the sum of all products at ``out[program]``."""
    pid = tl.program_id(0)
    split = pid % splits
    item = pid // splits
    expert = item // tiles
    tile = item % tiles
    per = tl.cdiv(steps, splits)
    first = tl.minimum(split * per, steps)
    last = tl.minimum(first + per, steps)
    # K-major, as the decode tiles' transposed activations: fp8 wgmma reads both operands so
    act = tl.load(act_ptr + tl.arange(0, BLOCK_M)[None, :] * BLOCK_K + tl.arange(0, BLOCK_K)[:, None])
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for step in range(first, last):
        if BLOCKED:
            box = item * steps + step
            if GATED:  # the step's gate box, then its up box
                box = 2 * box
            gate = desc.load([box * BLOCK_N, 0])
            if GATED:
                up = desc.load([(box + 1) * BLOCK_N, 0])
        else:
            row = expert * R + tile * BLOCK_N
            gate = desc.load([row, step * BLOCK_K])
            if GATED:
                up = desc.load([row + N, step * BLOCK_K])
        acc = tl.dot(gate, act, acc)
        if GATED:
            acc_up = tl.dot(up, act, acc_up)
    tl.store(out_ptr + pid, tl.sum(tl.sum(acc + acc_up, 1), 0))


def descriptor(buffer: torch.Tensor, gemm: Gemm, block_n: int, blocked: bool):
    """A TMA descriptor of ``gemm``'s weights at the start of ``buffer`` (e4m3, one dimension) in a layout."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if blocked:
        boxes = buffer[: gemm.blocked_bytes(block_n)].view(-1, BLOCK_K)
    else:
        boxes = buffer[: gemm.nbytes].view(gemm.experts * gemm.rows, gemm.k)
    return TensorDescriptor(boxes, list(boxes.shape), [boxes.shape[1], 1], [block_n, BLOCK_K])


def launch(desc, act: torch.Tensor, out: torch.Tensor, gemm: Gemm, tile: Tile, blocked: bool) -> None:
    """`decode_shape_kernel` over all of ``gemm``'s programs (``out``: a float32 per program)."""
    tiles = gemm.tiles(tile.block_n)
    grid = (gemm.experts * tiles * tile.splits,)
    decode_shape_kernel[grid](desc, act, out, gemm.n, gemm.rows, gemm.steps, tile.splits, tiles, GATED=gemm.gated,
                              BLOCKED=blocked, BLOCK_N=tile.block_n, BLOCK_K=BLOCK_K, BLOCK_M=BLOCK_M,
                              num_warps=tile.warps, num_stages=tile.stages)


def weight_boxes(weights: torch.Tensor, gemm: Gemm, block_n: int) -> torch.Tensor:
    """``[E, tiles, steps, halves, block_n, 128]``: the boxes the rows layout's descriptor loads from ``weights``
    (``[E * R, K]``), zero where they reach past its last row or past K. Contiguous, it is the blocked layout."""
    top = gemm.experts * gemm.rows
    boxes = torch.zeros(gemm.experts, gemm.tiles(block_n), gemm.steps, gemm.halves, block_n, BLOCK_K,
                        dtype=weights.dtype)
    for expert in range(gemm.experts):
        for tile in range(gemm.tiles(block_n)):
            for half in range(gemm.halves):
                row = expert * gemm.rows + half * gemm.n + tile * block_n
                for step in range(gemm.steps):
                    box = weights[row: min(row + block_n, top), step * BLOCK_K: (step + 1) * BLOCK_K]
                    boxes[expert, tile, step, half, : box.shape[0], : box.shape[1]] = box
    return boxes


def program_sums(weights: torch.Tensor, act: torch.Tensor, gemm: Gemm, tile: Tile) -> torch.Tensor:
    """`decode_shape_kernel`'s twin: each program's stored value, the sum of its boxes' products with ``act``."""
    boxes = weight_boxes(weights, gemm, tile.block_n).float()
    products = (boxes @ act.float().T).sum((-1, -2, -3))  # [E, tiles, steps]
    per = triton.cdiv(gemm.steps, tile.splits)
    sums = []
    for item in products.flatten(0, 1):
        for split in range(tile.splits):
            first = min(split * per, gemm.steps)
            sums.append(item[first: first + per].sum())
    return torch.stack(sums)


def ptx(gated: bool, blocked: bool, tile: str = DEFAULT_TILE, arch: int = 90) -> str:
    """`decode_shape_kernel`'s PTX for ``arch``, compiled by the installed Triton without a GPU (the CPU's check of
    its TMA loads and wgmmas; run where ``TRITON_INTERPRET`` is off)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, tile = decode_shape_kernel, Tile.parse(tile)
    consts = dict(GATED=gated, BLOCKED=blocked, BLOCK_N=tile.block_n, BLOCK_K=BLOCK_K, BLOCK_M=BLOCK_M)
    types = {"desc": f"tensordesc<fp8e4nv[{tile.block_n}, {BLOCK_K}]>", "act_ptr": "*fp8e4nv", "out_ptr": "*fp32"}
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    aligned = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ("act_ptr", "out_ptr")}  # GPU allocations
    source = ASTSource(fn=fn, signature=signature, attrs=aligned,
                       constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    options = dict(num_warps=tile.warps, num_stages=tile.stages)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options).asm["ptx"]


def gemms(preset_name: str, device) -> tuple[Gemm, Gemm]:
    """GEMM1 and GEMM2 of one token of ``preset_name`` (fp8_block) over the experts `moe bench`'s routing hits (as
    `stream_floor.byte_counts` counts them: `moe.tools.bench.experts_hit`, rounded, where an expert map makes the
    average fractional)."""
    from moe.presets import load_preset
    from moe.tools.bench import experts_hit, make_inputs

    preset = load_preset(preset_name)
    problem = preset.problem(quant="fp8_block", max_tokens=1)
    hits = max(1, round(experts_hit(problem, [topk for _, topk in make_inputs(preset, problem, 1, 4, device)])))
    hidden, intermediate = problem.hidden_size, problem.intermediate_size
    return Gemm("gemm1", hits, intermediate, hidden, True), Gemm("gemm2", hits, hidden, intermediate, False)


def rotations(nbytes: int) -> int:
    """Buffers of ``nbytes`` to rotate through so that together they exceed `MIN_ROTATED_BYTES` (two at least)."""
    return max(2, triton.cdiv(MIN_ROTATED_BYTES, nbytes))


def time_layouts(gemm: Gemm, tile: Tile, device) -> dict[str, float]:
    """{layout: median us of one launch} over the same buffers read in each layout; the layouts alternate twice and
    each keeps its faster time, so neither gains from its place in the order."""
    from moe.tools.bench import time_calls

    size = max(gemm.nbytes, gemm.blocked_bytes(tile.block_n))
    count = rotations(gemm.nbytes)
    # small e4m3 values (no NaN); the timing does not depend on them
    pool = torch.randint(-8, 8, (count, size), device=device, dtype=torch.int8).view(torch.float8_e4m3fn)
    act = torch.ones(BLOCK_M, BLOCK_K, device=device).to(torch.float8_e4m3fn)
    out = torch.empty(gemm.experts * gemm.tiles(tile.block_n) * tile.splits, device=device)
    calls = {}
    for layout in LAYOUTS:
        blocked = layout == "blocked"
        descs = [descriptor(pool[r], gemm, tile.block_n, blocked) for r in range(count)]
        calls[layout] = [functools.partial(launch, d, act, out, gemm, tile, blocked) for d in descs]
    best = {}
    for layout in LAYOUTS * 2:
        us = time_calls(calls[layout], graphs=True)
        best[layout] = min(us, best.get(layout, us))
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b,gpt-oss-120b,deepseek-v3-ep8-slice")
    parser.add_argument("--tiles", default=DEFAULT_TILE, type=lambda text: [Tile.parse(t) for t in text.split(",")],
                        help="block_n:splits:stages:warps items, each run on both GEMMs")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_shape_floor.py needs a CUDA GPU (it times TMA loads and wgmmas)", file=sys.stderr)
        return 1
    from moe.platform import Platform

    device = torch.device("cuda")
    if not Platform.detect(device).capability_at_least(9, 0):
        print(f"decode_shape_floor.py needs SM90+ for TMA and wgmma (got {torch.cuda.get_device_name(device)})",
              file=sys.stderr)
        return 1
    print(f"{torch.cuda.get_device_name(device)}, Triton {triton.__version__}")
    print("| preset | GEMM | tile | MB | rows us | rows TB/s | blocked us | blocked TB/s | blocked / rows |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for preset in args.preset.split(","):
        for gemm in gemms(preset, device):
            for tile in args.tiles:
                us = time_layouts(gemm, tile, device)
                megabytes = gemm.nbytes / 1e6  # MB / us = TB/s
                rows.append(dict(preset=preset, gemm=gemm.name, experts=gemm.experts, n=gemm.n, k=gemm.k,
                                 tile=str(tile), bytes=gemm.nbytes, rows_us=us["rows"], blocked_us=us["blocked"]))
                print(f"| {preset} | {gemm.name} | {tile} | {megabytes:.1f} | {us['rows']:.2f} | "
                      f"{megabytes / us['rows']:.2f} | {us['blocked']:.2f} | {megabytes / us['blocked']:.2f} | "
                      f"{us['blocked'] / us['rows']:.3f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(device),
                                                   triton=triton.__version__, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
