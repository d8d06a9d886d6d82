"""Canonical ``ExpertWeights`` -> what FlashInfer's trtllm-gen MoE kernels take, once at load.

Every pair: gated ``[gate; up]`` -> ``[up; gate]``; H and I zero-padded per the pair's ModeSpec. Then
the shuffled layouts (all but fp8 128-block): the first GEMM's rows (weights, row scales, bias) take
``layouts.trtllm_rows`` -- the gated interleave only when gated, then the epilogue-tile-128 shuffle --
and the second GEMM's rows (weights, row scales, bias) take the shuffle alone. Block scales are then
128x4-swizzled (``layouts.swizzle_block_scales``) and reshaped back to ``[E, rows, K/block]``.

    pair               payload                      scales                         extra
    bf16               shuffled, BlockMajorK(128 B)  -                              -
    fp8 per tensor     shuffled                      per-expert fp32, kept          dequant products per call
    fp8 128-block      as is, MajorK                 [E, R/128, H/128] fp32, as is  -
    mxfp8              shuffled                      e8m0 (uint8), shuffled + swizzled -
    nvfp4              shuffled                      e4m3, shuffled + swizzled      global scales, kept
    mxfp4 (x bf16/mxfp8) shuffled                    e8m0, shuffled + swizzled      fp32 biases (shuffled)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moe.experts._flashinfer import layouts
from moe.experts._flashinfer.cutlass_weights import Geometry, first_gemm_rows, padded
from moe.experts._flashinfer.library import swiglu_parameters
from moe.problem import MoEProblem
from moe.quant import QuantFormat
from moe.weights import ExpertWeights

F = QuantFormat
BF16_BLOCK_K_BYTES = 128  # trtllm-gen BF16 BlockMajorK blocks 128 bytes of each row
_SCALE_BLOCK = {F.MXFP8: 32, F.MXFP4: 32, F.NVFP4: 16}
_SCALE_FILL = {F.MXFP8: layouts.E8M0_ONE, F.MXFP4: layouts.E8M0_ONE, F.NVFP4: layouts.E4M3_ONE}


@dataclass(frozen=True)
class TrtllmWeights:
    """Kernel-ready trtllm-gen tensors."""

    w13: torch.Tensor  # [E, R', H'] (fp4: [E, R', H'/2] uint8; bf16: BlockMajorK [E, H'*2/128, R', 64])
    w2: torch.Tensor  # [E, H', I'] likewise
    geometry: Geometry
    w13_scale: torch.Tensor | None = None  # block scales [E, R', H'/block] (fp8 block: [E, R'/128, H'/128])
    w2_scale: torch.Tensor | None = None
    per_expert: dict[str, torch.Tensor] = field(default_factory=dict)  # per-tensor / global scales, fp32 [E]
    b13: torch.Tensor | None = None  # fp32 [E, R'], rows in kernel order
    b2: torch.Tensor | None = None  # fp32 [E, H'], rows in kernel order
    activation_params: dict[str, torch.Tensor] = field(default_factory=dict)  # gemm1_alpha/beta/clamp_limit


def _rows(geo: Geometry, shuffled: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Row orders of the first and second GEMM (None: keep the order)."""
    if not shuffled:
        return None, None
    r13 = geo.inter_padded * (2 if geo.gated else 1)
    return layouts.trtllm_rows(r13, geo.gated), layouts.epilogue_shuffle_rows(geo.hidden_padded)


def _ordered(t: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    return t.contiguous() if order is None else layouts.take_rows(t, order)


def _payloads(w: ExpertWeights, geo: Geometry, per_byte: int, orders) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = layouts.pad_dim(first_gemm_rows(w.w13.data, geo), 2, geo.hidden_padded // per_byte)
    w2 = padded(w.w2.data, geo.hidden_padded, geo.inter_padded // per_byte)
    return _ordered(w13, orders[0]), _ordered(w2, orders[1])


def _block_scales(w: ExpertWeights, geo: Geometry, orders) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded, reordered, 128x4-swizzled block scales, each reshaped to ``[E, rows, K/block]``."""
    fmt = w.w13.fmt
    block, fill = _SCALE_BLOCK[fmt], _SCALE_FILL[fmt]
    s13 = first_gemm_rows(layouts.as_bytes(w.w13.scale), geo, fill)
    s13 = layouts.pad_dim(s13, 2, geo.hidden_padded // block, fill)
    s2 = padded(layouts.as_bytes(w.w2.scale), geo.hidden_padded, geo.inter_padded // block, fill)
    return _swizzled(_ordered(s13, orders[0])), _swizzled(_ordered(s2, orders[1]))


def _swizzled(scales: torch.Tensor) -> torch.Tensor:
    """Swizzled in place of the linear scales: same ``[E, rows, K/block]`` shape (rows % 128 == 0 and
    K/block % 4 == 0 hold after padding, so the swizzle adds no padding)."""
    return layouts.swizzle_block_scales(scales).reshape(scales.shape)


def _biases(w: ExpertWeights, geo: Geometry, orders) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if w.b13 is None:
        return None, None
    b13 = first_gemm_rows(w.b13, geo).unsqueeze(-1)
    b2 = layouts.pad_dim(w.b2, 1, geo.hidden_padded).unsqueeze(-1)
    return _ordered(b13, orders[0]).squeeze(-1).float(), _ordered(b2, orders[1]).squeeze(-1).float()


def _activation_params(problem: MoEProblem, num_experts: int, device: torch.device) -> dict[str, torch.Tensor]:
    params = swiglu_parameters(problem.activation, num_experts, device)
    names = {"alpha": "gemm1_alpha", "beta": "gemm1_beta", "limit": "gemm1_clamp_limit"}
    return {names[k]: v for k, v in params.items()}


def prepare_trtllm(weights: ExpertWeights, problem: MoEProblem, geo: Geometry) -> TrtllmWeights:
    """The conversion for ``problem``'s format pair (see the module docstring)."""
    fmt = problem.quant.weight
    shuffled = fmt is not F.FP8_BLOCK
    orders = _rows(geo, shuffled)
    params = _activation_params(problem, weights.num_experts, weights.device)
    per_byte = 2 if fmt.is_packed_fp4 else 1
    w13, w2 = _payloads(weights, geo, per_byte, orders)
    b13, b2 = _biases(weights, geo, orders)
    common = {"geometry": geo, "b13": b13, "b2": b2, "activation_params": params}
    if fmt is F.NONE:
        return TrtllmWeights(_bf16_blocks(w13), _bf16_blocks(w2), **common)
    if fmt is F.FP8_TENSOR:
        per_expert = {"w13_scale": weights.w13.scale.float(), "w2_scale": weights.w2.scale.float()}
        return TrtllmWeights(w13, w2, per_expert=per_expert, **common)
    if fmt is F.FP8_BLOCK:
        # unshuffled MajorK, no padding (ModeSpec.pads is False): [up; gate] by whole 128-row blocks
        s13 = layouts.up_gate_rows(weights.w13.scale) if geo.gated else weights.w13.scale
        s2 = weights.w2.scale.float().contiguous()
        return TrtllmWeights(w13, w2, w13_scale=s13.float().contiguous(), w2_scale=s2, **common)
    s13, s2 = _block_scales(weights, geo, orders)
    if fmt.is_packed_fp4:  # the fp4 entry point takes its block scales typed e4m3, whatever the bytes mean
        s13, s2 = s13.view(torch.float8_e4m3fn), s2.view(torch.float8_e4m3fn)
    per_expert = {}
    if fmt is F.NVFP4:
        per_expert = {"w13_global": weights.w13.global_scale.float(), "w2_global": weights.w2.global_scale.float()}
    return TrtllmWeights(w13, w2, w13_scale=s13, w2_scale=s2, per_expert=per_expert, **common)


def _bf16_blocks(w: torch.Tensor) -> torch.Tensor:
    """BlockMajorK over the bytes of each row (see ``layouts.block_major_k``), viewed back as bf16."""
    return layouts.block_major_k(w.view(torch.uint8), BF16_BLOCK_K_BYTES).view(w.dtype)
