"""`TritonWeights`: canonical `ExpertWeights` converted once, at load, for the Triton kernels.

Only the packed fp4 formats change layout (biases and the other formats keep the canonical one); MXFP4
and NVFP4 alike, their scales being bytes of a different meaning (e8m0 per 32, e4m3 per 16):

- elements: inside each group of 32 along K, byte j holds elements j (low nibble) and j + 16 (high
  nibble), instead of the canonical 2j and 2j + 1. A K-tile then splits into two half-tiles whose A
  columns are contiguous runs of 16, so the kernel needs no register shuffle to interleave nibbles.
- scales: the e8m0 bytes of groups 4w .. 4w + 3 of a row form one little-endian int32 "word" w
  (missing groups of the last word are 0), stored word-major: ``[E, W, N]`` with W = ceil(K / 128),
  so one K step reads, for a tile of rows, one contiguous run of words (4 bytes per row and thread:
  wide enough for Triton's software pipeline, which skips loads under 4 bytes per thread). The
  canonical ``[E, N, K/32]`` bytes made every weight element load its own scale byte, unpipelined.
  NVFP4's e4m3 bytes ``[E, N, K/16]`` pack the same way: word w holds the scales of elements
  64w .. 64w + 63 (the low and high halves of groups 2w and 2w + 1), and its fp32 global scale per expert
  stays beside them (``global_scale``).

Weight-only fp8 (``weight_only``: GPUs without fp8 tensor cores) keeps the e4m3
payload as its uint8 bit patterns: Triton refuses the e4m3 type itself on SM8x, so the kernel decodes the
bits (the scales are unchanged). MXFP8 (always weight-only here) keeps its e4m3 payload as bits too, in the
canonical ``[E, N, K]`` order, and its e8m0 bytes (one per 32 along K, as MXFP4's) become MXFP4's scale
words.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from moe.errors import MoEConfigError
from moe.experts._triton.config import ConfigTable
from moe.quant import QuantFormat, unpack_e2m1
from moe.quant.nvfp4 import NVFP4_BLOCK
from moe.weights import ExpertWeights

MX_GROUP = 32
# the formats whose scales the kernels read as words (mxfp4_scale_words); their K loops load by pointer,
# so their weights take no TMA tiles
SCALE_WORD_FORMATS = (QuantFormat.MXFP4, QuantFormat.NVFP4, QuantFormat.MXFP8)


@dataclass(frozen=True)
class WeightOperand:
    """One GEMM's weights as the kernel reads them."""

    data: torch.Tensor  # [E, N, K] (MXFP4/NVFP4: uint8 [E, N, K/2] in the half-split layout above)
    # canonical scale layout of the format; None when dense. MXFP4/NVFP4/MXFP8: int32 words [E, N, W] (above),
    # a transposed view of a contiguous [E, W, N] tensor (strides W*N, 1, N)
    scale: torch.Tensor | None
    bias: torch.Tensor | None  # fp32 [E, N]
    fmt: QuantFormat
    global_scale: torch.Tensor | None = None  # NVFP4: fp32 [E], the dequantization multiplier per expert
    # TMA descriptors of ``data`` by (BLOCK_N, BLOCK_K), the Gluon kind by (BLOCK_N, BLOCK_K, "gluon"), built
    # once (`descriptor`): not per launch
    descriptors: dict = field(default_factory=dict, compare=False, repr=False)
    # MXFP4 / NVFP4 on a GPU: the same weights in the MMA decode tiles' order (`mma_fragments`); else None
    fragments: MmaFragments | None = None

    @property
    def k(self) -> int:
        return self.data.shape[-1] * (2 if self.fmt.is_packed_fp4 else 1)

    def descriptor(self, block_n: int, block_k: int, gluon: bool = False):
        """A TMA descriptor of ``data`` as ``[E * R, K]`` with ``[block_n, block_k]`` blocks, made on
        the first request and kept (the weights do not move). ``gluon``: the Gluon kind, which carries
        its shared-memory layout (the wgmma and ws tiles' kernels, gemm_wgmma.py and gemm_ws.py)."""
        key = (block_n, block_k, "gluon") if gluon else (block_n, block_k)
        if key not in self.descriptors:
            data = self.data
            rows_aligned = (data.shape[-1] * data.element_size()) % 16 == 0
            if self.fmt in SCALE_WORD_FORMATS or not data.is_contiguous() or not rows_aligned:
                raise MoEConfigError(
                    f"tma=True needs contiguous dense or fp8 weights with 16-byte rows (got {self.fmt.value}, "
                    f"shape {tuple(data.shape)}, {data.dtype}); use tma=False for this scheme")
            shape, strides = [data.shape[0] * data.shape[1], data.shape[2]], [data.shape[2], 1]
            if gluon:
                from triton.experimental.gluon import language as gl
                from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

                element = {torch.float8_e4m3fn: gl.float8e4nv, torch.bfloat16: gl.bfloat16,
                           torch.float16: gl.float16}[data.dtype]
                layout = gl.NVMMASharedLayout.get_default_for([block_n, block_k], element)
                self.descriptors[key] = GluonDescriptor(data.reshape(shape), shape, strides, [block_n, block_k],
                                                        layout)
            else:
                from triton.tools.tensor_descriptor import TensorDescriptor

                self.descriptors[key] = TensorDescriptor(data, shape, strides, [block_n, block_k])
        return self.descriptors[key]


@dataclass(frozen=True)
class TritonWeights:
    w13: WeightOperand  # N = 2I [gate; up] or I
    w2: WeightOperand  # N = H
    expert_map: torch.Tensor | None  # int32 [E] global -> local id (-1: elsewhere); None: identity
    configs: ConfigTable  # launch configs for this shape, scheme and device
    # True: the GEMMs read unquantized activations whatever the scheme says, and dequantize quantized
    # weights in registers (support.activation_format decides per device); NVFP4, MXFP8, W4A8 MXFP4 always
    weight_only: bool = False
    # MXFP4 with every e8m0 scale byte <= 128 (scales <= 2): the decode kernels' packed bf16
    # dequantization (decode.py) is exact for them (NVFP4 needs no such bound: `packed_dequantization`)
    small_scales: bool = False
    # int32 zeros: the decode GEMMs' epilogue tickets (decode.py `decode_tickets`), one per (output row, N tile);
    # every launch leaves them 0. None: the decode path runs its epilogue launches instead
    decode_tickets: torch.Tensor | None = None


def mxfp4_half_split(packed: torch.Tensor) -> torch.Tensor:
    """Canonical packed e2m1 ``[..., K/2]`` (even element low) -> the half-split layout."""
    low, high = packed & 0x0F, packed >> 4
    codes = torch.stack([low, high], dim=-1).flatten(-2)  # [..., K]
    groups = codes.unflatten(-1, (-1, MX_GROUP))
    split = groups[..., : MX_GROUP // 2] | (groups[..., MX_GROUP // 2 :] << 4)
    return split.flatten(-2).contiguous()


def mxfp4_scale_words(scale: torch.Tensor) -> torch.Tensor:
    """Scale bytes ``[E, N, S]`` (e8m0 per 32, or NVFP4's e4m3 per 16) -> int32 words ``[E, N, W]``,
    word w of row n holding bytes 4w .. 4w + 3 (byte s % 4 = scale s), W = ceil(S / 4), as a view of a
    contiguous word-major ``[E, W, N]`` tensor."""
    scale = scale.view(torch.uint8)
    groups = scale.shape[-1]
    padded = torch.zeros(*scale.shape[:-1], 4 * -(-groups // 4), dtype=torch.uint8, device=scale.device)
    padded[..., :groups] = scale
    assert sys.byteorder == "little"  # the kernel reads byte g % 4 of a word at bits 8 * (g % 4)
    words = padded.view(torch.int32)  # [E, N, W]
    return words.transpose(-1, -2).contiguous().transpose(-1, -2)


def to_operand(q, bias: torch.Tensor | None, weight_only: bool = False, fragments: bool = False) -> WeightOperand:
    """``q`` (a weight `QuantizedTensor`) as the kernel reads it; ``weight_only``: fp8 payloads as their
    uint8 bits (the module docstring; MXFP8 always); ``fragments``: fp4 weights also in `MmaFragments`."""
    data, scale = q.data, None if q.scale is None else q.scale.contiguous()
    frags = None
    if q.fmt.is_packed_fp4:
        if fragments:
            frags = mma_fragments(data, scale, q.fmt)
        data, scale = mxfp4_half_split(data), mxfp4_scale_words(scale)
    elif q.fmt is QuantFormat.MXFP8:
        data, scale = data.view(torch.uint8), mxfp4_scale_words(scale)
    elif weight_only and data.dtype == torch.float8_e4m3fn:
        data = data.view(torch.uint8)
    bias = None if bias is None else bias.float().contiguous()
    global_scale = None if q.global_scale is None else q.global_scale.float().contiguous()
    return WeightOperand(data.contiguous(), scale, bias, q.fmt, global_scale, fragments=frags)


def check_tma_a_weights(w: WeightOperand, a_dtype: torch.dtype) -> None:
    """``tma_a=True`` tiles (gemm_tma_a.py) need dense weights in the activations' dtype: checked at load
    for a table's tiles and again at launch, where the activations are known."""
    if w.fmt is not QuantFormat.NONE or w.data.dtype != a_dtype:
        raise MoEConfigError(f"tma_a=True tiles need dense weights in the activations' dtype (got {w.fmt.value} "
                             f"{w.data.dtype} weights, {a_dtype} activations); use tma_a=False for this scheme")


def prepare_triton_weights(
    weights: ExpertWeights, expert_map: list[int] | None, configs: ConfigTable, *, weight_only: bool = False,
    fragments: bool = False,
) -> TritonWeights:
    """The kernels' weights; ``weight_only``: the GEMMs will read unquantized activations (`TritonWeights`);
    ``fragments``: fp4 weights also in the MMA decode tiles' order (`MmaFragments`)."""
    device = weights.device
    identity = expert_map is None or expert_map == list(range(len(expert_map)))
    map_tensor = None if identity else torch.tensor(expert_map, dtype=torch.int32, device=device)
    w13 = to_operand(weights.w13, weights.b13, weight_only, fragments)
    w2 = to_operand(weights.w2, weights.b2, weight_only, fragments)
    for _, config in configs.configs:  # the table's TMA tiles: descriptors (and their checks) at load
        for operand, tile in ((w13, config.gemm1), (w2, config.gemm2)):
            if tile.tma:  # the Gluon kernels' tiles (wgmma, ws) take the Gluon kind
                operand.descriptor(tile.block_n, tile.block_k, gluon=tile.wgmma or tile.ws)
            if tile.tma_a:
                check_tma_a_weights(operand, operand.data.dtype)
    small = all(mxfp4_scales_small(operand) for operand in (w13, w2))
    return TritonWeights(w13=w13, w2=w2, expert_map=map_tensor, configs=configs, weight_only=weight_only,
                         small_scales=small)


def mxfp4_scales_small(operand: WeightOperand) -> bool:
    """Whether an MXFP4 operand's scale bytes are all <= 128 (one host sync, at load)."""
    if operand.fmt is not QuantFormat.MXFP4:
        return False
    words = operand.scale
    return max(int(((words >> shift) & 255).max()) for shift in (0, 8, 16, 24)) <= 128


MMA_ROWS, MMA_K = 16, 64  # one fragment block: 16 weight rows x 64 K elements (512 bytes of e2m1)


@dataclass(frozen=True)
class MmaFragments:
    """An MXFP4 / NVFP4 operand's weights and scales in the MMA tiles' register order (`mma_fragments`), a
    second copy beside the half-split layout: ``words`` int32 ``[E, NB, KB, 32, 4]`` and ``scales`` int32
    ``[E, NB, KB, 32]`` for NB = ceil(N / 16) row blocks and KB = ceil(K / 64) K blocks (zero-padded)."""

    words: torch.Tensor
    scales: torch.Tensor

    @property
    def row_blocks(self) -> int:
        return self.words.shape[1]

    @property
    def k_blocks(self) -> int:
        return self.words.shape[2]


# Where code (register j, half h) of a fragment word puts its magnitude bits m0, m1, m2 and its sign: register j's
# PTX (`_decode_mma.e2m1_fragment_ptx`) then needs one shift and one AND (j = 0: no shift; j = 3: three of each)
# to put them at bf16 bits 6, 7, 8 and 15 of half h (+ 16 h), every bit of the word used once.
FRAGMENT_BITS = ((6, 7, 8, 15), (3, 4, 5, 12), (0, 1, 2, 9), (10, 13, 14, 11))  # (m0, m1, m2, sign) per register


def fragment_words(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes ``[..., 4, 2]`` (register j, half h) -> int32 words ``[...]`` in `FRAGMENT_BITS`' places."""
    codes = codes.to(torch.int32)
    word = torch.zeros(codes.shape[:-2], dtype=torch.int32, device=codes.device)
    for j, places in enumerate(FRAGMENT_BITS):
        for h in range(2):
            for bit, place in enumerate(places):
                word |= ((codes[..., j, h] >> bit) & 1) << (place + 16 * h)
    return word


FRAGMENT_CHUNK_BYTES = 1 << 26  # packed weight bytes converted at a time (the int32 temporaries are 8x as many)
FRAGMENT_BUILD_BYTES = 16 * FRAGMENT_CHUNK_BYTES  # the temporaries of one chunk's conversion, at most
# the fragments are made only if this fraction of the GPU's memory is still free after them (`fragments_fit`)
FRAGMENT_FREE_FRACTION = 0.1


def mma_fragment_bytes(packed_shape: tuple[int, ...]) -> int:
    """The bytes `mma_fragments` makes for canonical e2m1 bytes of shape ``[E, N, K/2]``: per expert, 16-row block
    and 64-column K block, 32 lanes x (16 bytes of codes + 4 of scales)."""
    experts, rows, half_k = packed_shape
    return experts * -(-rows // MMA_ROWS) * -(-2 * half_k // MMA_K) * 32 * (16 + 4)


def fragments_fit(device: torch.device, nbytes: int) -> tuple[bool, str]:
    """Whether ``nbytes`` more of fragments (and their conversion's temporaries) leave `FRAGMENT_FREE_FRACTION` of
    ``device``'s memory free, and the numbers, for a warning. Free counts what the driver has left and what torch's
    caching allocator holds for this process but no tensor uses (it takes those blocks first, and empties its cache
    before it gives up): a process that has freed large tensors still has their room."""
    driver_free, total = torch.cuda.mem_get_info(device)
    free = driver_free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    left = free - nbytes - FRAGMENT_BUILD_BYTES
    gib = 2.0**30
    return left >= FRAGMENT_FREE_FRACTION * total, (f"{nbytes / gib:.2f} GiB needed, {free / gib:.2f} GiB free of "
                                                    f"{total / gib:.2f}")


def mma_fragments(packed: torch.Tensor, scale: torch.Tensor, fmt: QuantFormat) -> MmaFragments:
    """`fragment_block` over ``packed`` (canonical e2m1 bytes ``[E, N, K/2]``) a few experts at a time."""
    per_chunk = max(1, FRAGMENT_CHUNK_BYTES // max(1, packed[0].numel()))
    parts = [fragment_block(unpack_e2m1(packed[i: i + per_chunk]), scale[i: i + per_chunk], fmt)
             for i in range(0, len(packed), per_chunk)]
    return MmaFragments(torch.cat([f.words for f in parts]), torch.cat([f.scales for f in parts]))


def fragment_block(codes: torch.Tensor, scale: torch.Tensor, fmt: QuantFormat) -> MmaFragments:
    """e2m1 ``codes`` uint8 ``[E, N, K]`` (one per byte) and their canonical scale bytes (``[E, N, K/32]`` e8m0 or
    ``[E, N, K/16]`` e4m3) -> `MmaFragments`, laid out so that lane ``l = 4g + t`` of a warp holds, in its 16
    bytes of block (row block, K block), exactly what ``mma.m16n8k16`` needs from rows ``g`` and ``g + 8``.

    The K order inside an MMA is free as long as both operands agree; lane ``t`` takes K elements
    ``8t .. 8t + 7`` of each group of 32 (so its activations are one 16-byte load), K ``8t + {0..3}`` feeding the
    group's first MMA, ``8t + {4..7}`` its second. Word ``2h + w`` of the lane (group h of the block) holds the 8
    codes of K ``32h + 8t + 2w + {0, 1}`` (register j = 2r, half c: row g + 8r, K + c, for the first MMA;
    j = 2 + r the same 4 further, for the second), in `FRAGMENT_BITS`' places. Its scale word: bytes ``2h + r``,
    the scale of (row ``g + 8r``, group h), NVFP4's of the 16-block holding ``8t``."""
    experts, rows, k = codes.shape
    pad_n, pad_k = -rows % MMA_ROWS, -k % MMA_K
    codes = torch.nn.functional.pad(codes, (0, pad_k, 0, pad_n))
    nb, kb = codes.shape[1] // MMA_ROWS, codes.shape[2] // MMA_K
    # dims: E, NB, r, g, KB, h, t, MMA (K + 0 / + 4), w, c
    c = codes.view(experts, nb, 2, 8, kb, 2, 4, 2, 2, 2)
    c = c.permute(0, 1, 4, 3, 6, 5, 8, 7, 2, 9)  # E, NB, KB, g, t, h, w, MMA, r, c
    words = fragment_words(c.reshape(experts, nb, kb, 32, 4, 4, 2))
    per = MX_GROUP if fmt is QuantFormat.MXFP4 else NVFP4_BLOCK
    scale = scale.view(torch.uint8)
    scale = torch.nn.functional.pad(scale, (0, (k + pad_k) // per - scale.shape[-1], 0, pad_n))
    if fmt is QuantFormat.MXFP4:  # E, NB, r, g, KB, h -> one word per (g, t), the same for each t
        s = scale.view(experts, nb, 2, 8, kb, 2).permute(0, 1, 4, 3, 5, 2)  # E, NB, KB, g, h, r
        s = s[:, :, :, :, None].expand(experts, nb, kb, 8, 4, 2, 2)
    else:  # 16-blocks: E, NB, r, g, KB, h, half (t // 2)
        s = scale.view(experts, nb, 2, 8, kb, 2, 2).permute(0, 1, 4, 3, 6, 5, 2)  # E, NB, KB, g, half, h, r
        s = s[:, :, :, :, :, None].expand(experts, nb, kb, 8, 2, 2, 2, 2)  # ..., g, half, t % 2, h, r
    scales = s.reshape(experts, nb, kb, 32, 4).view(torch.int32).squeeze(-1)
    return MmaFragments(words.contiguous(), scales.contiguous())
