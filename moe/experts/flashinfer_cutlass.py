"""``flashinfer_cutlass``: FlashInfer's CUTLASS fused MoE (``cutlass_fused_moe``), standard format.

One kernel call does routing-sort, both grouped GEMMs, the activation, the router-weighted sum over k
(output ``reduced``) and, for W4A16, the dequantization of the weights. Modes (``CUTLASS_MODES``;
the code of each scheme: ``_flashinfer/cutlass_modes.py``):

    scheme                  architectures          alignment (padded here)   notes
    bf16                    SM89-SM121             H, I % 8                  BF16 x BF16
    mxfp4 W4A16             SM90 exactly           H, I % 128                the main path (GPT-OSS)
    fp8 per tensor          SM89-SM121             H, I % 16                 activations quantized here
    fp8 128-block           SM90 exactly           H, I % 128 (not padded)   DeepSeek-style
    nvfp4                   SM100+                 H, I % 128                activation global scale per call
    mxfp4 x mxfp8           SM100+                 H, I % 128                activations quantized here

The backend takes unquantized activations (``quantizes_input``): the kernel quantizes them itself
(W4A16, fp8 block, nvfp4) or ``apply`` does, into the workspace (fp8 per tensor, mxfp8). The
intermediate activation of the fp8-per-tensor and nvfp4 schemes is quantized inside the kernel with a
*static* scale, ``intermediate_scale`` (a dequant multiplier, default 1.0): the reference quantizes it
dynamically, so pass a calibrated value for models whose intermediates are far from O(1).

Expert parallelism: the default even shards only (the kernel takes ep_size/ep_rank).

Tactics are tuned per token bucket by ``warmup`` (FlashInfer's autotuner), never on the hot path: a
bucket never tuned runs the library's default tactic, so ``warmup`` profiles the buckets FlashInfer maps a call's
M to (`tuning_buckets`). The prebuilt SM90 module of the lent GPU machine
holds the BF16 and W4A16 kernels only; the other schemes are tested up to the kernel call.
"""

from __future__ import annotations

import torch

from moe.experts._flashinfer import cutlass_modes as modes
from moe.experts._flashinfer import layouts
from moe.experts._flashinfer.base import (
    SM89_TO_SM121,
    SM90_ONLY,
    SM100_PLUS,
    FlashInferExperts,
    flashinfer_mode,
    power_of_two_at_least,
    synthetic_dispatch,
    tune_max_tokens,
)
from moe.experts._flashinfer.cutlass_modes import CutlassWeights
from moe.experts._flashinfer.layouts import Geometry
from moe.experts._flashinfer.library import activation_type, flashinfer_module, flashinfer_moe_features
from moe.experts._flashinfer.tactics import tuned_warmup
from moe.experts.base import Capabilities, ExpertLayout
from moe.formats import ActivationFormat, Dispatched, DispatchShape, ExpertsOutput, OutputKind
from moe.problem import MoEProblem
from moe.registry import register_experts
from moe.router import TopK
from moe.weights import ExpertWeights
from moe.workspace import Workspace, WorkspaceManager, WorkspaceShapes

_CALL = ("cutlass_fused_moe", "cutlass_fused_moe_workspace_size")


def _mode(kernel: str, archs, align: int, strategy: modes.CutlassScheme, *, pads: bool = True, bias: bool = True,
          features: tuple[str, ...] = _CALL):
    return flashinfer_mode(f"cutlass_fused_moe ({kernel})", archs, h_align=align, i_align=align, pads=pads,
                           bias=bias, features=features, strategy=strategy)


CUTLASS_MODES = {
    "unquantized": _mode("bf16", SM89_TO_SM121, 8, modes.CutlassScheme()),
    "mxfp4": _mode("W4A16 mxfp4", SM90_ONLY, 128, modes.W4A16(), features=_CALL + ("sm90_mixed_gemm_interleave",)),
    "fp8": _mode("fp8 per tensor", SM89_TO_SM121, 16, modes.Fp8PerTensor()),
    "fp8_block": _mode("fp8 128x128 block", SM90_ONLY, 128, modes.Fp8Block(), pads=False, bias=False),
    "nvfp4": _mode("nvfp4", SM100_PLUS, 128, modes.Nvfp4()),
    "mxfp4_a_mxfp8": _mode("mxfp8 x mxfp4", SM100_PLUS, 128, modes.Mxfp4Mxfp8()),
}


def tuning_buckets(tune_max: int, requested: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The token counts ``warmup`` profiles so that every M the kernel is later called with finds a tactic.

    `cutlass_fused_moe` maps a call's M to one bucket (FlashInfer 0.7's ``map_to_hybrid_bucket``: powers of two to
    256, then steps of 256 to 2048 and of 512 to 4096, powers of two beyond, at most ``tune_max``, its
    ``tune_max_num_tokens``) and looks up that bucket's profile only. A profile taken at any other M is never found,
    and the call runs the default tactic: on an H200 GPT-OSS-120B bf16 at M = 9, profiled at 9 and looked up at
    16, took 2847.7 us against 371.1 at M = 8 (benchmarks/results/issue14_s36_scoreboard_nvidia-h200.md). So
    ``requested`` M (those above ``tune_max`` dropped) are profiled at their buckets, and by default every bucket
    up to ``tune_max`` (``get_hybrid_num_tokens_buckets``). A FlashInfer without those helpers buckets by powers
    of two."""
    try:
        from flashinfer.fused_moe.utils import get_hybrid_num_tokens_buckets, map_to_hybrid_bucket
    except ImportError:  # an older FlashInfer: power-of-two buckets
        def map_to_hybrid_bucket(m: int, top: int) -> int:
            return min(power_of_two_at_least(m), top)

        def get_hybrid_num_tokens_buckets(top: int) -> tuple[int, ...]:
            return tuple(1 << i for i in range(top.bit_length()) if 1 << i <= top)
    if requested:
        mapped = sorted({map_to_hybrid_bucket(m, tune_max) for m in requested if m <= tune_max})
        return tuple(mapped) or (tune_max,)
    return tuple(get_hybrid_num_tokens_buckets(tune_max))


@register_experts
class FlashInferCutlassExperts(FlashInferExperts):
    name = "flashinfer_cutlass"
    prepared_type = CutlassWeights
    capabilities = Capabilities(
        formats=frozenset({ActivationFormat.STANDARD}),
        modes=CUTLASS_MODES,
        output=OutputKind.REDUCED,
        devices=frozenset({"cuda"}),
        libraries=("flashinfer",),
        expert_layout=ExpertLayout.EVEN_SHARDS,  # it takes ep_size/ep_rank
        cuda_graph_safe=True,
        deterministic=False,  # the fused finalize sums over k with atomics
        quantizes_input=True,
    )

    def __init__(self, problem, *, intermediate_scale: float = 1.0):
        super().__init__(problem, intermediate_scale=intermediate_scale)
        self._scratch_bytes: dict[int, int] = {}  # library scratch per token bucket, asked once each

    def prepare_weights(self, weights: ExpertWeights) -> CutlassWeights:
        weights.validate(self.problem)
        return self.strategy.prepare(self, weights)

    # --- workspace ---------------------------------------------------------------------------
    @classmethod
    def base_buffers(cls, problem: MoEProblem, g: Geometry, rows: int) -> dict:
        buffers = {"out": ((rows, g.hidden_padded), problem.dtype)}
        if g.hidden_padded != g.hidden:
            buffers["x"] = ((rows, g.hidden_padded), problem.dtype)
        return buffers

    @classmethod
    def scratch_bytes(cls, problem: MoEProblem, g: Geometry, rows: int) -> int:
        return cls._estimate(problem, g, _scratch_bucket(problem, rows))

    def workspace_shapes(self, dispatch: DispatchShape) -> WorkspaceShapes:
        # on the GPU this pair runs on, the library's own scratch size replaces the estimate
        rows = dispatch.max_rows
        return self.mode_workspace(self.problem, self.geometry, rows, self._library_scratch_bytes(rows))

    def _library_scratch_bytes(self, rows: int) -> int:
        """cutlass_fused_moe's own scratch for up to ``rows`` tokens, asked per power-of-two bucket."""
        bucket = _scratch_bucket(self.problem, rows)
        if bucket not in self._scratch_bytes:
            if self._library_can_answer():
                self._scratch_bytes[bucket] = self._ask_library(bucket)
            else:
                self._scratch_bytes[bucket] = self._estimate(self.problem, self.geometry, bucket)
        return self._scratch_bytes[bucket]

    def _library_can_answer(self) -> bool:
        """FlashInfer sizes its scratch with the module of the current GPU: ask it only where this scheme
        runs on that GPU (elsewhere, e.g. when the oracle sizes a simulated platform, estimate)."""
        if not torch.cuda.is_available() or "cutlass_fused_moe_workspace_size" not in flashinfer_moe_features():
            return False
        major, minor = torch.cuda.get_device_capability()
        return major * 10 + minor in self.mode.archs

    def _ask_library(self, rows: int) -> int:
        p, g = self.problem, self.geometry
        x_dtype, w_dtype, ep = self.strategy.x_dtype, self.strategy.w_dtype, p.parallel
        return flashinfer_module().cutlass_fused_moe_workspace_size(
            max(rows, 1), g.hidden_padded, g.inter_padded, p.local_num_experts * ep.ep_size, p.top_k,
            x_dtype=x_dtype or p.dtype, weight_dtype=w_dtype or p.dtype, output_dtype=p.dtype,
            activation_type=self._activation_type(), ep_size=ep.ep_size, ep_rank=ep.ep_rank,
            **self.strategy.flags,
        )

    @staticmethod
    def _estimate(p: MoEProblem, g: Geometry, rows: int) -> int:
        """An upper-bound guess where the library cannot be asked (no GPU): permuted input, both GEMM
        outputs in fp32 and the routing maps, per (token, slot), plus 32 MiB of GEMM workspace."""
        per_slot = 4 * (2 * g.hidden_padded + p.w13_rows * 2 + g.inter_padded) + 64
        return rows * p.top_k * per_slot + 16 * p.local_num_experts * rows + (32 << 20)

    # --- forward -----------------------------------------------------------------------------
    def apply(self, dispatched: Dispatched, weights: CutlassWeights, workspace: Workspace) -> ExpertsOutput:
        g, x = self.geometry, dispatched.x.data
        rows = x.shape[0]
        out = workspace["out"][:rows]
        if rows:
            if g.hidden_padded != g.hidden:
                x = layouts.pad_into(workspace["x"], x)
            x, input_sf, quant_scales = self.strategy.inputs(self, x, weights, workspace)
            self._call(x, dispatched.topk, weights, quant_scales, input_sf, out, workspace["library"])
        return ExpertsOutput(OutputKind.REDUCED, layouts.unpad_view(out, g.hidden))

    def _call(self, x, topk: TopK, w: CutlassWeights, quant_scales, input_sf, out, scratch) -> None:
        p, ep = self.problem, self.problem.parallel
        flashinfer_module().cutlass_fused_moe(
            input=x, token_selected_experts=topk.ids.contiguous(), token_final_scales=topk.weights.contiguous(),
            fc1_expert_weights=w.w13, fc2_expert_weights=w.w2, output_dtype=p.dtype, quant_scales=list(quant_scales),
            fc1_expert_biases=w.b13, fc2_expert_biases=w.b2, input_sf=input_sf, ep_size=ep.ep_size, ep_rank=ep.ep_rank,
            output=out, tune_max_num_tokens=self.tune_max_tokens, activation_type=self._activation_type(),
            swizzled_input_sf=False, workspace_buffer=scratch, **self.strategy.flags, **w.activation_params,
        )

    def _activation_type(self):
        return flashinfer_module("flashinfer.tllm_enums").ActivationType(activation_type(self.problem.activation))

    # --- warm-up -----------------------------------------------------------------------------
    def warmup(self, weights: CutlassWeights, buckets: tuple[int, ...] | None = None) -> None:
        """Autotunes the GEMM tactics for every token bucket up to ``max_tokens`` (or the buckets of the M in
        ``buckets``: `tuning_buckets`).

        Run once after ``prepare_weights`` and before serving or CUDA-graph capture; the hot path then
        only looks the tactic of its bucket up. The tactics come from the tuning cache when it has them
        (``moe.cache``; `tactics.tuned_warmup`).
        """
        device = weights.w13.device
        rows = self.tune_max_tokens
        buckets = tuning_buckets(rows, buckets)
        dispatched = synthetic_dispatch(self.problem, rows, device)
        workspace = WorkspaceManager(device).take(self.workspace_shapes(DispatchShape(ActivationFormat.STANDARD, rows)))
        tuned_warmup(self, buckets, device, lambda: self.apply(dispatched, weights, workspace))



def _scratch_bucket(problem: MoEProblem, rows: int) -> int:
    """The power-of-two token bucket whose scratch serves ``rows`` rows (at most the tuned maximum)."""
    return min(power_of_two_at_least(rows), max(tune_max_tokens(problem), rows))
