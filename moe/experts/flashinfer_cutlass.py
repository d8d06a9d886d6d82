"""``flashinfer_cutlass``: FlashInfer's CUTLASS fused MoE (``cutlass_fused_moe``), standard format.

One kernel call does routing-sort, both grouped GEMMs, the activation, the router-weighted sum over k
(output ``reduced``) and, for W4A16, the dequantization of the weights. Format pairs (``CUTLASS_MODES``):

    pair                    architectures          alignment (padded here)   notes
    bf16                    SM89-SM121             H, I % 8                  BF16 x BF16
    mxfp4 W4A16             SM90 exactly           H, I % 128                the main path (GPT-OSS)
    fp8 per tensor          SM89-SM121             H, I % 16                 activations quantized here
    fp8 128-block           SM90 exactly           H, I % 128 (not padded)   DeepSeek-style
    nvfp4                   SM100+                 H, I % 128                activation global scale per call
    mxfp4 x mxfp8           SM100+                 H, I % 128                activations quantized here

The backend takes unquantized activations (``quantizes_input``): the kernel quantizes them itself
(W4A16, fp8 block, nvfp4) or ``apply`` does, into the workspace (fp8 per tensor, mxfp8). The
intermediate activation of the fp8-per-tensor and nvfp4 pairs is quantized inside the kernel with a
*static* scale, ``intermediate_scale`` (a dequant multiplier, default 1.0): the reference quantizes it
dynamically, so pass a calibrated value for models whose intermediates are far from O(1).

Tactics are tuned per token bucket by ``warmup`` (FlashInfer's autotuner), never on the hot path: a
bucket never tuned runs the library's default tactic. The prebuilt SM90 module of the lent GPU machine
holds the BF16 and W4A16 kernels only; the other pairs are tested up to the kernel call.
"""

from __future__ import annotations

import dataclasses

import torch

from moe.experts._flashinfer import layouts
from moe.experts._flashinfer.cutlass_weights import CutlassWeights, Geometry, prepare_cutlass
from moe.experts._flashinfer.library import activation_type, autotuning, flashinfer_module, flashinfer_moe_features
from moe.experts._flashinfer.modes import (
    ALL_ACTIVATIONS,
    SM89_TO_SM121,
    SM90_ONLY,
    SM100_PLUS,
    ModeSpec,
    expert_map_reasons,
    mode_reasons,
)
from moe.experts.base import Capabilities, Experts
from moe.formats import ActivationFormat, Dispatched, DispatchShape, ExpertsOutput, OutputKind
from moe.platform import Platform
from moe.problem import MoEProblem
from moe.quant import QuantFormat, QuantizedTensor, quantize
from moe.registry import register_experts
from moe.router import TopK
from moe.weights import ExpertWeights
from moe.workspace import Workspace, WorkspaceManager, WorkspaceShapes

F = QuantFormat
_CALL = ("cutlass_fused_moe", "cutlass_fused_moe_workspace_size")


def _mode(kernel: str, archs: frozenset[int], align: int, *, pads: bool = True, bias: bool = True,
          features: tuple[str, ...] = _CALL) -> ModeSpec:
    return ModeSpec(kernel=f"cutlass_fused_moe ({kernel})", archs=archs, activations=ALL_ACTIVATIONS,
                    h_align=align, i_align=align, pads=pads, bias=bias, features=features)


CUTLASS_MODES = {
    (F.NONE, F.NONE): _mode("bf16", SM89_TO_SM121, 8),
    (F.MXFP4, F.NONE): _mode("W4A16 mxfp4", SM90_ONLY, 128, features=_CALL + ("sm90_mixed_gemm_interleave",)),
    (F.FP8_TENSOR, F.FP8_TENSOR): _mode("fp8 per tensor", SM89_TO_SM121, 16),
    (F.FP8_BLOCK, F.FP8_BLOCK): _mode("fp8 128x128 block", SM90_ONLY, 128, pads=False, bias=False),
    (F.NVFP4, F.NVFP4): _mode("nvfp4", SM100_PLUS, 128),
    (F.MXFP4, F.MXFP8): _mode("mxfp8 x mxfp4", SM100_PLUS, 128),
}

# cutlass_fused_moe flags and (activation dtype it is given, weight dtype) per pair; None: problem.dtype
_FLAGS = {
    (F.MXFP4, F.NONE): {"use_w4_group_scaling": True},
    (F.FP8_BLOCK, F.FP8_BLOCK): {"use_deepseek_fp8_block_scale": True},
    (F.MXFP4, F.MXFP8): {"use_mxfp8_act_scaling": True},
}
_DTYPES = {
    (F.NONE, F.NONE): (None, None),
    (F.MXFP4, F.NONE): (None, torch.uint8),
    (F.FP8_TENSOR, F.FP8_TENSOR): (torch.float8_e4m3fn, torch.float8_e4m3fn),
    (F.FP8_BLOCK, F.FP8_BLOCK): (None, torch.float8_e4m3fn),
    (F.NVFP4, F.NVFP4): (None, torch.int64),
    (F.MXFP4, F.MXFP8): (torch.float8_e4m3fn, torch.int64),
}
_E4M3_MAX, _NVFP4_GLOBAL_RANGE = 448.0, 448.0 * 6.0
DEFAULT_TUNING_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


@register_experts
class FlashInferCutlassExperts(Experts):
    name = "flashinfer_cutlass"
    prepared_type = CutlassWeights
    capabilities = Capabilities(
        formats=frozenset({ActivationFormat.STANDARD}),
        quant=frozenset(CUTLASS_MODES),
        activations=ALL_ACTIVATIONS,
        output=OutputKind.REDUCED,
        dtypes=frozenset({torch.bfloat16}),
        devices=frozenset({"cuda"}),
        min_capability=(8, 9),
        max_capability=(12, 1),
        libraries=("flashinfer",),
        alignment={"hidden_size": 128, "intermediate_size": 128},  # the strictest pair; see CUTLASS_MODES
        pads_to_alignment=True,  # every pair but fp8 128-block pads; that one is checked in extra_checks
        cuda_graph_safe=True,
        deterministic=False,  # the fused finalize sums over k with atomics
        quantizes_input=True,
    )

    def __init__(self, problem: MoEProblem, *, intermediate_scale: float = 1.0):
        super().__init__(problem)
        self.pair = (problem.quant.weight, problem.quant.activation)
        self.mode = CUTLASS_MODES[self.pair]
        self.geometry = Geometry.of(problem, self.mode.padded_sizes(problem))
        self.intermediate_scale = float(intermediate_scale)
        self.tune_max_tokens = 1 << max(problem.max_tokens - 1, 0).bit_length()
        self._scratch_bytes: dict[int, int] = {}  # library scratch per token bucket, asked once each

    @classmethod
    def extra_checks(cls, problem: MoEProblem, platform: Platform | None) -> list[str]:
        return mode_reasons(CUTLASS_MODES, problem, platform) + expert_map_reasons(problem, ep_size_rank=True)

    def prepare_weights(self, weights: ExpertWeights) -> CutlassWeights:
        weights.validate(self.problem)
        prepared = prepare_cutlass(weights, self.problem, self.geometry)
        if self.pair in ((F.FP8_TENSOR, F.FP8_TENSOR), (F.NVFP4, F.NVFP4)):
            # the static intermediate scale as FlashInfer's quant multiplier, made once here
            shape = () if self.pair[0] is F.FP8_TENSOR else (1,)
            quant = torch.full(shape, 1.0 / self.intermediate_scale, dtype=torch.float32, device=weights.device)
            prepared = dataclasses.replace(prepared, per_expert={**prepared.per_expert, "fc2_act_quant": quant})
        return prepared

    # --- workspace ---------------------------------------------------------------------------
    @classmethod
    def declared_workspace(cls, problem: MoEProblem, dispatch: DispatchShape) -> WorkspaceShapes:
        rows = dispatch.max_rows
        return cls._buffers(problem, rows, cls._estimate(problem, _scratch_bucket(problem, rows)))

    def workspace_shapes(self, dispatch: DispatchShape) -> WorkspaceShapes:
        # on the GPU this pair runs on, the library's own scratch size replaces the estimate
        rows = dispatch.max_rows
        return self._buffers(self.problem, rows, self._library_scratch_bytes(rows))

    @staticmethod
    def _buffers(p: MoEProblem, rows: int, scratch_bytes: int) -> WorkspaceShapes:
        g, pair = _geometry(p), (p.quant.weight, p.quant.activation)
        buffers = {"out": ((rows, g.hidden_padded), p.dtype)}
        if g.hidden_padded != g.hidden:
            buffers["x"] = ((rows, g.hidden_padded), p.dtype)
        if pair == (F.FP8_TENSOR, F.FP8_TENSOR):
            buffers["x_q"] = ((rows, g.hidden_padded), torch.float8_e4m3fn)
        if pair in ((F.FP8_TENSOR, F.FP8_TENSOR), (F.NVFP4, F.NVFP4)):
            buffers["act_scale"] = ((1,), torch.float32)
            buffers["fc1_dequant"] = ((p.local_num_experts,), torch.float32)
            buffers["fc2_dequant"] = ((p.local_num_experts,), torch.float32)
        buffers["library"] = ((scratch_bytes,), torch.uint8)
        return WorkspaceShapes.of(**buffers)

    def _library_scratch_bytes(self, rows: int) -> int:
        """cutlass_fused_moe's own scratch for up to ``rows`` tokens, asked per power-of-two bucket."""
        bucket = _scratch_bucket(self.problem, rows)
        if bucket not in self._scratch_bytes:
            can_ask = self._library_can_answer()
            self._scratch_bytes[bucket] = self._ask_library(bucket) if can_ask else self._estimate(self.problem, bucket)
        return self._scratch_bytes[bucket]

    def _library_can_answer(self) -> bool:
        """FlashInfer sizes its scratch with the module of the current GPU: ask it only where this pair
        runs on that GPU (elsewhere, e.g. when the oracle sizes a simulated platform, estimate)."""
        if not torch.cuda.is_available() or "cutlass_fused_moe_workspace_size" not in flashinfer_moe_features():
            return False
        major, minor = torch.cuda.get_device_capability()
        return major * 10 + minor in self.mode.archs

    def _ask_library(self, rows: int) -> int:
        p, g = self.problem, self.geometry
        x_dtype, w_dtype = _DTYPES[self.pair]
        ep = p.parallel
        return flashinfer_module().cutlass_fused_moe_workspace_size(
            max(rows, 1), g.hidden_padded, g.inter_padded, p.local_num_experts * ep.ep_size, p.top_k,
            x_dtype=x_dtype or p.dtype, weight_dtype=w_dtype or p.dtype, output_dtype=p.dtype,
            activation_type=self._activation_type(), ep_size=ep.ep_size, ep_rank=ep.ep_rank,
            **_FLAGS.get(self.pair, {}),
        )

    @staticmethod
    def _estimate(p: MoEProblem, rows: int) -> int:
        """An upper-bound guess where the library cannot be asked (no GPU): permuted input, both GEMM
        outputs in fp32 and the routing maps, per (token, slot), plus 32 MiB of GEMM workspace."""
        g = _geometry(p)
        per_slot = 4 * (2 * g.hidden_padded + p.w13_rows * 2 + g.inter_padded) + 64
        return rows * p.top_k * per_slot + 16 * p.local_num_experts * rows + (32 << 20)

    # --- forward -----------------------------------------------------------------------------
    def apply(self, dispatched: Dispatched, weights: CutlassWeights, workspace: Workspace) -> ExpertsOutput:
        p, g = self.problem, self.geometry
        x = dispatched.x.data
        rows = x.shape[0]
        out = workspace["out"][:rows]
        if rows:
            if g.hidden_padded != g.hidden:
                x = layouts.pad_into(workspace["x"], x)
            x, input_sf, quant_scales = self._kernel_inputs(x, weights, workspace)
            self._call(x, dispatched.topk, weights, quant_scales, input_sf, out, workspace["library"])
        return ExpertsOutput(OutputKind.REDUCED, layouts.unpad_view(out, g.hidden))

    def _call(self, x, topk: TopK, w: CutlassWeights, quant_scales, input_sf, out, scratch) -> None:
        p, ep = self.problem, self.problem.parallel
        flashinfer_module().cutlass_fused_moe(
            input=x, token_selected_experts=topk.ids.contiguous(), token_final_scales=topk.weights.contiguous(),
            fc1_expert_weights=w.w13, fc2_expert_weights=w.w2, output_dtype=p.dtype, quant_scales=list(quant_scales),
            fc1_expert_biases=w.b13, fc2_expert_biases=w.b2, input_sf=input_sf, ep_size=ep.ep_size, ep_rank=ep.ep_rank,
            output=out, tune_max_num_tokens=self.tune_max_tokens, activation_type=self._activation_type(),
            swizzled_input_sf=False, workspace_buffer=scratch, **_FLAGS.get(self.pair, {}), **w.activation_params,
        )

    def _activation_type(self):
        return flashinfer_module("flashinfer.tllm_enums").ActivationType(activation_type(self.problem.activation))

    def _kernel_inputs(self, x: torch.Tensor, w: CutlassWeights, ws: Workspace):
        """(input, input_sf, quant_scales) for this pair; quantizes activations where the kernel does not."""
        if self.pair == (F.FP8_TENSOR, F.FP8_TENSOR):
            a1 = torch.div(x.abs().amax().float().clamp(min=1e-12), _E4M3_MAX, out=ws["act_scale"][0])
            xq = ws["x_q"][: x.shape[0]]
            xq.copy_((x.float() / a1).clamp(-_E4M3_MAX, _E4M3_MAX))
            a2 = self.intermediate_scale
            scales = (torch.mul(w.per_expert["w13_scale"], a1, out=ws["fc1_dequant"]), w.per_expert["fc2_act_quant"],
                      torch.mul(w.per_expert["w2_scale"], a2, out=ws["fc2_dequant"]), a1)
            return xq, None, scales
        if self.pair == (F.NVFP4, F.NVFP4):
            amax = x.abs().amax().float().clamp(min=1e-12)
            a1_global = torch.div(_NVFP4_GLOBAL_RANGE, amax, out=ws["act_scale"][0])  # FlashInfer's quant multiplier
            a2 = self.intermediate_scale
            fc1 = torch.div(w.per_expert["w13_global"], a1_global, out=ws["fc1_dequant"])
            fc2 = torch.mul(w.per_expert["w2_global"], a2, out=ws["fc2_dequant"])
            s13, s2 = w.quant_scales
            return x, None, (a1_global, s13, fc1, w.per_expert["fc2_act_quant"], s2, fc2)
        if self.pair == (F.MXFP4, F.MXFP8):
            q = quantize(x, F.MXFP8, "activation")
            return q.data, q.scale, w.quant_scales
        return x, None, w.quant_scales

    # --- warm-up -----------------------------------------------------------------------------
    def warmup(self, weights: CutlassWeights, buckets: tuple[int, ...] | None = None) -> None:
        """Autotunes the GEMM tactics for every token bucket up to ``max_tokens`` (or ``buckets``).

        Run once after ``prepare_weights`` and before serving or CUDA-graph capture; the hot path then
        only looks the tactic of its bucket up.
        """
        device = weights.w13.device
        rows = self.tune_max_tokens
        buckets = tuple(b for b in (buckets or DEFAULT_TUNING_BUCKETS) if b <= rows) or (rows,)
        dispatched = synthetic_dispatch(self.problem, rows, device)
        workspace = WorkspaceManager(device).take(self.workspace_shapes(DispatchShape(ActivationFormat.STANDARD, rows)))
        with autotuning(buckets):
            self.apply(dispatched, weights, workspace)


def _geometry(problem: MoEProblem) -> Geometry:
    return Geometry.of(problem, CUTLASS_MODES[(problem.quant.weight, problem.quant.activation)].padded_sizes(problem))


def _scratch_bucket(problem: MoEProblem, rows: int) -> int:
    """The power-of-two token bucket whose scratch serves ``rows`` rows (at most the tuned maximum)."""
    tune_max_tokens = 1 << max(problem.max_tokens - 1, 0).bit_length()
    return min(1 << max(rows - 1, 0).bit_length(), max(tune_max_tokens, rows))


def synthetic_dispatch(problem: MoEProblem, rows: int, device: torch.device) -> Dispatched:
    """``rows`` random tokens routed round-robin over the local experts (for warm-up and benchmarks)."""
    x = torch.randn(rows, problem.hidden_size, device=device).to(problem.dtype)
    first = problem.parallel.global_to_local(problem.num_experts).index(0)
    slots = torch.arange(rows * problem.top_k, device=device).view(rows, problem.top_k)
    ids = (first + slots % problem.local_num_experts).to(torch.int32)
    weights = torch.full((rows, problem.top_k), 1.0 / problem.top_k, device=device)
    x_q = QuantizedTensor(data=x, scale=None, fmt=F.NONE)
    return Dispatched(ActivationFormat.STANDARD, x_q, TopK(ids, weights))
