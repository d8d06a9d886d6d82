"""``flashinfer_trtllm``: FlashInfer's trtllm-gen fused MoE kernels (SM100/SM103), standard format.

One kernel call does routing-sort, both GEMMs with the activation fused, and the router-weighted sum
over k (output ``reduced``, always bf16). Format pairs (``TRTLLM_MODES``; entry point per pair):

    pair             entry point                                  activations                 bias
    bf16             trtllm_bf16_routed_moe                       silu, swiglu_oai, relu2     no
    fp8 per tensor   trtllm_fp8_per_tensor_scale_routed_moe       silu, relu2                 no
    fp8 128-block    trtllm_fp8_block_scale_routed_moe (DeepSeek) silu, swiglu_oai            no
    mxfp8            trtllm_fp8_block_scale_routed_moe (MxFp8)    all four                    no
    nvfp4            trtllm_fp4_block_scale_routed_moe            all four                    yes
    mxfp4 (W4A16)    trtllm_fp4_block_scale_routed_moe            silu, swiglu_oai            yes
    mxfp4 x mxfp8    trtllm_fp4_block_scale_routed_moe            all four                    yes

I is padded to 16 (gated) / 128 (non-gated) -- 64/128 for bf16 (BlockMajorK) and nvfp4, 128 for the
mx formats -- and H to 128; fp8 128-block is not padded. Activations arrive quantized by prepare
(``quantizes_input`` is False).

Two ways in:
- ``apply`` (the routed variants): the router ran outside; ids and bf16 weights are packed as
  ``(id << 16) | bf16 bits`` (``layouts.pack_topk``).
- ``apply_router_logits``: routing runs inside the kernel from the router logits (``ROUTES_FROM_LOGITS``
  lists the routings it reproduces); the router's ties may break differently.

None of this can run on the lent SM90 machines: it is tested up to the kernel call (layouts, argument
contracts against the installed FlashInfer, capability checks on a simulated SM100 platform).
"""

from __future__ import annotations

from typing import Any

import torch

from moe.activation import ActivationKind as A
from moe.experts._flashinfer import layouts
from moe.experts._flashinfer.cutlass_weights import Geometry
from moe.experts._flashinfer.library import activation_type, autotuning, flashinfer_module
from moe.experts._flashinfer.modes import ALL_ACTIVATIONS, SM100_FAMILY, ModeSpec, expert_map_reasons, mode_reasons
from moe.experts._flashinfer.trtllm_weights import TrtllmWeights, prepare_trtllm
from moe.experts.base import Capabilities, Experts
from moe.formats import ActivationFormat, Dispatched, DispatchShape, ExpertsOutput, OutputKind
from moe.platform import Platform
from moe.problem import MoEProblem
from moe.quant import QuantFormat, QuantizedTensor, quantize, row_layout
from moe.registry import register_experts
from moe.router import Router, TopK
from moe.weights import ExpertWeights
from moe.workspace import Workspace, WorkspaceManager, WorkspaceShapes

F = QuantFormat
# entry-point families: each has a ``{family}_moe`` (routing from logits) and a ``{family}_routed_moe``
BF16, FP8_TENSOR = "trtllm_bf16", "trtllm_fp8_per_tensor_scale"
FP8_BLOCK, FP4 = "trtllm_fp8_block_scale", "trtllm_fp4_block_scale"


def _mode(entry: str, activations, i_align: int, i_align_nongated: int = 128, *, pads=True, bias=False) -> ModeSpec:
    return ModeSpec(kernel=f"{entry}_routed_moe", archs=SM100_FAMILY, activations=frozenset(activations),
                    h_align=128, i_align=i_align, i_align_nongated=i_align_nongated, pads=pads, bias=bias,
                    features=(f"{entry}_routed_moe", f"{entry}_moe"))


TRTLLM_MODES = {
    # BF16: BlockMajorK blocks 128 bytes of each row, so I (the second GEMM's K) pads to 64, not 16
    (F.NONE, F.NONE): _mode(BF16, {A.SILU, A.SWIGLU_OAI, A.RELU2}, 64),
    (F.FP8_TENSOR, F.FP8_TENSOR): _mode(FP8_TENSOR, {A.SILU, A.RELU2}, 16),
    (F.FP8_BLOCK, F.FP8_BLOCK): _mode(FP8_BLOCK, {A.SILU, A.SWIGLU_OAI}, 128, pads=False),
    (F.MXFP8, F.MXFP8): _mode(FP8_BLOCK, ALL_ACTIVATIONS, 128),
    (F.NVFP4, F.NVFP4): _mode(FP4, ALL_ACTIVATIONS, 64, bias=True),
    (F.MXFP4, F.NONE): _mode(FP4, {A.SILU, A.SWIGLU_OAI}, 128, bias=True),
    (F.MXFP4, F.MXFP8): _mode(FP4, ALL_ACTIVATIONS, 128, bias=True),
}
# routing name -> trtllm-gen RoutingMethodType (flashinfer/tllm_enums.py) when routing in the kernel
ROUTES_FROM_LOGITS = {"softmax": (4, 0), "gpt_oss": (1, 1), "deepseek_v3": (2, 2)}  # (renormalized, plain)
_DEEPSEEK_FP8, _MX_FP8 = 1, 2  # Fp8QuantizationType
_BLOCK_MAJOR_K, _MAJOR_K = 2, 0  # WeightLayout


def routing_arguments(router: Router) -> dict[str, Any]:
    """The in-kernel routing arguments reproducing ``router`` (see ``ROUTES_FROM_LOGITS``)."""
    renormalized, plain = ROUTES_FROM_LOGITS[router.routing]
    deepseek = router.routing == "deepseek_v3"
    bias = router.correction_bias
    return {
        "routing_method_type": renormalized if router.renormalize else plain,
        "n_group": (router.n_group or 1) if deepseek else None,
        "topk_group": (router.topk_group or 1) if deepseek else None,
        "routed_scaling_factor": float(router.routed_scaling_factor),
        "routing_bias": None if bias is None else bias.to(torch.bfloat16),
        "norm_topk_prob": router.renormalize,
    }


@register_experts
class FlashInferTrtllmExperts(Experts):
    name = "flashinfer_trtllm"
    prepared_type = TrtllmWeights
    capabilities = Capabilities(
        formats=frozenset({ActivationFormat.STANDARD}),
        quant=frozenset(TRTLLM_MODES),
        activations=ALL_ACTIVATIONS,
        output=OutputKind.REDUCED,
        dtypes=frozenset({torch.bfloat16}),
        devices=frozenset({"cuda"}),
        min_capability=(10, 0),
        max_capability=(10, 3),
        libraries=("flashinfer",),
        alignment={"hidden_size": 128, "intermediate_size": 128},  # per pair in TRTLLM_MODES
        pads_to_alignment=True,  # fp8 128-block does not pad; extra_checks says so
        bias=True,  # the fp4 pairs only; extra_checks says so
        cuda_graph_safe=True,
        deterministic=False,
        routes_from_logits=frozenset(ROUTES_FROM_LOGITS),
    )

    def __init__(self, problem: MoEProblem, *, intermediate_scale: float = 1.0):
        super().__init__(problem)
        self.pair = (problem.quant.weight, problem.quant.activation)
        self.mode = TRTLLM_MODES[self.pair]
        self.entry = self.mode.kernel.removesuffix("_routed_moe")
        self.geometry = Geometry.of(problem, self.mode.padded_sizes(problem))
        self.intermediate_scale = float(intermediate_scale)  # static dequant scale of fp8/nvfp4 intermediates
        self.tune_max_tokens = 1 << max(problem.max_tokens - 1, 0).bit_length()
        first, count = problem.parallel.global_to_local(problem.num_experts).index(0), problem.local_num_experts
        self.local_experts = (first, count)

    @classmethod
    def extra_checks(cls, problem: MoEProblem, platform: Platform | None) -> list[str]:
        return mode_reasons(TRTLLM_MODES, problem, platform) + expert_map_reasons(problem)

    def prepare_weights(self, weights: ExpertWeights) -> TrtllmWeights:
        weights.validate(self.problem)
        return prepare_trtllm(weights, self.problem, self.geometry)

    # --- workspace ---------------------------------------------------------------------------
    def workspace_shapes(self, dispatch: DispatchShape) -> WorkspaceShapes:
        rows, g, p = dispatch.max_rows, self.geometry, self.problem
        row = row_layout(p.quant.activation, g.hidden_padded, torch.float32)
        buffers = {"out": ((rows, g.hidden_padded), torch.bfloat16), "topk": ((rows, p.top_k), torch.int32)}
        if g.hidden_padded != g.hidden:
            buffers["x"] = ((rows, row.data_columns), row.data_dtype)
            if row.scale_columns:
                buffers["x_scale"] = ((rows, row.scale_columns), row.scale_dtype)
        if self.pair == (F.FP8_BLOCK, F.FP8_BLOCK):
            buffers["x_scale_t"] = ((row.scale_columns * rows,), torch.float32)
        if self.pair in ((F.FP8_TENSOR, F.FP8_TENSOR), (F.NVFP4, F.NVFP4)):
            for name in ("out1", "out1_gate", "out2"):
                buffers[name] = ((p.local_num_experts,), torch.float32)
        buffers["library"] = ((self._scratch_estimate(rows),), torch.uint8)
        return WorkspaceShapes.of(**buffers)

    def _scratch_estimate(self, rows: int) -> int:
        """trtllm-gen allocates its routing buffers and GEMM intermediates itself; this accounts for them
        (an estimate: permuted input, first-GEMM output and activation per (token, slot), padded tiles)."""
        g, p = self.geometry, self.problem
        slots = rows * p.top_k + p.local_num_experts * 128
        return slots * (2 * g.hidden_padded + 4 * p.w13_rows + 2 * g.inter_padded + 16) + (8 << 20)

    # --- forward -----------------------------------------------------------------------------
    def apply(self, dispatched: Dispatched, weights: TrtllmWeights, workspace: Workspace) -> ExpertsOutput:
        """The routed variant: routing from ``dispatched.topk``, packed into the workspace."""
        rows = dispatched.num_rows
        out = workspace["out"][:rows]
        if rows:
            packed = layouts.pack_topk(dispatched.topk.ids, dispatched.topk.weights, out=workspace["topk"][:rows])
            kwargs = self._kernel_kwargs(dispatched.x, weights, workspace, out)
            routing = {"topk_ids": packed, "n_group": None, "topk_group": None, "routed_scaling_factor": None}
            if self.entry != BF16:
                routing["routing_bias"] = None
            getattr(flashinfer_module(), f"{self.entry}_routed_moe")(**routing, **kwargs)
        return ExpertsOutput(OutputKind.REDUCED, layouts.unpad_view(out, self.geometry.hidden))

    def apply_router_logits(
        self,
        hidden: torch.Tensor,
        router_logits: torch.Tensor,
        router: Router,
        weights: TrtllmWeights,
        workspace: Workspace,
    ) -> ExpertsOutput:
        """The in-kernel routing variant: ``hidden [M, H]`` unquantized, ``router_logits [M, E]``."""
        rows = hidden.shape[0]
        out = workspace["out"][:rows]
        if rows:
            x = quantize(hidden, self.problem.quant.activation, "activation")
            kwargs = self._kernel_kwargs(x, weights, workspace, out)
            routing = routing_arguments(router)
            dtype = torch.float32 if router.routing == "deepseek_v3" else torch.bfloat16
            entry = getattr(flashinfer_module(), f"{self.entry}_moe")
            entry(routing_logits=router_logits.to(dtype), **routing, **kwargs)
        return ExpertsOutput(OutputKind.REDUCED, layouts.unpad_view(out, self.geometry.hidden))

    def _kernel_kwargs(self, x: QuantizedTensor, w: TrtllmWeights, ws: Workspace, out: torch.Tensor) -> dict[str, Any]:
        """Every argument but the routing ones, for the routed and the from-logits entry point alike."""
        p, g = self.problem, self.geometry
        first, count = self.local_experts
        common = {
            "num_experts": p.num_experts, "top_k": p.top_k, "intermediate_size": g.inter_padded,
            "local_expert_offset": first, "local_num_experts": count, "output": out,
            "tune_max_num_tokens": self.tune_max_tokens, "activation_type": activation_type(p.activation),
        }
        data, scale = self._activations(x, ws)
        if self.entry == BF16:
            return {**common, "hidden_states": data, "gemm1_weights": w.w13, "gemm2_weights": w.w2,
                    "use_shuffled_weight": True, "weight_layout": _BLOCK_MAJOR_K, **w.activation_params}
        if self.entry == FP8_TENSOR:
            out1, gate, out2 = self._output_scales(x.scale, w, ws, "w13_scale", "w2_scale")
            return {**common, "hidden_states": data, "gemm1_weights": w.w13, "output1_scales_scalar": out1,
                    "output1_scales_gate_scalar": gate, "gemm2_weights": w.w2, "output2_scales_scalar": out2,
                    "use_routing_scales_on_input": False}
        weights = {"gemm1_weights": w.w13, "gemm1_weights_scale": w.w13_scale,
                   "gemm2_weights": w.w2, "gemm2_weights_scale": w.w2_scale}
        if self.entry == FP8_BLOCK:
            deepseek = self.pair[0] is F.FP8_BLOCK
            return {**common, **weights, "hidden_states": data, "hidden_states_scale": scale,
                    "use_shuffled_weight": not deepseek, "weight_layout": _MAJOR_K,
                    "fp8_quantization_type": self._fp8_type(_DEEPSEEK_FP8 if deepseek else _MX_FP8),
                    **w.activation_params}
        scales = (None, None, None)
        if self.pair[0] is F.NVFP4:
            scales = self._output_scales(x.global_scale, w, ws, "w13_global", "w2_global")
        return {**common, **weights, "hidden_states": data, "hidden_states_scale": scale,
                "gemm1_bias": w.b13, "gemm2_bias": w.b2, "output1_scale_scalar": scales[0],
                "output1_scale_gate_scalar": scales[1], "output2_scale_scalar": scales[2],
                **{name: w.activation_params.get(name) for name in ("gemm1_alpha", "gemm1_beta", "gemm1_clamp_limit")}}

    def _activations(self, x: QuantizedTensor, ws: Workspace) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden_states, hidden_states_scale) as the entry point takes them, padded to H'."""
        data, scale = x.data, x.scale if x.scale is not None and x.scale.dim() else None
        if self.geometry.hidden_padded != self.geometry.hidden:
            data = layouts.pad_into(ws["x"], data)
            if scale is not None:
                fill = layouts.E4M3_ONE if x.fmt is F.NVFP4 else layouts.E8M0_ONE
                scale = layouts.pad_into(ws["x_scale"], layouts.as_bytes(scale), fill).view(scale.dtype)
        if x.fmt is F.FP8_BLOCK:  # DeepSeek FP8 takes the 1x128 group scales transposed: [H/128, M]
            t = ws["x_scale_t"][: scale.numel()].view(scale.shape[1], scale.shape[0])
            scale = t.copy_(scale.t())
        elif scale is not None and self.entry == FP4:
            scale = scale.view(torch.float8_e4m3fn)  # mxfp8 e8m0 bytes typed e4m3, as the fp4 entry wants
        return data, scale

    def _output_scales(self, a1: torch.Tensor, w: TrtllmWeights, ws: Workspace, first: str, second: str):
        """Per-expert epilogue scales from the per-call activation scale ``a1`` (a dequant multiplier):
        gate = a1 * w13, out1 = gate / a2 (gated) or 1 / a2, out2 = a2 * w2, a2 the static intermediate scale."""
        a2 = self.intermediate_scale
        gate = torch.mul(w.per_expert[first], a1, out=ws["out1_gate"])
        out1 = torch.div(gate, a2, out=ws["out1"]) if self.problem.activation.is_gated else ws["out1"].fill_(1.0 / a2)
        out2 = torch.mul(w.per_expert[second], a2, out=ws["out2"])
        return out1, gate, out2

    def _fp8_type(self, value: int):
        return flashinfer_module("flashinfer.tllm_enums").Fp8QuantizationType(value)

    # --- warm-up -----------------------------------------------------------------------------
    def warmup(self, weights: TrtllmWeights, buckets: tuple[int, ...] | None = None) -> None:
        """Autotunes the kernels per token bucket (FlashInfer's autotuner), once, before serving."""
        device, rows, p = weights.w13.device, self.tune_max_tokens, self.problem
        x = torch.randn(rows, p.hidden_size, device=device).to(p.dtype)
        slots = torch.arange(rows * p.top_k, device=device).view(rows, p.top_k)
        ids = (self.local_experts[0] + slots % self.local_experts[1]).to(torch.int32)
        topk = TopK(ids, torch.full((rows, p.top_k), 1.0 / p.top_k, device=device))
        dispatched = Dispatched(ActivationFormat.STANDARD, quantize(x, p.quant.activation, "activation"), topk)
        workspace = WorkspaceManager(device).take(self.workspace_shapes(DispatchShape(ActivationFormat.STANDARD, rows)))
        with autotuning(tuple(b for b in buckets if b <= rows) if buckets else None):
            self.apply(dispatched, weights, workspace)
