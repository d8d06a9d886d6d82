"""How ``cutlass_fused_moe`` serves each scheme: one strategy per mode of ``flashinfer_cutlass``.

Each strategy converts canonical ``ExpertWeights`` once at load (``prepare``), declares the buffers its
per-call inputs need (``buffers``) and builds those inputs (``inputs``: the kernel's input, input_sf and
quant_scales). Common to every scheme: gated first-GEMM rows go from ``[gate; up]`` to ``[up; gate]``;
H and I are zero-padded to the mode's alignment (``Mode.padded_sizes``) -- each gated half separately,
so a padded channel computes ``act(0) * 0 = 0``; padded scale bytes are 1.0; biases go to the output
dtype. Then per scheme:

    bf16 / fp16        weights as they are
    mxfp4 W4A16 (SM90) weights: SM90 mixed-GEMM nibble interleave; e8m0 scales: 64x128 fold, as int32
    fp8 per tensor     weights as they are; per-expert scales kept for the per-call dequant products;
                       activations quantized per tensor here, into the workspace
    fp8 128-block      weights and [E, R/128, H/128] scales as they are ([up; gate] by whole blocks)
    nvfp4 (SM100+)     packed payload viewed as int64; e4m3 scales 128x4-swizzled, as int32;
                       activation global scale per call
    mxfp4 x mxfp8      packed payload viewed as int64; e8m0 scales 128x4-swizzled, as int32;
                       activations quantized to mxfp8 here

fp8 per tensor and nvfp4 quantize the intermediate inside the kernel with the static
``intermediate_scale``: its inverse is made once here (``fc2_act_quant``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from moe.experts._flashinfer import layouts, sm90
from moe.experts._flashinfer.base import E4M3_MAX, FlashInferExperts, nvfp4_activation_scale
from moe.experts._flashinfer.layouts import Geometry, first_gemm_rows, pad_2d
from moe.experts._flashinfer.library import flashinfer_module, swiglu_parameters
from moe.problem import MoEProblem
from moe.quant import QuantFormat, quantize
from moe.weights import ExpertWeights
from moe.workspace import Workspace


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


Inputs = tuple[torch.Tensor, Any, tuple]  # (input, input_sf, quant_scales) as cutlass_fused_moe takes them


class CutlassScheme:
    """One scheme of cutlass_fused_moe; the defaults serve bf16."""

    flags: Mapping[str, bool] = {}  # the entry point's switch for this scheme (use_..._scaling)
    # the input and weight dtypes the kernel is given, for its workspace-size query; None: problem.dtype
    x_dtype: torch.dtype | None = None
    w_dtype: torch.dtype | None = None

    def prepare(self, experts: FlashInferExperts, weights: ExpertWeights) -> CutlassWeights:
        geo, p = experts.geometry, experts.problem
        b13, b2 = _biases(weights, geo, p.dtype)
        params = swiglu_parameters(p.activation, weights.num_experts, weights.device)
        names = {"alpha": "swiglu_alpha", "beta": "swiglu_beta", "limit": "swiglu_limit"}
        common = {"geometry": geo, "b13": b13, "b2": b2, "activation_params": {names[k]: v for k, v in params.items()}}
        return self.convert(weights, geo, common, experts.intermediate_scale)

    def convert(self, weights: ExpertWeights, geo: Geometry, common: dict, intermediate_scale: float) -> CutlassWeights:
        return CutlassWeights(*_payloads(weights, geo, 1), **common)

    def buffers(self, problem: MoEProblem, geo: Geometry, rows: int) -> dict:
        """The workspace ``inputs`` writes, beyond the output and the library's scratch (declared from
        the problem alone: ``FlashInferExperts.declared_workspace`` asks it without an instance)."""
        return {}

    def inputs(self, experts: FlashInferExperts, x: torch.Tensor, w: CutlassWeights, ws: Workspace) -> Inputs:
        return x, None, w.quant_scales


class W4A16(CutlassScheme):
    flags = {"use_w4_group_scaling": True}
    w_dtype = torch.uint8

    def convert(self, weights, geo, common, intermediate_scale):
        (w13, w2), (s13, s2) = _payloads(weights, geo, 2), _row_scales(weights, geo, 32, layouts.E8M0_ONE)
        w13, s13 = _sm90_interleaved(w13, s13)
        w2, s2 = _sm90_interleaved(w2, s2)
        return CutlassWeights(w13, w2, quant_scales=(s13.view(torch.int32), s2.view(torch.int32)), **common)


class Fp8PerTensor(CutlassScheme):
    x_dtype = w_dtype = torch.float8_e4m3fn

    def convert(self, weights, geo, common, intermediate_scale):
        per_expert = {"w13_scale": weights.w13.scale.float(), "w2_scale": weights.w2.scale.float(),
                      "fc2_act_quant": _inverse(intermediate_scale, (), weights.device)}
        return CutlassWeights(*_payloads(weights, geo, 1), per_expert=per_expert, **common)

    def buffers(self, problem, geo, rows):
        return {"x_q": ((rows, geo.hidden_padded), torch.float8_e4m3fn), **_dequant_buffers(problem)}

    def inputs(self, experts, x, w, ws):
        a1 = torch.div(x.abs().amax().float().clamp(min=1e-12), E4M3_MAX, out=ws["act_scale"][0])
        xq = ws["x_q"][: x.shape[0]]
        xq.copy_((x.float() / a1).clamp(-E4M3_MAX, E4M3_MAX))
        a2 = experts.intermediate_scale
        scales = (torch.mul(w.per_expert["w13_scale"], a1, out=ws["fc1_dequant"]), w.per_expert["fc2_act_quant"],
                  torch.mul(w.per_expert["w2_scale"], a2, out=ws["fc2_dequant"]), a1)
        return xq, None, scales


class Fp8Block(CutlassScheme):
    flags = {"use_deepseek_fp8_block_scale": True}
    w_dtype = torch.float8_e4m3fn

    def convert(self, weights, geo, common, intermediate_scale):
        # no padding for this scheme (its mode does not pad), so the 128-row blocks split at I
        w13 = layouts.up_gate_rows(weights.w13.data) if geo.gated else weights.w13.data
        s13 = layouts.up_gate_rows(weights.w13.scale) if geo.gated else weights.w13.scale
        scales = (s13.float().contiguous(), weights.w2.scale.float().contiguous())
        return CutlassWeights(w13.contiguous(), weights.w2.data.contiguous(), quant_scales=scales, **common)


class Nvfp4(CutlassScheme):
    w_dtype = torch.int64

    def convert(self, weights, geo, common, intermediate_scale):
        (w13, w2), (s13, s2) = _payloads(weights, geo, 2), _row_scales(weights, geo, 16, layouts.E4M3_ONE)
        per_expert = {"w13_global": weights.w13.global_scale.float(), "w2_global": weights.w2.global_scale.float(),
                      "fc2_act_quant": _inverse(intermediate_scale, (1,), weights.device)}
        return CutlassWeights(w13.view(torch.int64), w2.view(torch.int64), per_expert=per_expert,
                              quant_scales=(_swizzled_int32(s13), _swizzled_int32(s2)), **common)

    def buffers(self, problem, geo, rows):
        return _dequant_buffers(problem)

    def inputs(self, experts, x, w, ws):
        a1_global = nvfp4_activation_scale(x, ws["act_scale"][0])  # FlashInfer's quant multiplier
        fc1 = torch.div(w.per_expert["w13_global"], a1_global, out=ws["fc1_dequant"])
        fc2 = torch.mul(w.per_expert["w2_global"], experts.intermediate_scale, out=ws["fc2_dequant"])
        s13, s2 = w.quant_scales
        return x, None, (a1_global, s13, fc1, w.per_expert["fc2_act_quant"], s2, fc2)


class Mxfp4Mxfp8(CutlassScheme):
    flags = {"use_mxfp8_act_scaling": True}
    x_dtype, w_dtype = torch.float8_e4m3fn, torch.int64

    def convert(self, weights, geo, common, intermediate_scale):
        (w13, w2), (s13, s2) = _payloads(weights, geo, 2), _row_scales(weights, geo, 32, layouts.E8M0_ONE)
        ones = torch.ones(weights.num_experts, dtype=torch.float32, device=weights.device)
        scales = (_swizzled_int32(s13), ones, _swizzled_int32(s2), ones.clone())
        return CutlassWeights(w13.view(torch.int64), w2.view(torch.int64), quant_scales=scales, **common)

    def inputs(self, experts, x, w, ws):
        q = quantize(x, QuantFormat.MXFP8, "activation")
        return q.data, q.scale, w.quant_scales


# --- shared conversions ---------------------------------------------------------------------------


def _biases(weights: ExpertWeights, geo: Geometry, dtype: torch.dtype) -> tuple[torch.Tensor | None, ...]:
    if weights.b13 is None:
        return None, None
    b13 = first_gemm_rows(weights.b13, geo).to(dtype).contiguous()
    b2 = layouts.pad_dim(weights.b2, 1, geo.hidden_padded).to(dtype).contiguous()
    return b13, b2


def _payloads(weights: ExpertWeights, geo: Geometry, per_byte: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded, reordered payloads; ``per_byte`` values per stored element along K (2 for fp4)."""
    w13 = layouts.pad_dim(first_gemm_rows(weights.w13.data, geo), 2, geo.hidden_padded // per_byte)
    w2 = pad_2d(weights.w2.data, geo.hidden_padded, geo.inter_padded // per_byte)
    return w13.contiguous(), w2.contiguous()


def _row_scales(weights: ExpertWeights, geo: Geometry, block: int, fill: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded, reordered per-row block scales (one byte each) of both weights."""
    s13 = layouts.as_bytes(weights.w13.scale)
    s13 = layouts.pad_dim(first_gemm_rows(s13, geo, fill), 2, geo.hidden_padded // block, fill)
    s2 = pad_2d(layouts.as_bytes(weights.w2.scale), geo.hidden_padded, geo.inter_padded // block, fill)
    return s13, s2


def _sm90_interleaved(w: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The W4A16 interleaves: FlashInfer's own on CUDA, the bit-exact torch twins elsewhere."""
    if w.is_cuda:
        fused_moe = flashinfer_module()
        w = fused_moe.interleave_moe_weights_for_sm90_mixed_gemm(w, "fp4")
        s = fused_moe.interleave_moe_scales_for_sm90_mixed_gemm(s, group_size=32)
        return w, s
    return sm90.interleave_mxfp4_weights(w), sm90.interleave_mxfp4_scales(s)


def _swizzled_int32(scales: torch.Tensor) -> torch.Tensor:
    """``[E, R, S]`` bytes -> 128x4-swizzled ``[E, R'', S''/4]`` int32 (R'' = R up to 128, S'' to 4)."""
    swizzled = layouts.swizzle_block_scales(scales)
    experts, m_tiles, s_tiles = swizzled.shape[:3]
    return swizzled.reshape(experts, m_tiles * 128, s_tiles * 4).view(torch.int32).contiguous()


def _inverse(intermediate_scale: float, shape: tuple, device: torch.device) -> torch.Tensor:
    """The static intermediate scale as FlashInfer's quant multiplier."""
    return torch.full(shape, 1.0 / intermediate_scale, dtype=torch.float32, device=device)


def _dequant_buffers(problem: MoEProblem) -> dict:
    """The per-call activation scale and the per-expert dequant products built from it."""
    local = problem.local_num_experts
    return {"act_scale": ((1,), torch.float32), "fc1_dequant": ((local,), torch.float32),
            "fc2_dequant": ((local,), torch.float32)}
