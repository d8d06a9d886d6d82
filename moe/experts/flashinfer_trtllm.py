"""``flashinfer_trtllm``: FlashInfer's trtllm-gen fused MoE kernels (SM100/SM103), standard format.

One kernel call does routing-sort, both GEMMs with the activation fused, and the router-weighted sum
over k (output ``reduced``, always bf16). Modes (``TRTLLM_MODES``; the code of each scheme:
``_flashinfer/trtllm_modes.py``):

    scheme           entry point                                  activations                 bias
    bf16             trtllm_bf16_routed_moe                       silu, swiglu_oai, relu2     no
    fp8 per tensor   trtllm_fp8_per_tensor_scale_routed_moe       silu, relu2                 no
    fp8 128-block    trtllm_fp8_block_scale_routed_moe (DeepSeek) silu, swiglu_oai            no
    mxfp8            trtllm_fp8_block_scale_routed_moe (MxFp8)    all four                    no
    nvfp4            trtllm_fp4_block_scale_routed_moe            all four                    yes
    mxfp4 (W4A16)    trtllm_fp4_block_scale_routed_moe            silu, swiglu_oai            yes
    mxfp4 x mxfp8    trtllm_fp4_block_scale_routed_moe            all four                    yes

I is padded to 16 (gated) / 128 (non-gated) -- 64/128 for bf16 (BlockMajorK) and nvfp4, 128 for the
mx formats -- and H to 128; fp8 128-block is not padded. Activations arrive quantized by prepare
(``quantizes_input`` is False). Expert parallelism: this rank's experts as one block (an offset + count).

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
from moe.experts._flashinfer import trtllm_modes as modes
from moe.experts._flashinfer.base import SM100_FAMILY, FlashInferExperts, flashinfer_mode, synthetic_dispatch
from moe.experts._flashinfer.layouts import Geometry
from moe.experts._flashinfer.library import activation_type, flashinfer_module
from moe.experts._flashinfer.tactics import tuned_warmup
from moe.experts._flashinfer.trtllm_modes import TrtllmWeights
from moe.experts.base import Capabilities, ExpertLayout
from moe.formats import ActivationFormat, Dispatched, DispatchShape, ExpertsOutput, OutputKind
from moe.problem import MoEProblem
from moe.quant import QuantFormat, QuantizedTensor, quantize, row_layout
from moe.registry import register_experts
from moe.router import Router
from moe.weights import ExpertWeights
from moe.workspace import Workspace, WorkspaceManager, WorkspaceShapes

F = QuantFormat
ALL = frozenset(A)


def _mode(strategy: modes.TrtllmScheme, activations, i_align: int, *, pads: bool = True, bias: bool = False):
    entry = strategy.entry
    return flashinfer_mode(f"{entry}_routed_moe", SM100_FAMILY, activations, h_align=128, i_align=i_align,
                           i_align_nongated=128, pads=pads, bias=bias,
                           features=(f"{entry}_routed_moe", f"{entry}_moe"), strategy=strategy)


TRTLLM_MODES = {
    # BF16: BlockMajorK blocks 128 bytes of each row, so I (the second GEMM's K) pads to 64, not 16
    "unquantized": _mode(modes.Bf16(), {A.SILU, A.SWIGLU_OAI, A.RELU2}, 64),
    "fp8": _mode(modes.Fp8PerTensor(), {A.SILU, A.RELU2}, 16),
    "fp8_block": _mode(modes.Fp8Block(), {A.SILU, A.SWIGLU_OAI}, 128, pads=False),
    "mxfp8": _mode(modes.Mxfp8(), ALL, 128),
    "nvfp4": _mode(modes.Nvfp4(), ALL, 64, bias=True),
    "mxfp4": _mode(modes.Fp4(), {A.SILU, A.SWIGLU_OAI}, 128, bias=True),
    "mxfp4_a_mxfp8": _mode(modes.Fp4(), ALL, 128, bias=True),
}
# routing name -> trtllm-gen RoutingMethodType (flashinfer/tllm_enums.py) when routing in the kernel
ROUTES_FROM_LOGITS = {"softmax": (4, 0), "gpt_oss": (1, 1), "deepseek_v3": (2, 2)}  # (renormalized, plain)


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
class FlashInferTrtllmExperts(FlashInferExperts):
    name = "flashinfer_trtllm"
    prepared_type = TrtllmWeights
    capabilities = Capabilities(
        formats=frozenset({ActivationFormat.STANDARD}),
        modes=TRTLLM_MODES,
        output=OutputKind.REDUCED,
        devices=frozenset({"cuda"}),
        libraries=("flashinfer",),
        expert_layout=ExpertLayout.BLOCK,
        cuda_graph_safe=True,
        deterministic=False,
        routes_from_logits=frozenset(ROUTES_FROM_LOGITS),
    )

    @property
    def entry(self) -> str:
        """The entry-point family of this problem's scheme: ``{entry}_routed_moe`` / ``{entry}_moe``."""
        return self.strategy.entry

    def prepare_weights(self, weights: ExpertWeights) -> TrtllmWeights:
        weights.validate(self.problem)
        return self.strategy.prepare(self, weights)

    # --- workspace ---------------------------------------------------------------------------
    @classmethod
    def base_buffers(cls, problem: MoEProblem, g: Geometry, rows: int) -> dict:
        row = row_layout(problem.quant.activation, g.hidden_padded, torch.float32)
        buffers = {"out": ((rows, g.hidden_padded), torch.bfloat16), "topk": ((rows, problem.top_k), torch.int32)}
        if g.hidden_padded != g.hidden:
            buffers["x"] = ((rows, row.data_columns), row.data_dtype)
            if row.scale_columns:
                buffers["x_scale"] = ((rows, row.scale_columns), row.scale_dtype)
        return buffers

    @classmethod
    def scratch_bytes(cls, p: MoEProblem, g: Geometry, rows: int) -> int:
        """trtllm-gen allocates its routing buffers and GEMM intermediates itself; this accounts for them
        (an estimate: permuted input, first-GEMM output and activation per (token, slot), padded tiles)."""
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
            if self.entry != modes.BF16:
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
        return {**common, **self.strategy.kernel_args(self, x, data, scale, w, ws)}

    def _activations(self, x: QuantizedTensor, ws: Workspace) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden_states, hidden_states_scale) as the entry point takes them, padded to H'."""
        data, scale = x.data, x.scale if x.scale is not None and x.scale.dim() else None
        if self.geometry.hidden_padded != self.geometry.hidden:
            data = layouts.pad_into(ws["x"], data)
            if scale is not None:
                fill = layouts.E4M3_ONE if x.fmt is F.NVFP4 else layouts.E8M0_ONE
                scale = layouts.pad_into(ws["x_scale"], layouts.as_bytes(scale), fill).view(scale.dtype)
        return data, self.strategy.kernel_scale(scale, ws)

    def fp8_type(self, value: int):
        """FlashInfer's ``Fp8QuantizationType`` member of ``value``."""
        return flashinfer_module("flashinfer.tllm_enums").Fp8QuantizationType(value)

    # --- warm-up -----------------------------------------------------------------------------
    def warmup(self, weights: TrtllmWeights, buckets: tuple[int, ...] | None = None) -> None:
        """Autotunes the kernels per token bucket (FlashInfer's autotuner), once, before serving; the
        tactics come from the tuning cache when it has them (``moe.cache``; `tactics.tuned_warmup`)."""
        device, rows = weights.w13.device, self.tune_max_tokens
        dispatched = synthetic_dispatch(self.problem, rows, device, self.problem.quant.activation)
        workspace = WorkspaceManager(device).take(self.workspace_shapes(DispatchShape(ActivationFormat.STANDARD, rows)))
        buckets = tuple(b for b in buckets if b <= rows) if buckets else None
        tuned_warmup(self, buckets or None, device, lambda: self.apply(dispatched, weights, workspace))
