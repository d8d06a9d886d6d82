"""Decode GEMMs built for the weight stream: MXFP4 / NVFP4 W4A16, MXFP8 weight-only and fp8 W8A8, 128-block and
per-token (the kernels are in _decode.py; the fp8 K loop in _decode_fp8.py).

At decode every expert's weights are read once per forward and the activations are a few rows, so
the time is the bytes of the experts hit over the memory bandwidth. `decode_experts` keeps all SMs
streaming and reads each weight byte once per expert hit::

    align     slots listed by expert, unpadded (BLOCK_M = 1; skipped for one token, whose k
              experts are distinct, and where a finishing tile asks for it: one program group per slot)
    gemm1     grid (N tiles x K splits, expert groups): fp32 partials [splits, slots, 2I]
              (one split: bias + activation fused, the intermediate written directly)
              fp8: x quantized per (row, 128-group) or per row inside the GEMM, no quantize launch
    act       intermediate[slot] = act(sum over splits + bias)         (only with > 1 split)
    gemm2     the same over w2: fp32 partials [splits, slots, H]
              (fp8: the 16-bit intermediate quantized inside the GEMM likewise)
    combine   out[t] = sum_j weight[t, j] * (sum over splits of slot t*k+j + b2)

Split-K partials are summed in split order rather than by float atomics: the result is bit-for-bit
reproducible (the experts declare ``deterministic``), and the partials are tiny next to the weights
(slots x N x splits fp32, mostly in L2). By a second launch (act, combine), or, for ``finish`` tiles,
by the GEMM's own last program per output row and N tile: a ticket (an int32 counter per row and tile,
`TritonWeights.decode_tickets`) counts the programs that stored their partials, and the one that takes
the last ticket sums them in the same order and resets it. That saves both epilogue launches where they
weigh (a few tokens); the fence each ticket costs outweighs them where many programs run. Where the
programs take a slot each, on SM90+ gemm2 is also a programmatic dependent launch after gemm1 (`pdl_roles`).
Everything stays on the GPU, shapes depend on M only: CUDA-graph capturable.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from moe.activation import Activation
from moe.experts._triton import cdiv, kernels
from moe.experts._triton.align import align_block_size, experts_pad
from moe.experts._triton.config import ConfigTable, decode_tiles
from moe.experts._triton.gemm import QUANT_CODES, activation_args, activation_code
from moe.experts._triton.weights import MMA_ROWS, TritonWeights, WeightOperand
from moe.errors import MoEConfigError
from moe.quant import QuantFormat
from moe.quant.fp8 import FP8_GROUP_SIZE  # one K step of the fp8 decode loop

# M * k up to this takes the decode path (`uses_decode`): fp8 W8A8 256 (its sweeps); the weight-only formats 512,
# where the tensor-core tile at 4 rows per expert still beat the grouped GEMM on an H200 (Qwen3-30B-A3B nvfp4 at
# M = 64: 281.5 against 669.1 us; GPT-OSS-120B nvfp4 / mxfp4 at M = 128: 1263 / 1257 against 2458 / 1482; MXFP8
# Qwen3 M = 64 a tie, 428 / 425; benchmarks/results/fp4_gemv_decode_nvidia-h200.md)
DECODE_MAX_SLOTS = 256
WEIGHT_ONLY_DECODE_MAX_SLOTS = 512
DECODE_FORMATS = (QuantFormat.MXFP4, QuantFormat.NVFP4, QuantFormat.MXFP8)  # weight-only: 16-bit activations
FP8_DECODE_FORMATS = (QuantFormat.FP8_BLOCK, QuantFormat.FP8_ROW)  # W8A8 (fp8_block, fp8_token)
MAX_SPLITS = 8  # the partial-sum workspace holds this many K splits
_EPILOGUE_BLOCK = 1024


@dataclass(frozen=True)
class DecodeTile:
    """One decode GEMM's program: ``block_m`` slots of one expert x ``block_n`` output columns x
    ``K / splits``. ``dot``: tensor cores (block_m >= 16) or float32 FMAs (few rows). ``asm`` (fp4 on a
    GPU): PTX dequantization -- with ``dot`` the packed bf16x2 one where `packed_dequantization` holds
    (bfloat16 activations; NVFP4 with any e4m3 scale, MXFP4 with scales <= 2), without it the exact
    unscaled float16 one (`_decode._E2M1_F16X2`, any activation dtype, SM89+); else exact integer and float32
    math. fp8 weights: ``block_k`` divides 128, the pieces a 128-column K step is consumed in (``asm``
    unused). ``finish``: the last program to store a row's partial sums applies the split epilogue
    (`_decode._finish_if_last`) instead of an epilogue launch -- worth it where the launches dominate
    (GPT-OSS-120B MXFP4 at M = 1 on an H200: 43.0 against 45.3 us, one FMA tile), not where many programs
    each pay the ticket's fence (M = 16: 464 against 414). FMA tiles (one row) finish at any M. MMA and
    tensor-core tiles, whose programs otherwise take all of an expert's slots, run a program per slot where either
    GEMM's tile finishes (`DecodeConfig.per_slot`): no alignment launch, and an expert that several slots share is
    read once per slot -- a choice for a few tokens (one token's k experts are distinct: always a program per slot).
    ``mma`` (MXFP4 / NVFP4 x bfloat16 where `mma_ready` holds): the MMA-fragment program (`_decode_mma`), 16 weight
    rows per warp (``block_n = 16 * num_warps``), 8 tokens per pass (``block_m = 8``), K steps of 64 loaded
    ``block_k / 64`` at a time; ``dot`` off, ``asm`` implied (`mma_tile` builds one). ``unpredicated`` (MMA tiles):
    the weight loads take no predicate, so they need not wait for one (`_decode_mma._loads`); an unrolled step past
    the split re-reads its last step's weights against zero activations. On an H200 that took GPT-OSS-120B at one
    token 4.5-5.6% less time (MXFP4, NVFP4) but Qwen3-30B-A3B NVFP4 3.2% more, and GPT-OSS at M = 4 3.6-4.3% more
    (benchmarks/results/fp4_gemv_decode_nvidia-h200.md, session 40): a choice per tile, on where it was timed faster
    (the H200 tables' GPT-OSS one-token entries, `DECODE_CONFIGS`' bucket 0.0).
    ``tma`` (fp8 tensor-core tiles, SM90): the weight tiles by TMA descriptor (`WeightOperand.descriptor`) instead
    of pointer loads."""

    block_n: int = 32
    block_k: int = 128
    splits: int = 1
    block_m: int = 16
    dot: bool = True
    asm: bool = True
    num_warps: int = 4
    num_stages: int = 3
    finish: bool = False
    mma: bool = False
    tma: bool = False
    unpredicated: bool = False

    def __post_init__(self):
        if not 1 <= self.splits <= MAX_SPLITS:
            raise MoEConfigError(f"splits must be in 1..{MAX_SPLITS} (got {self.splits})")
        if self.unpredicated and not self.mma:
            raise MoEConfigError("unpredicated=True is a choice of MMA-fragment tiles' weight loads: it needs "
                                 f"mma=True (got mma={self.mma})")
        if self.tma and (not self.dot or self.mma):
            raise MoEConfigError(f"tma=True decode tiles are tensor-core tiles: dot=True, mma=False "
                                 f"(got dot={self.dot}, mma={self.mma})")
        if self.mma:  # one fragment block per warp and K step; 8 tokens, the MMA's N (`_decode_mma`)
            if self.dot or self.block_m != 8 or self.block_k not in (64, 128, 256) or \
                    self.block_n != 16 * self.num_warps:
                raise MoEConfigError(
                    "mma=True tiles take block_m=8, block_k=64, 128 or 256 (K steps of 64 loaded 1, 2 or 4 at a "
                    "time), block_n=16 * num_warps and dot=False "
                    f"(got block_m={self.block_m}, block_k={self.block_k}, block_n={self.block_n}, "
                    f"num_warps={self.num_warps}, dot={self.dot})")
            return
        if self.block_k % 32 or self.block_k < 32:
            raise MoEConfigError(f"block_k must be a multiple of 32, the MXFP4 group (got {self.block_k})")
        if self.dot and self.block_m < 16:
            raise MoEConfigError(f"dot=True needs block_m >= 16 (got {self.block_m}); use dot=False for fewer rows")
        if self.finish and not self.dot and self.block_m != 1:
            raise MoEConfigError(f"finish=True FMA tiles take one row at a time: block_m=1 (got {self.block_m}); "
                                 "use dot=True for a 16-row tile that finishes with a program per slot")

    @property
    def takes_expert_slots(self) -> bool:
        """Whether a program of this tile takes all of an expert's slots where the routing groups them (MMA and
        tensor-core tiles), rather than one row at a time (FMA tiles)."""
        return self.mma or self.dot


@dataclass(frozen=True)
class DecodeConfig:
    gemm1: DecodeTile
    gemm2: DecodeTile
    # what runs instead where a tile is an MMA one and `mma_ready` fails (no fragments: MXFP8, or a CPU; MXFP4 with
    # scales > 2; float16 / float32 activations); None: such a config raises there
    fallback: DecodeConfig | None = None

    @property
    def uses_mma(self) -> bool:
        return self.gemm1.mma or self.gemm2.mma

    @property
    def per_slot(self) -> bool:
        """Whether the GEMMs run a program group per slot at any M rather than one per expert hit (`_routing`): where
        an MMA or tensor-core tile finishes its own split epilogue, which needs one slot per program."""
        return any(t.finish and t.takes_expert_slots for t in (self.gemm1, self.gemm2))


# MXFP4 / NVFP4 / MXFP8 weight-only where the MMA tiles cannot run (`DecodeConfig.fallback`), by the slots per
# local expert (M * k / E: how many rows each expert hit multiplies), the nearest bucket at or below: session 13's
# fastest FMA and tensor-core tiles of benchmarks/mxfp4_decode.py's sweeps on an H200
# (benchmarks/results/fp4_gemv_decode_nvidia-h200.md: GPT-OSS-120B MXFP4 at M = 1, 2, 4, 16, 64 and Qwen3-30B-A3B
# NVFP4 at M = 1, 4, 16). Below one row per expert the FMA tiles, one row at a time: with the split epilogue in the
# GEMMs (``finish``) where the launches weigh most (GPT-OSS up to M = 3, Qwen3's GEMM1 at M = 4), GEMM2's tiles
# two 16-byte groups per thread (32 x 128 on 2 warps); from one row per expert the tensor-core tile.
_FMA = dict(block_m=1, dot=False, asm=True, num_stages=1)
FALLBACK_DECODE_CONFIGS = {
    0.0: DecodeConfig(DecodeTile(32, 128, 8, num_warps=4, finish=True, **_FMA),
                      DecodeTile(32, 128, 4, num_warps=2, finish=True, **_FMA)),
    0.05: DecodeConfig(DecodeTile(32, 64, 8, num_warps=2, finish=True, **_FMA),
                       DecodeTile(32, 128, 4, num_warps=2, finish=True, **_FMA)),
    0.1: DecodeConfig(DecodeTile(32, 64, 8, num_warps=2, **_FMA), DecodeTile(32, 128, 4, num_warps=2, **_FMA)),
    0.25: DecodeConfig(DecodeTile(32, 64, 4, num_warps=2, finish=True, **_FMA),
                       DecodeTile(64, 64, 4, num_warps=2, **_FMA)),
    0.5: DecodeConfig(DecodeTile(32, 64, 4, num_warps=2, **_FMA), DecodeTile(32, 128, 4, num_warps=2, **_FMA)),
    1.0: DecodeConfig(DecodeTile(64, 128, 1, 16, True, True, 4, 3), DecodeTile(64, 128, 1, 16, True, True, 4, 3)),
}


def mma_tile(block_n: int, unroll: int, splits: int, finish: bool = False, unpredicated: bool = False) -> DecodeTile:
    """An MMA-fragment tile: ``block_n`` rows (16 per warp), K steps of 64 loaded ``unroll`` at a time."""
    return DecodeTile(block_n, 64 * unroll, splits, 8, False, True, block_n // 16, 1, finish, mma=True,
                      unpredicated=unpredicated)


# MXFP4 / NVFP4 (bfloat16 activations, `mma_ready`), by rows per expert as above: the fastest of
# benchmarks/mxfp4_decode.py's sweeps on an H200 with the MMA-fragment tiles (session 14, call 4:
# benchmarks/results/fp4_gemv_decode_nvidia-h200.md; GPT-OSS-120B MXFP4 at M = 1, 2, 4, 8, 16, 32, 64 and
# Qwen3-30B-A3B NVFP4 at M = 1, 4, 16, 64). Where the two models share a bucket and disagree, GPT-OSS's pick but
# at 0.05 (Qwen3's one token; GPT-OSS's 2 tokens had 56.8 us on s2 tiles); neighbours within 1% share a
# bucket. Bucket 0.1 (Qwen3's 2-3 tokens, GPT-OSS's 4-7) from session 15's sweep of both
# (fp4_gemv_s15_bucket01_*.json): GEMM1 on 4 splits fills the GPU for Qwen3's narrower GEMMs. Below 0.25 rows per
# expert the tiles finish their own epilogue, so the programs take a slot each (`DecodeConfig.per_slot`): no
# alignment launch, no epilogue launch. On an H200 (session 24) that took less time than the same tiles per expert
# in one process, alternating: GPT-OSS's bucket 0.05 at M = 2 and 3 by 2-12%, bucket 0.1 at M = 4 and 6 by 5-11% (and
# in the sweeps, bucket 0.1's tiles at Qwen3 M = 2 and 3 by 26-32%). Bucket 0.25 finishing won at Qwen3 M = 4-6 but
# lost at GPT-OSS M = 8-16 (4-24%) and Qwen3 M = 8-12, where more slots share experts: it stays per expert. A
# shape's table may override a bucket by M (`decode_config`): the H200's Qwen3 and GPT-OSS MXFP4 / NVFP4 tables do for
# one token (session 23's tiles) and, with programs per slot, two (session 24's). Qwen3's also for 3-8 tokens, per slot
# (sessions 24-25; at M = 4-8 0.76-0.94x the time of bucket 0.25 per expert, in one process), and for 9-13 with one
# split per expert (0.92-0.96x, NVFP4 at M = 10 0.99x; at 14 0.99-1.01x, so the bucket from there). GPT-OSS's also for
# 8-9 tokens, per slot (0.95-0.98x; at 10-11 0.99-1.03x). Bucket 0.0 (GPT-OSS's one token; k / E under 0.05: DeepSeek-V3
# and Kimi-K2 too) loads its weights with no predicate (`DecodeTile.unpredicated`): on an H100 (session 43, one process,
# five rounds each) GPT-OSS MXFP4 31.8-32.1 against 33.0-33.3 us, NVFP4 33.3-33.6 against 34.9-35.4; Qwen3's one token
# (bucket 0.05) it made no faster (MXFP4 -0.6%, NVFP4 +1.1%).
_ONE_TOKEN = mma_tile(64, 2, 4, finish=True, unpredicated=True)
DECODE_CONFIGS = {
    0.0: DecodeConfig(_ONE_TOKEN, _ONE_TOKEN),
    0.05: DecodeConfig(mma_tile(32, 2, 4, finish=True), mma_tile(32, 2, 4, finish=True)),
    0.1: DecodeConfig(mma_tile(64, 1, 4, finish=True), mma_tile(64, 2, 2, finish=True)),
    0.25: DecodeConfig(mma_tile(32, 2, 2), mma_tile(32, 2, 2)),
    1.0: DecodeConfig(mma_tile(32, 2, 2), mma_tile(64, 2, 1)),
    2.0: DecodeConfig(mma_tile(64, 2, 1), mma_tile(64, 2, 1)),
}


# fp8 W8A8 (fp8_block and fp8_token), by M as above: the fastest of benchmarks/mxfp4_decode.py's sweep on an
# H100 (--quant fp8_block, Qwen3-30B-A3B at M = 1, 4, 16 and the DeepSeek-V3 EP8 slice at M = 1, 16; 20
# candidates at M <= 16, FMA and tensor-core tiles; benchmarks/results/fp8_decode_nvidia-h100.md). Tensor
# cores won everywhere, one token too (the swapped MMA pads activation rows, not weight rows); from 2 tokens one
# tile is best or within 1% for both, and the H200's sweep at M = 4 and 16 (Qwen3, GPT-OSS-120B) kept it. M = 1:
# the H200's sweeps of tiles that finish their own epilogue (benchmarks/results/fp8_decode_nvidia-h200.md), one
# warpgroup: in one process 21.6 / 43.0 / 103.4 us at Qwen3, GPT-OSS and the DeepSeek slice against the H100 tile's
# 24.3 / 46.0 / 102.5. GPT-OSS's own best (GEMM1 64 wide; GEMM2 4 splits, 8 warps) is 7% faster there and 15-18%
# slower on the other two: such a shape's own choices go in its tuned table's ``decode`` section (config.py), which
# `fp8_decode_config` reads first.
FP8_DECODE_CONFIGS = {
    1: DecodeConfig(DecodeTile(128, 128, 2, 16, True, False, 4, 3, finish=True),
                    DecodeTile(128, 128, 2, 16, True, False, 4, 3, finish=True)),
    2: DecodeConfig(DecodeTile(128, 128, 1, 16, True, False, 8, 3), DecodeTile(128, 128, 1, 16, True, False, 8, 3)),
}


def _bucket(configs: dict, key: float) -> DecodeConfig:
    """The config of the largest key at or below ``key`` (the smallest key's below it)."""
    return configs[max((k for k in configs if k <= key), default=min(configs))]


def _own_decode_config(num_tokens: int, table: ConfigTable | None) -> DecodeConfig | str | None:
    """The shape's own choice for ``num_tokens``: its table's ``decode`` entry at or below it (config.py's docstring)
    as a `DecodeConfig`, or ``"grouped"``; None where there is none or it is ``"default"``."""
    entries = [(m, entry) for m, entry in (table.decode if table is not None else ()) if m <= num_tokens]
    if not entries or entries[-1][1] == "default":
        return None
    entry = entries[-1][1]
    return entry if entry == "grouped" else table_decode_config(entry)


def decode_config(rows_per_expert: float, num_tokens: int = 0, table: ConfigTable | None = None) -> DecodeConfig | None:
    """MXFP4 / NVFP4 / MXFP8 weights' config for ``rows_per_expert`` = slots / local experts: the shape's own where
    its table has a ``decode`` entry at or below ``num_tokens``, None where that entry is ``"grouped"`` (the caller
    runs the grouped GEMMs), else `DECODE_CONFIGS`' bucket; with the FMA and tensor-core tiles' config of the bucket
    as its fallback."""
    own = _own_decode_config(num_tokens, table)
    if own == "grouped":
        return None
    return dataclasses.replace(own or _bucket(DECODE_CONFIGS, rows_per_expert),
                               fallback=_bucket(FALLBACK_DECODE_CONFIGS, rows_per_expert))


def fp8_decode_config(num_tokens: int, table: ConfigTable | None = None) -> DecodeConfig | None:
    """fp8 W8A8's config (fp8_block, fp8_token) for ``num_tokens``: the shape's own where its table has a
    ``decode`` entry at or below ``num_tokens`` (config.py's docstring), None where that entry is ``"grouped"``
    (the caller runs the grouped GEMMs), else `FP8_DECODE_CONFIGS`'."""
    own = _own_decode_config(num_tokens, table)
    if own == "grouped":
        return None
    return own or _bucket(FP8_DECODE_CONFIGS, num_tokens)


@functools.lru_cache(maxsize=None)
def table_decode_config(entry: tuple) -> DecodeConfig:
    """A table's frozen ``decode`` entry of two tiles (`ConfigTable.decode`) as a `DecodeConfig` (`DecodeTile`
    checks the fields), built once per entry rather than on every forward."""
    tiles = decode_tiles(entry)
    try:
        return DecodeConfig(DecodeTile(**tiles["gemm1"]), DecodeTile(**tiles["gemm2"]))
    except TypeError as error:  # a field DecodeTile does not have
        raise MoEConfigError(f"decode entry {tiles!r}: {error}") from error


def make_descriptors(weights: TritonWeights) -> None:
    """The TMA descriptors of the ``tma=True`` tiles in the weights' table's ``decode`` entries (fp8), made and
    checked when the weights are prepared rather than at the first forward that reaches them, as the grouped GEMMs'
    are (`prepare_triton_weights`)."""
    for _, entry in weights.configs.decode:
        if isinstance(entry, str):  # "grouped" or "default"
            continue
        config = table_decode_config(entry)  # DecodeTile's defaults for the fields an entry leaves out
        for operand, tile in ((weights.w13, config.gemm1), (weights.w2, config.gemm2)):
            if tile.tma:
                operand.descriptor(tile.block_n, tile.block_k)


def decodes(weight_fmt: QuantFormat, activation_fmt: QuantFormat) -> bool:
    """Whether the decode kernels serve GEMMs of ``weight_fmt`` weights reading ``activation_fmt``
    activations: MXFP4 / NVFP4 / MXFP8 with unquantized ones (NONE also where the weights run weight-only,
    as NVFP4 and MXFP8 always do here), and fp8_block / fp8_token W8A8 (not their weight-only mode: GPUs without
    fp8 tensor cores keep the grouped GEMM). Per-tensor fp8 keeps it too: its activation scale is the
    abs-max over every row (for gemm2 every slot's intermediate), which each program would re-read or
    a separate launch would reduce first, as the grouped path's does."""
    if weight_fmt in FP8_DECODE_FORMATS:
        return activation_fmt is weight_fmt
    return weight_fmt in DECODE_FORMATS and activation_fmt is QuantFormat.NONE


def uses_decode(weights: TritonWeights, activation_fmt: QuantFormat, num_slots: int) -> bool:
    """Whether a forward of ``num_slots`` slots takes the decode path: `decodes` and at most `max_slots`."""
    return decodes(weights.w13.fmt, activation_fmt) and 0 < num_slots <= max_slots(weights.w13.fmt)


def max_slots(weight_fmt: QuantFormat) -> int:
    """The decode path's bound on M * k for ``weight_fmt`` weights (see `WEIGHT_ONLY_DECODE_MAX_SLOTS`)."""
    return WEIGHT_ONLY_DECODE_MAX_SLOTS if weight_fmt in DECODE_FORMATS else DECODE_MAX_SLOTS


def workspace_buffers(num_slots: int, w13_rows: int, hidden: int, weight_fmt: QuantFormat) -> dict:
    """The partial sums of both GEMMs for up to ``num_slots`` (capped at the decode bound of ``weight_fmt``)."""
    slots = min(num_slots, max_slots(weight_fmt))
    return {
        "decode_part1": ((MAX_SPLITS, slots, w13_rows), torch.float32),
        "decode_part2": ((MAX_SPLITS, slots, hidden), torch.float32),
    }


# the narrowest N tile whose GEMMs finish their own epilogue (`_finishes`): the tickets are sized for it
TICKET_BLOCK_N = 32


def decode_tickets(weight_fmt: QuantFormat, n_out1: int, hidden: int, device) -> torch.Tensor:
    """The epilogue tickets of one layer's decode GEMMs (`TritonWeights.decode_tickets`): a counter per
    (slot, N tile of GEMM1's ``n_out1`` columns) or (token, N tile of the ``hidden`` ones), up to the decode
    bound and N tiles of `TICKET_BLOCK_N`. Per layer, not in the workspace: they must stay 0 between launches,
    which the workspace, shared and rewritten by other buffers, does not keep. Both GEMMs use them in turn (a
    launch leaves them 0), so concurrent forwards of one layer on two streams would need two."""
    tiles = cdiv(max(n_out1, hidden), TICKET_BLOCK_N)
    return torch.zeros(max_slots(weight_fmt) * tiles, dtype=torch.int32, device=device)


def packed_dequantization(weights: TritonWeights, x: torch.Tensor) -> bool:
    """Whether the decode GEMMs may dequantize with the packed bf16x2 PTX (a tile's ``asm`` then decides):
    bfloat16 activations on a GPU (the interpreter runs no PTX), and weights it is exact for -- NVFP4 with
    every e4m3 scale (biased into bf16's range, `_decode.NVFP4_SCALE_BIAS`), MXFP4 with scales <= 2
    (`TritonWeights.small_scales`)."""
    exact = weights.w13.fmt is QuantFormat.NVFP4 or weights.small_scales
    return exact and x.dtype == torch.bfloat16 and x.is_cuda


def converts_e4m3(device: torch.device) -> bool:
    """Whether ``device`` has PTX's cvt from e4m3 (SM89+), which the FMA tiles' e2m1 PTX ends in."""
    return torch.cuda.get_device_capability(device) >= (8, 9)


def tile_asm(tile: DecodeTile, weights: TritonWeights, x: torch.Tensor) -> bool:
    """Whether ``tile``'s GEMMs dequantize fp4 with PTX (see `DecodeTile`): never in the interpreter; FMA
    tiles on SM89+ (`converts_e4m3`; an A100 takes their integer path)."""
    if not tile.asm or weights.w13.fmt not in (QuantFormat.MXFP4, QuantFormat.NVFP4):
        return False
    if tile.dot or tile.mma:
        return packed_dequantization(weights, x)
    return x.is_cuda and converts_e4m3(x.device)


@dataclass(frozen=True)
class _Routing:
    """Where each program group's expert and slots come from (see _decode.py's `_group`)."""

    ids: torch.Tensor  # int32 [slots] global ids
    expert_map: torch.Tensor | None
    counts: torch.Tensor  # int32 [E_local] (grouped) or ids (never read)
    ends: torch.Tensor
    sorted_slots: torch.Tensor
    groups: int  # the grid's bound on groups
    grouped: bool
    num_local: int


def _routing(ids: torch.Tensor, weights: TritonWeights, num_local: int, workspace, per_slot: bool = False) -> _Routing:
    """A program group per slot (no alignment launch) for one token, whose k experts are distinct, or where
    ``per_slot`` (`DecodeConfig.per_slot`); else a group per expert hit, from the alignment's lists."""
    flat = ids.reshape(-1)
    tokens, slots = ids.shape[0], flat.numel()
    if tokens == 1 or per_slot:
        return _Routing(flat, weights.expert_map, flat, flat, flat, slots, False, num_local)
    layout = align_block_size(ids, weights.expert_map, num_local, 1, workspace)
    return _Routing(flat, weights.expert_map, layout.expert_counts, layout.expert_ends, layout.sorted_slots,
                    min(slots, num_local), True, num_local)


def _finishes(tile: DecodeTile, routing: _Routing, rows: int, n_out: int, tickets: torch.Tensor | None) -> bool:
    """Whether a GEMM of ``tile`` applies its split epilogue itself (`_decode._finish_if_last`): a ``finish``
    tile whose programs take one slot each (the ticket is a scalar atomic: FMA tiles always, MMA and tensor-core
    tiles where the routing is per slot) and a ticket for each of ``rows`` x its N tiles."""
    one_slot = not tile.takes_expert_slots or not routing.grouped
    return tile.finish and one_slot and tickets is not None and rows * cdiv(n_out, tile.block_n) <= tickets.numel()


def pdl_roles(x: torch.Tensor, per_slot: bool) -> tuple[int, int]:
    """The two decode GEMMs' parts in a programmatic dependent launch (`_decode.PDL_CHAINED`, `PDL_SECOND`) for
    ``x``: where the programs take a slot each (``per_slot``: the routing does not group them -- one token, or
    `DecodeConfig.per_slot`), on SM90+, GEMM2 may launch once every GEMM1 program is past its K loop, and its
    programs wait for GEMM1 to end before they start, so no launch gap separates the two. On an H200 that took
    fp8_block at M = 1 from 21.68 to 21.12 us (Qwen3-30B-A3B) and 44.21 to 42.32 (GPT-OSS-120B), NVFP4 Qwen3 from
    20.37 to 19.58; at M = 4 and 16 it was within noise (-0.2 to +1.0%), and GEMM2's programs taking free SMs from
    GEMM1's start and asking L2 for their weights meanwhile was slower everywhere (up to 17% at M = 16;
    benchmarks/results/fp8_decode_nvidia-h200.md). GEMM1 is itself launched so after the launch before it (in a
    layer, the routing kernel, which lets it start at once: `moe.routing.fused`), and waits for that grid to end
    before it reads the routing, so its launch runs under the routing kernel: on an H200 the layer at one token took
    2.2-6.8% less (Qwen3-30B-A3B MXFP4 / NVFP4 / fp8_block, GPT-OSS-120B MXFP4 / fp8_block; at 2 and 4 tokens -2.4%
    to +1.9%, within the spread; benchmarks/results/layer_decode_nvidia-h200.md). Elsewhere (groups per expert, older
    GPUs, Triton before 3.4, the CPU interpreter) both run as plain launches."""
    _decode = kernels("decode")
    if per_slot and _decode.pdl_supported(x.device):
        return _decode.PDL_CHAINED, _decode.PDL_SECOND
    return _decode.PDL_NONE, _decode.PDL_NONE


def _gemm(a: torch.Tensor, w: WeightOperand, out: torch.Tensor | None, part: torch.Tensor, routing: _Routing,
          activation: Activation | None, a_row_div: int, tile: DecodeTile, asm: bool, finish: int = 0,
          tickets: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None, top_k: int = 1,
          pdl: int = 0) -> None:
    """One decode GEMM: partial sums into ``part`` (or, with one split and an ``activation`` given,
    the activated result into ``out``); ``finish`` (`_decode.FINISH_ACTIVATE` / `FINISH_COMBINE`): the
    last program of each output row's tile also applies the epilogue launch's work into ``out``; ``pdl``:
    its part in a programmatic dependent launch (`pdl_roles`)."""
    gated = activation is not None and activation.is_gated
    n_out = w.data.shape[1] // (2 if gated else 1)
    k = w.k
    fp8 = w.fmt in FP8_DECODE_FORMATS
    if fp8 and FP8_GROUP_SIZE % tile.block_k:
        raise MoEConfigError(f"fp8 decode tiles need block_k dividing the {FP8_GROUP_SIZE}-column K step "
                             f"(got {tile.block_k}); use 32, 64 or 128")
    if not fp8 and not tile.dot and not tile.mma and tile.block_m != 1:
        raise MoEConfigError(f"{w.fmt.value} FMA decode tiles take one row at a time: block_m must be 1 "
                             f"(got {tile.block_m}); use dot=True for 16-row tiles")
    if tile.mma:
        _check_mma(a, w, n_out, gated, asm)
    if tile.tma:
        _check_tma(a, w)
    fused = tile.splits == 1 and out is not None and activation is not None
    to_out = fused or finish != 0
    has_map = routing.expert_map is not None
    grid = (cdiv(n_out, tile.block_n) * tile.splits, routing.groups)
    dummy = w.data
    frags = w.fragments if tile.mma else None
    kernels("decode").decode_gemm_kernel[grid](
        a, w.data, w.scale, w.global_scale if w.global_scale is not None else dummy,
        w.bias if w.bias is not None else dummy, out if to_out else part, part,
        routing.ids, routing.expert_map if has_map else routing.ids, routing.counts, routing.ends,
        routing.sorted_slots, tickets if finish else routing.ids, topk_weights if finish else part,
        frags.words if frags else dummy, frags.scales if frags else dummy,
        w.descriptor(tile.block_n, tile.block_k) if tile.tma else None,
        routing.num_local, n_out, k, w.data.shape[1], a.stride(0), w.data.stride(0), w.data.stride(1),
        *w.scale.stride(),
        w.bias.stride(0) if w.bias is not None else 0, (out if to_out else part).stride(-2),
        part.stride(0), part.stride(1), frags.words.stride(0) if frags else 0, frags.scales.stride(0) if frags else 0,
        frags.k_blocks if frags else 0, n_out // MMA_ROWS if frags and gated else 0, *activation_args(activation),
        GROUPED=routing.grouped, HAS_MAP=has_map, A_ROW_DIV=a_row_div, GATED=gated,
        ACTIVATION=activation_code(activation), HAS_BIAS=w.bias is not None,
        FUSED=fused, FINISH=finish, TOP_K=top_k, SPLITS=tile.splits, E_PAD=experts_pad(routing.num_local),
        EVEN_K=k % (FP8_GROUP_SIZE if fp8 else tile.block_k) == 0,
        IEEE=a.dtype == torch.float32, DOT=tile.dot, ASM=asm, SCALES=QUANT_CODES[w.fmt], BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, STAGES=tile.num_stages, MMA=tile.mma, PDL=pdl, TMA=tile.tma,
        UNPREDICATED=tile.unpredicated, num_warps=tile.num_warps, num_stages=tile.num_stages,
        # a launch option Triton 3.4 added
        **({"launch_pdl": True} if pdl in (kernels("decode").PDL_SECOND, kernels("decode").PDL_CHAINED) else {}),
    )


def _check_tma(a: torch.Tensor, w: WeightOperand) -> None:
    """``tma=True`` decode tiles: fp8 W8A8 weights (`WeightOperand.descriptor` checks their rows), on a GPU with
    TMA (SM90+) or in the interpreter (which loads descriptors as the GPU does)."""
    if w.fmt not in FP8_DECODE_FORMATS:
        raise MoEConfigError(f"tma=True decode tiles run fp8 W8A8 weights (got {w.fmt.value}); use tma=False")
    if a.is_cuda and torch.cuda.get_device_capability(a.device) < (9, 0):
        raise MoEConfigError("tma=True decode tiles load weights by TMA, which needs SM90+ (got SM{}{}); use "
                             "tma=False here".format(*torch.cuda.get_device_capability(a.device)))


def mma_ready(weights: TritonWeights, x: torch.Tensor) -> bool:
    """Whether MMA tiles (`DecodeTile.mma`) can run these weights on ``x``: `_mma_problem` finds none for GEMM1
    (taken as gated: w13's rows a multiple of 32, a little more than an ungated one needs, which then takes the
    fallback) nor for GEMM2, whose intermediate has w2's K as its stride and starts on the workspace's 256-byte
    alignment."""
    w13, w2 = weights.w13, weights.w2
    asm = packed_dequantization(weights, x)
    return (w13.data.shape[1] % 2 == 0
            and _mma_problem(w13, asm, x.stride(0), x.data_ptr() % 16 == 0, w13.data.shape[1] // 2, True) is None
            and _mma_problem(w2, asm, w2.k, True, w2.data.shape[1], False) is None)


def _mma_problem(w: WeightOperand, asm: bool, row_stride: int, aligned: bool, n_out: int, gated: bool,
                 got: str = "") -> str | None:
    """What keeps an MMA tile from a GEMM of ``w`` on activations with ``row_stride`` (16-byte ``aligned`` rows),
    as an error message; None: nothing. ``got``: the activations, for the message."""
    if w.fragments is None:
        return (f"mma=True tiles need fp4 weights prepared with their MMA fragments on a GPU "
                f"(got {w.fmt.value} weights without them); use an FMA or tensor-core tile")
    if not asm:
        return ("mma=True tiles dequantize with the packed bf16 PTX: bfloat16 activations on a GPU, "
                f"NVFP4 or MXFP4 with scales <= 2{got}")
    if w.k % 8 or row_stride % 8 or not aligned:
        return (f"mma=True tiles load 8 activations at a time: K and the row stride must be multiples "
                f"of 8 and the rows 16-byte aligned (got K={w.k}, stride {row_stride})")
    if gated and n_out % MMA_ROWS:
        return (f"mma=True tiles need a gated GEMM's {n_out} rows per half to be a multiple of "
                f"{MMA_ROWS}; use an FMA or tensor-core tile")
    return None


def _check_mma(a: torch.Tensor, w: WeightOperand, n_out: int, gated: bool, asm: bool) -> None:
    """The MMA tiles' needs (`_mma_problem`) as a MoEConfigError naming what is off."""
    problem = _mma_problem(w, asm, a.stride(0), a.data_ptr() % 16 == 0, n_out, gated,
                           f" (got {a.dtype} activations on {a.device})")
    if problem is not None:
        raise MoEConfigError(problem)


def decode_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, weights: TritonWeights,
                   activation: Activation, num_local: int, config: DecodeConfig, workspace,
                   out: torch.Tensor) -> torch.Tensor:
    """``out [M, H] = sum_j topk_weights[m, j] * experts_j(x[m])`` over the slots whose expert is
    here, for MXFP4, NVFP4, MXFP8, fp8_block or fp8_token ``weights`` and unquantized ``x [M, H]`` in
    bf16/fp16/fp32 (`uses_decode` must hold; fp8 quantizes x and the intermediate inside the GEMMs)."""
    _decode = kernels("decode")
    tokens, top_k = topk_ids.shape
    slots = tokens * top_k
    w13, w2 = weights.w13, weights.w2
    if config.uses_mma and config.fallback is not None and not mma_ready(weights, x):
        config = config.fallback
    routing = _routing(topk_ids, weights, num_local, workspace, config.per_slot)
    pdl1, pdl2 = pdl_roles(x, not routing.grouped)
    inter = workspace["inter"][:slots]
    part1 = workspace["decode_part1"][: config.gemm1.splits, :slots]
    part2 = workspace["decode_part2"][: config.gemm2.splits, :slots]
    has_map = routing.expert_map is not None
    tickets, hidden = weights.decode_tickets, out.shape[1]
    finish1 = config.gemm1.splits > 1 and _finishes(config.gemm1, routing, slots, inter.shape[1], tickets)
    # GEMM2's finishing program writes a token's row once all of its k slots arrive: every expert must be here
    finish2 = not has_map and _finishes(config.gemm2, routing, tokens, hidden, tickets)
    _gemm(x, w13, inter, part1, routing, activation, top_k, config.gemm1, tile_asm(config.gemm1, weights, x),
          finish=_decode.FINISH_ACTIVATE if finish1 else _decode.FINISH_NONE, tickets=tickets, pdl=pdl1)
    emap = routing.expert_map if has_map else routing.ids
    if config.gemm1.splits > 1 and not finish1:
        n = inter.shape[1]
        _decode.activate_splits_kernel[(slots, cdiv(n, _EPILOGUE_BLOCK))](
            part1, w13.bias if w13.bias is not None else part1, routing.ids, emap, inter, n,
            part1.stride(0), part1.stride(1), w13.bias.stride(0) if w13.bias is not None else 0, inter.stride(0),
            *activation_args(activation), GATED=activation.is_gated,
            ACTIVATION=activation_code(activation), HAS_BIAS=w13.bias is not None, HAS_MAP=has_map,
            SPLITS=config.gemm1.splits, BLOCK=_EPILOGUE_BLOCK)
    _gemm(inter, w2, out, part2, routing, None, 1, config.gemm2, tile_asm(config.gemm2, weights, x),
          finish=_decode.FINISH_COMBINE if finish2 else _decode.FINISH_NONE, tickets=tickets,
          topk_weights=topk_weights, top_k=top_k, pdl=pdl2)
    if finish2:
        return out
    _decode.combine_splits_kernel[(tokens, cdiv(hidden, _EPILOGUE_BLOCK))](
        part2, w2.bias if w2.bias is not None else part2, topk_weights, routing.ids, emap, out, hidden,
        part2.stride(0), part2.stride(1), w2.bias.stride(0) if w2.bias is not None else 0, out.stride(0),
        TOP_K=top_k, HAS_BIAS=w2.bias is not None, HAS_MAP=has_map, SPLITS=config.gemm2.splits,
        BLOCK=_EPILOGUE_BLOCK)
    return out
