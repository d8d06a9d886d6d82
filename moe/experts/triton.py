"""``triton``: fused MoE experts in Triton for the standard format (rows ``[M, H]`` + top-k ids).

One forward, all on the GPU, no host sync, CUDA-graph capturable (shapes depend on M only)::

    (M * k <= 256 with MXFP4 or NVFP4 weights x unquantized activations, or fp8_block / fp8_token
    W8A8: all of this in `_triton/decode.py` instead, split-K over all SMs, each expert's weights read
    once per forward; fp8 activations quantized inside its GEMMs, no quantize launches)
    align      topk ids -> rows sorted by local expert, padded to BLOCK_M     (_triton/align.py)
               (decode configs skip it: one program per slot, "direct")
    quantize   x -> fp8 when the scheme quantizes activations                 (_triton/rows.py)
    gemm1      inter[slot] = act(x[token] @ w13[e].T + b13[e])  (gate/up fused) (_triton/gemm.py)
    quantize   inter -> fp8 (same activation format)
    gemm2      y[slot] = inter[slot] @ w2[e].T + b2[e]
    combine    out[token] = sum_j topk_weights[token, j] * y[token*k + j]     (_triton/rows.py)

    (tma_a tiles gather the rows into sorted order first, _triton/gemm_tma_a.py; fp8_block wgmma tiles
    too, with their scales, and run both GEMMs as a Gluon kernel, _triton/gemm_wgmma.py)

Schemes: bf16/fp16/fp32, fp8 e4m3 W8A8 per tensor / per token+channel / 128-block, and MXFP4
weights with unquantized activations (W4A16, dequantized tile by tile inside the GEMM). Weight-only
(`support.STANDARD_MODES`): NVFP4 weights with unquantized activations everywhere (the same
in-register dequantization as MXFP4, e4m3 block scales and a global scale per expert), MXFP8 weights
everywhere (e4m3 decoded and scaled by its e8m0 byte per 32 in registers), W4A8 MXFP4 everywhere (as W4A16),
and fp8 weights with unquantized activations on GPUs without fp8 tensor cores (A100: e4m3 decoded to bf16
in registers, then the bf16 dot); activations are then never quantized, so the intermediate is not
rounded to fp8.
Launch configs come from tuned tables (``python -m moe tune``) or a default (`_triton/config.py`).
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from moe.errors import MoEConfigError, SlowPathWarning
from moe.experts._triton import cdiv
from moe.experts._triton.align import align_block_size
from moe.experts._triton.align import workspace_buffers as align_buffers
from moe.experts._triton.config import BLOCK_MS, ConfigTable
from moe.experts._triton.decode import FP8_DECODE_FORMATS, decode_config, decode_experts, decodes, uses_decode
from moe.experts._triton.decode import decode_tickets, fp8_decode_config, make_descriptors
from moe.experts._triton.decode import workspace_buffers as decode_buffers
from moe.experts._triton.gemm import DirectRows, SortedRows, grouped_gemm
from moe.experts._triton.gemm_tma_a import sorted_tma_a_gemms, workspace_rows
from moe.experts._triton.gemm_wgmma import sorted_wgmma_gemms
from moe.experts._triton.rows import GROUP, RowValidity, combine_slots_kernel
from moe.experts._triton.support import (
    COMMON_CAPABILITIES,
    STANDARD_MODES,
    activation_format,
    check_input,
    config_key,
    extra_reasons,
    gpu_of,
    platform_reasons,
    quant_buffers,
    quantize_activation,
)
from moe.experts._triton.weights import (FRAGMENT_FREE_FRACTION, TritonWeights, fragments_fit, mma_fragment_bytes,
                                         prepare_triton_weights)
from moe.experts.base import Capabilities, Experts
from moe.formats import ActivationFormat, Dispatched, DispatchShape, ExpertsOutput, OutputKind
from moe.platform import Platform
from moe.problem import MoEProblem
from moe.quant import QuantFormat
from moe.registry import register_experts
from moe.weights import ExpertWeights
from moe.workspace import Workspace, WorkspaceShapes


@register_experts
class TritonExperts(Experts):
    name = "triton"
    prepared_type = TritonWeights
    # MXFP4 / NVFP4 on a GPU: also hold the weights in the MMA decode tiles' order (`_triton.weights.MmaFragments`,
    # about as many bytes again as the fp4 weights; the grouped GEMM keeps the half-split copy). False: decode
    # with the FMA and tensor-core tiles instead (`decode.FALLBACK_DECODE_CONFIGS`), one copy
    decode_fragments = True
    capabilities = Capabilities(
        formats=frozenset({ActivationFormat.STANDARD}),
        output=OutputKind.REDUCED,
        quantizes_input=True,  # fp8 activations are quantized here, on the GPU, without a sync
        modes=STANDARD_MODES,
        **COMMON_CAPABILITIES,
    )

    @classmethod
    def extra_checks(cls, problem: MoEProblem, platform: Platform | None) -> list[str]:
        return extra_reasons(problem, platform)

    @classmethod
    def _platform_reasons(cls, platform: Platform) -> list[str]:
        return super()._platform_reasons(platform) + platform_reasons(platform)

    def prepare_weights(self, weights: ExpertWeights) -> TritonWeights:
        weights.validate(self.problem)
        p = self.problem
        table = ConfigTable.load(config_key(p, "standard", weights.device))
        for m, _ in table.decode:  # a bad decode entry fails here, not at the first forward that reaches it
            fp8_decode_config(m, table)
        expert_map = p.parallel.global_to_local(p.num_experts) if p.parallel.enabled else None
        weight_only = p.quant.is_quantized and activation_format(p, gpu_of(weights.device)) is QuantFormat.NONE
        decoded = decodes(p.quant.weight, QuantFormat.NONE if weight_only else p.quant.activation)
        fragments = (self.decode_fragments and decoded and p.quant.weight.is_packed_fp4
                     and weights.device.type == "cuda" and fragments_room(weights))
        prepared = prepare_triton_weights(weights, expert_map, table, weight_only=weight_only, fragments=fragments)
        if not decoded:
            return prepared
        make_descriptors(prepared)
        n_out1 = prepared.w13.data.shape[1] // (2 if p.activation.is_gated else 1)
        tickets = decode_tickets(p.quant.weight, n_out1, prepared.w2.data.shape[1], weights.device)
        return dataclasses.replace(prepared, decode_tickets=tickets)

    def prepared_sizes(self, weights: TritonWeights) -> tuple[int, int, int]:
        return triton_sizes(weights)

    @classmethod
    def declared_workspace(cls, problem: MoEProblem, dispatch: DispatchShape) -> WorkspaceShapes:
        p = problem
        tokens = dispatch.max_rows
        slots = tokens * p.top_k
        act = activation_format(p, None)  # an upper bound: fp8 buffers even where fp8 runs weight-only
        # dense problems may run tma_a tiles and fp8_block ones wgmma tiles: their inter and y hold every
        # row of a layout, padding included
        sorted_rows = act is QuantFormat.FP8_BLOCK or not p.quant.is_quantized
        rows = workspace_rows(slots, p.local_num_experts) if sorted_rows else slots
        wgmma = {}  # the sorted rows' scales, group-major (gemm_wgmma.py)
        if act is QuantFormat.FP8_BLOCK:
            wgmma["x_sorted_scale"] = ((cdiv(p.hidden_size, GROUP) * rows,), torch.float32)
        return WorkspaceShapes.of(
            out=((tokens, p.hidden_size), p.dtype),
            inter=((rows, p.intermediate_size), p.dtype),
            y=((rows, p.hidden_size), p.dtype),
            **align_buffers(slots, p.local_num_experts, BLOCK_MS),
            **quant_buffers(act, "x", tokens, p.hidden_size),
            **quant_buffers(act, "inter", rows, p.intermediate_size),
            **wgmma,
            **(decode_buffers(slots, p.w13_rows, p.hidden_size, p.quant.weight) if decodes(p.quant.weight, act)
               else {}),
        )

    def apply(self, dispatched: Dispatched, weights: TritonWeights, workspace: Workspace) -> ExpertsOutput:
        p = self.problem
        check_input(dispatched.x, p)
        tokens, k = dispatched.topk.ids.shape
        slots = tokens * k
        out = workspace["out"][:tokens]
        if tokens == 0:
            return ExpertsOutput(OutputKind.REDUCED, out)
        ids = dispatched.topk.ids
        act = QuantFormat.NONE if weights.weight_only else p.quant.activation  # what the GEMMs read
        if dispatched.x.fmt is QuantFormat.NONE and uses_decode(weights, act, slots):
            if weights.w13.fmt in FP8_DECODE_FORMATS:  # None: this shape's table runs the grouped GEMMs here
                config = fp8_decode_config(tokens, weights.configs)
            else:  # by rows per expert: how many rows each streamed weight byte serves
                config = decode_config(slots / p.local_num_experts, tokens, weights.configs)
            if config is not None:
                return ExpertsOutput(OutputKind.REDUCED, decode_experts(
                    dispatched.x.data, ids, dispatched.topk.weights, weights, p.activation, p.local_num_experts,
                    config, workspace, out))
        config = weights.configs.lookup(tokens)
        # 1. routing -> blocks of rows sorted by expert (or, for decode, one program per slot)
        if config.direct:
            rows1 = DirectRows(ids.reshape(-1), weights.expert_map, k)
            rows2 = DirectRows(ids.reshape(-1), weights.expert_map, 1)
        else:
            layout = align_block_size(ids, weights.expert_map, p.local_num_experts, config.block_m, workspace)
            rows1, rows2 = SortedRows(layout, slots, k), SortedRows(layout, slots, 1)
        # 2. first GEMM with the activation fused in
        x, x_scale = dispatched.x.data, dispatched.x.scale
        if dispatched.x.fmt is QuantFormat.NONE:
            x, x_scale = quantize_activation(x, act, "x", workspace, RowValidity())
        slot_rows = None  # y's rows are the slots', unless GEMM2 left them sorted
        if config.gemm1.tma_a:  # A by TMA from rows gathered in sorted order first (gemm_tma_a.py)
            y, slot_rows = sorted_tma_a_gemms(x, weights.w13, weights.w2, layout, p.activation, config, workspace,
                                              slots, k)
        elif config.gemm1.wgmma:  # fp8_block, the pipelined-wgmma GEMMs on sorted rows (gemm_wgmma.py)
            if act is not QuantFormat.FP8_BLOCK:
                raise MoEConfigError(f"wgmma=True configs run fp8_block activations and weights (the GEMMs read "
                                     f"{act.value}); use a config without wgmma for {p.quant.name}")
            y, slot_rows = sorted_wgmma_gemms(x, x_scale, weights.w13, weights.w2, layout, p.activation, config,
                                              workspace, slots, k)
        else:
            inter = workspace["inter"][:slots]
            grouped_gemm(x, x_scale, weights.w13, inter, rows1, p.activation, config.block_m, config.gemm1)
            # 3. second GEMM on the (quantized) intermediate, one row per slot
            here = RowValidity.slots_here(ids, weights.expert_map)
            a2, a2_scale = quantize_activation(inter, act, "inter", workspace, here)
            y = workspace["y"][:slots]
            grouped_gemm(a2, a2_scale, weights.w2, y, rows2, None, config.block_m, config.gemm2)
        # 4. router weights and the sum over k
        combine_slots_kernel(y, dispatched.topk.weights, ids, weights.expert_map, out, slot_rows)
        return ExpertsOutput(OutputKind.REDUCED, out)


_FRAGMENTS_SKIPPED = []  # one warning per process


def fragments_room(weights: ExpertWeights) -> bool:
    """Whether the GPU has room for these fp4 weights' MMA decode copy (`_triton.weights.fragments_fit`); if not,
    one `SlowPathWarning` per process says so, and the layer decodes with the fallback tiles."""
    needed = mma_fragment_bytes(tuple(weights.w13.data.shape)) + mma_fragment_bytes(tuple(weights.w2.data.shape))
    fits, numbers = fragments_fit(weights.device, needed)
    if not fits and not _FRAGMENTS_SKIPPED:
        _FRAGMENTS_SKIPPED.append(numbers)
        warnings.warn(f"TritonExperts: no room on {weights.device} for the MMA decode copy of a layer's fp4 weights "
                      f"({numbers}; it would leave less than {FRAGMENT_FREE_FRACTION:.0%} free): this layer, and any "
                      "other short of room, decodes with the slower fallback tiles. Set "
                      "TritonExperts.decode_fragments = False to keep every layer on them without this warning.",
                      SlowPathWarning, stacklevel=3)
    return fits


def triton_sizes(weights: TritonWeights) -> tuple[int, int, int]:
    """``(E local, H, I)`` of Triton weights: w2's operand is ``[E, N = H, K = I]``."""
    return weights.w2.data.shape[0], weights.w2.data.shape[1], weights.w2.k
