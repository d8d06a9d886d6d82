"""How the trtllm-gen MoE entry points serve each scheme: one strategy per mode of ``flashinfer_trtllm``.

Each strategy names its entry-point family (``entry``: ``{entry}_routed_moe`` and ``{entry}_moe``),
converts canonical ``ExpertWeights`` once at load (``prepare``), declares the buffers its per-call
arguments need (``buffers``) and builds the arguments that differ per scheme (``kernel_args``; the
activation scales as the entry takes them: ``kernel_scale``).

Weights, every scheme: gated ``[gate; up]`` -> ``[up; gate]``; H and I zero-padded per the mode. Then
the shuffled layouts (all but fp8 128-block): the first GEMM's rows (weights, row scales, bias) take
``layouts.trtllm_rows`` -- the gated interleave only when gated, then the epilogue-tile-128 shuffle --
and the second GEMM's rows (weights, row scales, bias) take the shuffle alone. Block scales are then
128x4-swizzled (``layouts.swizzle_block_scales``) and reshaped back to ``[E, rows, K/block]``.

    scheme             payload                      scales                         extra
    bf16               shuffled, BlockMajorK(128 B)  -                              -
    fp8 per tensor     shuffled                      per-expert fp32, kept          dequant products per call
    fp8 128-block      as is, MajorK                 [E, R/128, H/128] fp32, as is  group scales transposed per call
    mxfp8              shuffled                      e8m0 (uint8), shuffled + swizzled -
    nvfp4              shuffled                      e4m3, shuffled + swizzled      global scales, kept
    mxfp4 (x bf16/mxfp8) shuffled                    e8m0, shuffled + swizzled      fp32 biases (shuffled)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from moe.experts._flashinfer import layouts
from moe.experts._flashinfer.base import FlashInferExperts
from moe.experts._flashinfer.layouts import Geometry, first_gemm_rows, pad_2d
from moe.experts._flashinfer.library import swiglu_parameters
from moe.problem import MoEProblem
from moe.quant import QuantFormat, QuantizedTensor
from moe.weights import ExpertWeights
from moe.workspace import Workspace

F = QuantFormat
# entry-point families: each has a ``{family}_moe`` (routing from logits) and a ``{family}_routed_moe``
BF16, FP8_TENSOR = "trtllm_bf16", "trtllm_fp8_per_tensor_scale"
FP8_BLOCK, FP4 = "trtllm_fp8_block_scale", "trtllm_fp4_block_scale"
BLOCK_MAJOR_K, MAJOR_K = 2, 0  # flashinfer.tllm_enums.WeightLayout
DEEPSEEK_FP8, MX_FP8 = 1, 2  # flashinfer.tllm_enums.Fp8QuantizationType
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


class TrtllmScheme:
    """One scheme of the trtllm-gen entry points; the defaults are the shuffled block-scaled layouts'."""

    entry = FP4
    shuffled = True  # rows in trtllm-gen's shuffled order

    def prepare(self, experts: FlashInferExperts, weights: ExpertWeights) -> TrtllmWeights:
        geo, p = experts.geometry, experts.problem
        orders = _rows(geo, self.shuffled)
        w13, w2 = _payloads(weights, geo, 2 if weights.w13.fmt.is_packed_fp4 else 1, orders)
        b13, b2 = _biases(weights, geo, orders)
        params = swiglu_parameters(p.activation, weights.num_experts, weights.device)
        names = {"alpha": "gemm1_alpha", "beta": "gemm1_beta", "limit": "gemm1_clamp_limit"}
        common = {"geometry": geo, "b13": b13, "b2": b2, "activation_params": {names[k]: v for k, v in params.items()}}
        return self.convert(weights, w13, w2, orders, common)

    def convert(self, weights: ExpertWeights, w13, w2, orders, common: dict) -> TrtllmWeights:
        s13, s2 = _block_scales(weights, common["geometry"], orders)
        return TrtllmWeights(w13, w2, w13_scale=s13, w2_scale=s2, **common)

    def buffers(self, problem: MoEProblem, geo: Geometry, rows: int) -> dict:
        """The workspace ``kernel_args`` writes, beyond the output, the padded input and the scratch
        (declared from the problem alone: ``FlashInferExperts.declared_workspace`` asks it)."""
        return {}

    def kernel_scale(self, scale: torch.Tensor | None, ws: Workspace) -> torch.Tensor | None:
        """The activations' block scales as the entry takes them."""
        return scale

    def kernel_args(self, experts: FlashInferExperts, x: QuantizedTensor, data: torch.Tensor,
                    scale: torch.Tensor | None, w: TrtllmWeights, ws: Workspace) -> dict[str, Any]:
        """The entry point's arguments that differ per scheme; ``data``/``scale``: ``x`` padded to H'."""
        raise NotImplementedError


class Bf16(TrtllmScheme):
    entry = BF16

    def convert(self, weights, w13, w2, orders, common):
        return TrtllmWeights(_bf16_blocks(w13), _bf16_blocks(w2), **common)

    def kernel_args(self, experts, x, data, scale, w, ws):
        return {"hidden_states": data, "gemm1_weights": w.w13, "gemm2_weights": w.w2, "use_shuffled_weight": True,
                "weight_layout": BLOCK_MAJOR_K, **w.activation_params}


class Fp8PerTensor(TrtllmScheme):
    entry = FP8_TENSOR

    def convert(self, weights, w13, w2, orders, common):
        per_expert = {"w13_scale": weights.w13.scale.float(), "w2_scale": weights.w2.scale.float()}
        return TrtllmWeights(w13, w2, per_expert=per_expert, **common)

    def buffers(self, problem, geo, rows):
        return _output_scale_buffers(problem)

    def kernel_args(self, experts, x, data, scale, w, ws):
        out1, gate, out2 = _output_scales(experts, x.scale, w, ws, "w13_scale", "w2_scale")
        return {"hidden_states": data, "gemm1_weights": w.w13, "output1_scales_scalar": out1,
                "output1_scales_gate_scalar": gate, "gemm2_weights": w.w2, "output2_scales_scalar": out2,
                "use_routing_scales_on_input": False}


class Mxfp8(TrtllmScheme):
    entry = FP8_BLOCK
    quantization = MX_FP8

    def kernel_args(self, experts, x, data, scale, w, ws):
        return {**_block_scaled(w), "hidden_states": data, "hidden_states_scale": scale,
                "use_shuffled_weight": self.shuffled, "weight_layout": MAJOR_K,
                "fp8_quantization_type": experts.fp8_type(self.quantization), **w.activation_params}


class Fp8Block(Mxfp8):
    """DeepSeek FP8: unshuffled MajorK, not padded (its mode does not pad): [up; gate] by whole
    128-row blocks; the activations' 1x128 group scales go in transposed, ``[H/128, M]``."""

    shuffled = False
    quantization = DEEPSEEK_FP8

    def convert(self, weights, w13, w2, orders, common):
        s13 = layouts.up_gate_rows(weights.w13.scale) if common["geometry"].gated else weights.w13.scale
        s2 = weights.w2.scale.float().contiguous()
        return TrtllmWeights(w13, w2, w13_scale=s13.float().contiguous(), w2_scale=s2, **common)

    def buffers(self, problem, geo, rows):
        return {"x_scale_t": ((-(-geo.hidden_padded // 128) * rows,), torch.float32)}

    def kernel_scale(self, scale, ws):
        t = ws["x_scale_t"][: scale.numel()].view(scale.shape[1], scale.shape[0])
        return t.copy_(scale.t())


class Fp4(TrtllmScheme):
    """mxfp4 weights (x bf16 or mxfp8 activations); the block scales typed e4m3, whatever the bytes mean."""

    def convert(self, weights, w13, w2, orders, common):
        s13, s2 = _block_scales(weights, common["geometry"], orders)
        return TrtllmWeights(w13, w2, w13_scale=s13.view(torch.float8_e4m3fn), w2_scale=s2.view(torch.float8_e4m3fn),
                             per_expert=self.per_expert(weights), **common)

    def per_expert(self, weights: ExpertWeights) -> dict[str, torch.Tensor]:
        return {}

    def kernel_scale(self, scale, ws):
        return None if scale is None else scale.view(torch.float8_e4m3fn)  # mxfp8 e8m0 bytes typed e4m3

    def output_scales(self, experts, x, w, ws) -> tuple:
        return None, None, None

    def kernel_args(self, experts, x, data, scale, w, ws):
        out1, gate, out2 = self.output_scales(experts, x, w, ws)
        return {**_block_scaled(w), "hidden_states": data, "hidden_states_scale": scale, "gemm1_bias": w.b13,
                "gemm2_bias": w.b2, "output1_scale_scalar": out1, "output1_scale_gate_scalar": gate,
                "output2_scale_scalar": out2,
                **{name: w.activation_params.get(name) for name in ("gemm1_alpha", "gemm1_beta", "gemm1_clamp_limit")}}


class Nvfp4(Fp4):
    """NVFP4: global scales kept, the epilogue scales built per call from the activation's global scale."""

    def per_expert(self, weights):
        return {"w13_global": weights.w13.global_scale.float(), "w2_global": weights.w2.global_scale.float()}

    def buffers(self, problem, geo, rows):
        return _output_scale_buffers(problem)

    def output_scales(self, experts, x, w, ws):
        return _output_scales(experts, x.global_scale, w, ws, "w13_global", "w2_global")


# --- shared pieces --------------------------------------------------------------------------------


def _output_scale_buffers(problem: MoEProblem) -> dict:
    return {name: ((problem.local_num_experts,), torch.float32) for name in ("out1", "out1_gate", "out2")}


def _output_scales(experts: FlashInferExperts, a1: torch.Tensor, w: TrtllmWeights, ws: Workspace, first: str,
                   second: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-expert epilogue scales from the per-call activation scale ``a1`` (a dequant multiplier):
    gate = a1 * w13, out1 = gate / a2 (gated) or 1 / a2, out2 = a2 * w2, a2 the static intermediate scale."""
    a2 = experts.intermediate_scale
    gate = torch.mul(w.per_expert[first], a1, out=ws["out1_gate"])
    out1 = torch.div(gate, a2, out=ws["out1"]) if experts.problem.activation.is_gated else ws["out1"].fill_(1.0 / a2)
    out2 = torch.mul(w.per_expert[second], a2, out=ws["out2"])
    return out1, gate, out2


def _block_scaled(w: TrtllmWeights) -> dict[str, torch.Tensor]:
    return {"gemm1_weights": w.w13, "gemm1_weights_scale": w.w13_scale,
            "gemm2_weights": w.w2, "gemm2_weights_scale": w.w2_scale}


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
    w2 = pad_2d(w.w2.data, geo.hidden_padded, geo.inter_padded // per_byte)
    return _ordered(w13, orders[0]), _ordered(w2, orders[1])


def _block_scales(w: ExpertWeights, geo: Geometry, orders) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded, reordered, 128x4-swizzled block scales, each reshaped to ``[E, rows, K/block]``."""
    fmt = w.w13.fmt
    block, fill = _SCALE_BLOCK[fmt], _SCALE_FILL[fmt]
    s13 = first_gemm_rows(layouts.as_bytes(w.w13.scale), geo, fill)
    s13 = layouts.pad_dim(s13, 2, geo.hidden_padded // block, fill)
    s2 = pad_2d(layouts.as_bytes(w.w2.scale), geo.hidden_padded, geo.inter_padded // block, fill)
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


def _bf16_blocks(w: torch.Tensor) -> torch.Tensor:
    """BlockMajorK over the bytes of each row (see ``layouts.block_major_k``), viewed back as bf16."""
    return layouts.block_major_k(w.view(torch.uint8), BF16_BLOCK_K_BYTES).view(w.dtype)
