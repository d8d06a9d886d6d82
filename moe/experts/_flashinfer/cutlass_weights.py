"""Canonical ``ExpertWeights`` -> what FlashInfer's ``cutlass_fused_moe`` takes, once at load.

Common to every format pair: gated first-GEMM rows go from ``[gate; up]`` to ``[up; gate]``; H and I
are zero-padded to the pair's alignment (``ModeSpec.padded_sizes``) -- each gated half separately, so
a padded channel computes ``act(0) * 0 = 0``; padded scale bytes are 1.0; biases go to the output
dtype. Then per pair:

    bf16 / fp16        weights as they are
    mxfp4 W4A16 (SM90) weights: SM90 mixed-GEMM nibble interleave; e8m0 scales: 64x128 fold, as int32
    fp8 per tensor     weights as they are; per-expert scales kept for the per-call dequant products
    fp8 128-block      weights and [E, R/128, H/128] scales as they are ([up; gate] by whole blocks)
    nvfp4 (SM100+)     packed payload viewed as int64; e4m3 scales 128x4-swizzled, as int32
    mxfp4 x mxfp8      packed payload viewed as int64; e8m0 scales 128x4-swizzled, as int32
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moe.experts._flashinfer import layouts, sm90
from moe.experts._flashinfer.library import flashinfer_module, swiglu_parameters
from moe.problem import MoEProblem
from moe.quant import QuantFormat
from moe.weights import ExpertWeights


@dataclass(frozen=True)
class Geometry:
    """Sizes as the model has them and as the kernel sees them (padded)."""

    hidden: int
    inter: int
    hidden_padded: int
    inter_padded: int
    gated: bool

    @classmethod
    def of(cls, problem: MoEProblem, padded: tuple[int, int]) -> "Geometry":
        return cls(problem.hidden_size, problem.intermediate_size, padded[0], padded[1], problem.activation.is_gated)

    @property
    def padded(self) -> bool:
        return (self.hidden, self.inter) != (self.hidden_padded, self.inter_padded)


@dataclass(frozen=True)
class CutlassWeights:
    """Kernel-ready tensors; ``quant_scales`` is the static part of cutlass_fused_moe's list."""

    w13: torch.Tensor  # [E, R', H'] (packed fp4: [E, R', H'/2] uint8, or its int64 view)
    w2: torch.Tensor  # [E, H', I'] likewise
    geometry: Geometry
    quant_scales: tuple[torch.Tensor, ...] = ()
    per_expert: dict[str, torch.Tensor] = field(default_factory=dict)  # fp8/nvfp4 dequant inputs
    b13: torch.Tensor | None = None  # [E, R'] in the output dtype, [up; gate]
    b2: torch.Tensor | None = None  # [E, H']
    activation_params: dict[str, torch.Tensor] = field(default_factory=dict)  # swiglu_alpha/beta/limit


def first_gemm_rows(t: torch.Tensor, geo: Geometry, fill: int | float = 0, *, swap: bool = True) -> torch.Tensor:
    """Rows of a first-GEMM tensor ``[E, R, ...]``: halves padded to I', then ``[up; gate]`` if gated."""
    if not geo.gated:
        return layouts.pad_dim(t, 1, geo.inter_padded, fill)
    t = layouts.pad_row_halves(t, geo.inter_padded, fill=fill)
    return layouts.up_gate_rows(t) if swap else t


def padded(t: torch.Tensor, rows: int, cols: int, fill: int | float = 0) -> torch.Tensor:
    return layouts.pad_dim(layouts.pad_dim(t, 1, rows, fill), 2, cols, fill)


def biases(weights: ExpertWeights, geo: Geometry, dtype: torch.dtype) -> tuple[torch.Tensor | None, ...]:
    if weights.b13 is None:
        return None, None
    b13 = first_gemm_rows(weights.b13, geo).to(dtype).contiguous()
    b2 = layouts.pad_dim(weights.b2, 1, geo.hidden_padded).to(dtype).contiguous()
    return b13, b2


def _common(weights: ExpertWeights, problem: MoEProblem, geo: Geometry) -> dict:
    b13, b2 = biases(weights, geo, problem.dtype)
    params = swiglu_parameters(problem.activation, weights.num_experts, weights.device)
    names = {"alpha": "swiglu_alpha", "beta": "swiglu_beta", "limit": "swiglu_limit"}
    return {"geometry": geo, "b13": b13, "b2": b2, "activation_params": {names[k]: v for k, v in params.items()}}


def _payloads(weights: ExpertWeights, geo: Geometry, per_byte: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded, reordered payloads; ``per_byte`` values per stored element along K (2 for fp4)."""
    w13 = layouts.pad_dim(first_gemm_rows(weights.w13.data, geo), 2, geo.hidden_padded // per_byte)
    w2 = padded(weights.w2.data, geo.hidden_padded, geo.inter_padded // per_byte)
    return w13.contiguous(), w2.contiguous()


def _row_scales(weights: ExpertWeights, geo: Geometry, block: int, fill: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded, reordered per-row block scales (one byte each) of both weights."""
    s13 = layouts.as_bytes(weights.w13.scale)
    s13 = layouts.pad_dim(first_gemm_rows(s13, geo, fill), 2, geo.hidden_padded // block, fill)
    s2 = padded(layouts.as_bytes(weights.w2.scale), geo.hidden_padded, geo.inter_padded // block, fill)
    return s13, s2


def _sm90_interleaved(w: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The W4A16 interleaves: FlashInfer's own on CUDA, the bit-exact torch twins elsewhere."""
    if w.is_cuda:
        fused_moe = flashinfer_module()
        w = fused_moe.interleave_moe_weights_for_sm90_mixed_gemm(w, "fp4")
        s = fused_moe.interleave_moe_scales_for_sm90_mixed_gemm(s, group_size=32)
        return w, s
    return sm90.interleave_mxfp4_weights(w), sm90.interleave_mxfp4_scales(s)


def prepare_cutlass(weights: ExpertWeights, problem: MoEProblem, geo: Geometry) -> CutlassWeights:
    """The conversion for ``problem``'s format pair (see the module docstring)."""
    pair = (problem.quant.weight, problem.quant.activation)
    common = _common(weights, problem, geo)
    F = QuantFormat
    if pair == (F.NONE, F.NONE):
        return CutlassWeights(*_payloads(weights, geo, 1), **common)
    if pair == (F.MXFP4, F.NONE):
        (w13, w2), (s13, s2) = _payloads(weights, geo, 2), _row_scales(weights, geo, 32, layouts.E8M0_ONE)
        w13, s13 = _sm90_interleaved(w13, s13)
        w2, s2 = _sm90_interleaved(w2, s2)
        return CutlassWeights(w13, w2, quant_scales=(s13.view(torch.int32), s2.view(torch.int32)), **common)
    if pair == (F.FP8_TENSOR, F.FP8_TENSOR):
        per_expert = {"w13_scale": weights.w13.scale.float(), "w2_scale": weights.w2.scale.float()}
        return CutlassWeights(*_payloads(weights, geo, 1), per_expert=per_expert, **common)
    if pair == (F.FP8_BLOCK, F.FP8_BLOCK):
        # no padding for this pair (ModeSpec.pads is False), so the 128-row blocks split at I
        w13 = layouts.up_gate_rows(weights.w13.data) if geo.gated else weights.w13.data
        s13 = layouts.up_gate_rows(weights.w13.scale) if geo.gated else weights.w13.scale
        scales = (s13.float().contiguous(), weights.w2.scale.float().contiguous())
        return CutlassWeights(w13.contiguous(), weights.w2.data.contiguous(), quant_scales=scales, **common)
    if pair == (F.NVFP4, F.NVFP4):
        (w13, w2), (s13, s2) = _payloads(weights, geo, 2), _row_scales(weights, geo, 16, layouts.E4M3_ONE)
        per_expert = {"w13_global": weights.w13.global_scale.float(), "w2_global": weights.w2.global_scale.float()}
        return CutlassWeights(
            w13.view(torch.int64), w2.view(torch.int64), quant_scales=(_swizzled_int32(s13), _swizzled_int32(s2)),
            per_expert=per_expert, **common,
        )
    if pair == (F.MXFP4, F.MXFP8):
        (w13, w2), (s13, s2) = _payloads(weights, geo, 2), _row_scales(weights, geo, 32, layouts.E8M0_ONE)
        ones = torch.ones(weights.num_experts, dtype=torch.float32, device=weights.device)
        scales = (_swizzled_int32(s13), ones, _swizzled_int32(s2), ones.clone())
        return CutlassWeights(w13.view(torch.int64), w2.view(torch.int64), quant_scales=scales, **common)
    raise AssertionError(f"no cutlass conversion for {pair}")  # Capabilities.quant excludes the rest


def _swizzled_int32(scales: torch.Tensor) -> torch.Tensor:
    """``[E, R, S]`` bytes -> 128x4-swizzled ``[E, R'', S''/4]`` int32 (R'' = R up to 128, S'' to 4)."""
    swizzled = layouts.swizzle_block_scales(scales)
    experts, m_tiles, s_tiles = swizzled.shape[:3]
    return swizzled.reshape(experts, m_tiles * 128, s_tiles * 4).view(torch.int32).contiguous()
