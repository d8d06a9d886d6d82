"""The FlashInfer weight layout transforms (pure torch, CPU): each one bit-exact against FlashInfer's own
CPU-capable helper where one exists (skipped without flashinfer), against a hand-worked example always."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from moe import MoEProblem, Router
from moe.experts import flashinfer_cutlass
from moe.experts._flashinfer import layouts, sm90
from moe.experts._flashinfer.cutedsl_modes import interleaved_first_gemm
from moe.experts._flashinfer.layouts import Geometry, first_gemm_rows
from moe.experts.flashinfer_trtllm import routing_arguments
from moe.experts.reference import ReferenceExperts
from moe.formats import ActivationFormat, Dispatched, DispatchShape
from moe.quant import QuantFormat, QuantizedTensor
from moe.router import TopK
from moe.testing.tolerance import relative_error
from moe.workspace import WorkspaceManager
from tests.helpers import random_weights

needs_flashinfer = pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="flashinfer is not installed")


def rows_of(t: torch.Tensor) -> list:
    return t.squeeze(-1).tolist()


def labelled(experts: int, rows: int, cols: int = 1) -> torch.Tensor:
    """[E, rows, cols] whose row r of expert e holds 100 * e + r."""
    r = torch.arange(rows).view(1, rows, 1) + 100 * torch.arange(experts).view(experts, 1, 1)
    return r.expand(experts, rows, cols).clone()


# --- gate/up order and padding --------------------------------------------------------------------


def test_up_gate_rows_swaps_the_halves():
    t = torch.tensor([[10, 11, 20, 21]]).unsqueeze(-1)  # [g0, g1, u0, u1]
    assert rows_of(layouts.up_gate_rows(t)) == [[20, 21, 10, 11]]


def test_pad_row_halves_pads_each_half():
    t = torch.tensor([[10, 11, 20, 21]]).unsqueeze(-1)
    assert rows_of(layouts.pad_row_halves(t, 3, fill=-1)) == [[10, 11, -1, 20, 21, -1]]


def test_first_gemm_rows_pads_then_swaps():
    geo = Geometry(hidden=8, inter=2, hidden_padded=8, inter_padded=3, gated=True)
    t = torch.tensor([[10, 11, 20, 21]]).unsqueeze(-1)
    assert rows_of(first_gemm_rows(t, geo)) == [[20, 21, 0, 10, 11, 0]]
    nongated = Geometry(hidden=8, inter=2, hidden_padded=8, inter_padded=4, gated=False)
    assert rows_of(first_gemm_rows(torch.tensor([[5, 6]]).unsqueeze(-1), nongated)) == [[5, 6, 0, 0]]


def test_pad_dim_pads_fp8_through_bytes():
    t = torch.ones(2, 3).to(torch.float8_e4m3fn)
    padded = layouts.pad_dim(t, 1, 5)
    assert padded.dtype == torch.float8_e4m3fn and padded.float().tolist() == [[1, 1, 1, 0, 0]] * 2


def test_pad_into_writes_the_workspace_and_fills_the_rest():
    dst = torch.full((4, 5), 7.0)
    out = layouts.pad_into(dst, torch.ones(2, 3), fill=0)
    assert out.data_ptr() == dst.data_ptr()
    assert dst.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [7] * 5, [7] * 5]


# --- trtllm-gen row orders -------------------------------------------------------------------------


def test_gated_interleave_rows_hand_example():
    assert layouts.gated_interleave_rows(6).tolist() == [0, 3, 1, 4, 2, 5]


def test_epilogue_shuffle_rows_hand_example():
    rows = layouts.epilogue_shuffle_rows(32)  # new row -> old row
    assert rows[[0, 8, 16, 24, 1]].tolist() == [0, 1, 2, 3, 4]
    assert sorted(rows.tolist()) == list(range(32))
    assert layouts.epilogue_shuffle_rows(16, 64)[[0, 8, 1, 9]].tolist() == [0, 1, 2, 3]


@needs_flashinfer
@pytest.mark.parametrize("rows,tile", [(64, 128), (256, 128), (96, 64)])
def test_shuffle_and_reorder_match_flashinfer(rows, tile):
    from flashinfer import shuffle_matrix_a
    from flashinfer.fused_moe import reorder_rows_for_gated_act_gemm

    w = torch.randn(rows, 8)
    shuffled = w[layouts.epilogue_shuffle_rows(rows, tile)]
    assert torch.equal(shuffled, shuffle_matrix_a(w, tile))
    assert torch.equal(w[layouts.gated_interleave_rows(rows)], reorder_rows_for_gated_act_gemm(w))


@needs_flashinfer
@pytest.mark.parametrize("gated", [True, False])
def test_trtllm_rows_match_flashinfer_permute_indices(gated):
    from flashinfer.fused_moe.core import _maybe_get_cached_w3_w1_permute_indices, get_w2_permute_indices_with_cache

    w13 = torch.randint(0, 255, (256, 16), dtype=torch.uint8)
    expected = _maybe_get_cached_w3_w1_permute_indices({}, w13, 128, is_gated_act_gemm=gated)
    assert torch.equal(layouts.trtllm_rows(256, gated), expected)
    w2 = torch.randint(0, 255, (128, 16), dtype=torch.uint8)
    assert torch.equal(layouts.epilogue_shuffle_rows(128), get_w2_permute_indices_with_cache({}, w2, 128))


def test_take_rows_applies_an_order_per_expert():
    assert rows_of(layouts.take_rows(labelled(2, 3), torch.tensor([2, 0, 1]))) == [[2, 0, 1], [102, 100, 101]]


def test_block_major_k_hand_example():
    t = torch.arange(8).view(1, 2, 4)  # rows [0 1 2 3], [4 5 6 7]
    assert layouts.block_major_k(t, 2).tolist() == [[[[0, 1], [4, 5]], [[2, 3], [6, 7]]]]


@needs_flashinfer
def test_block_major_k_matches_flashinfer():
    from flashinfer.fused_moe import convert_to_block_layout

    w = torch.randint(0, 255, (2, 64, 256), dtype=torch.uint8)
    ours = layouts.block_major_k(w, 128)
    assert torch.equal(ours, torch.stack([convert_to_block_layout(w[e], 128) for e in range(2)]))


# --- block scales ----------------------------------------------------------------------------------


def test_swizzle_block_scales_places_each_scale():
    rows, cols = 200, 6  # pads to 256 x 8
    s = (torch.arange(rows * cols) % 251).view(1, rows, cols).to(torch.uint8)
    out = layouts.swizzle_block_scales(s)
    assert out.shape == (1, 2, 2, 32, 4, 4)
    for m, k in [(0, 0), (1, 0), (33, 3), (127, 5), (130, 4), (199, 2)]:
        assert out[0, m // 128, k // 4, m % 32, (m % 128) // 32, k % 4] == s[0, m, k]
    assert out[0, 1, 1, 31, 3, 3] == 0  # padding (row 255, column 7)


def test_mma_scale_view_is_the_cute_dsl_6d_layout():
    s = torch.randint(0, 255, (3, 128, 8), dtype=torch.uint8)
    view = layouts.mma_scale_view(layouts.swizzle_block_scales(s))
    assert view.shape == (32, 4, 1, 4, 2, 3)
    m, k, e = 77, 6, 2
    assert view[m % 32, (m % 128) // 32, m // 128, k % 4, k // 4, e] == s[e, m, k]


def test_interleave_row_groups_hand_example():
    t = torch.tensor([[0, 1, 2, 3, 10, 11, 12, 13]]).unsqueeze(-1)  # [a; b], group 2
    assert rows_of(layouts.interleave_row_groups(t, 2)) == [[0, 1, 10, 11, 2, 3, 12, 13]]


@needs_flashinfer
def test_interleave_row_groups_matches_flashinfer_linear_gate_interleave():
    from flashinfer.fused_moe.prepare import _interleave_linear_and_gate

    w = torch.randn(2, 256, 16)
    assert torch.equal(layouts.interleave_row_groups(w, 64), _interleave_linear_and_gate(w, group_size=64, dim=1))


def test_cute_dsl_first_gemm_is_up_gate_interleaved():
    p = MoEProblem.create(num_experts=1, top_k=1, hidden_size=8, intermediate_size=64)
    t = labelled(1, 128)  # rows 0..63 gate, 64..127 up
    out = rows_of(interleaved_first_gemm(t, p, 32))[0]
    assert out[:32] == list(range(64, 96)) and out[32:64] == list(range(0, 32)) and out[64:96] == list(range(96, 128))
    relu2 = MoEProblem.create(num_experts=1, top_k=1, hidden_size=8, intermediate_size=64, activation="relu2")
    assert rows_of(interleaved_first_gemm(labelled(1, 64), relu2, 32))[0] == list(range(64))


# --- SM90 mixed-input (W4A16) ----------------------------------------------------------------------


@needs_flashinfer
def test_sm90_scale_interleave_matches_flashinfer():
    from flashinfer.fused_moe import interleave_moe_scales_for_sm90_mixed_gemm

    s = torch.randint(0, 255, (3, 192, 12), dtype=torch.uint8)
    assert torch.equal(sm90.interleave_mxfp4_scales(s), interleave_moe_scales_for_sm90_mixed_gemm(s, group_size=32))


def test_sm90_scale_interleave_hand_example():
    s = torch.arange(64 * 4, dtype=torch.int32).view(1, 64, 4).to(torch.uint8)  # scale (r, g) = 4r + g
    out = sm90.interleave_mxfp4_scales(s)
    assert out.shape == (1, 1, 1, 16, 16)
    assert out[0, 0, 0, 5].tolist() == [4 * r + g for r in (5, 21, 37, 53) for g in range(4)]


def test_sm90_weight_interleave_moves_single_bits_as_worked_out():
    w = torch.zeros(1, 16, 32, dtype=torch.uint8)  # N=16, K=64: one 16-row block, one partition
    w[0, 0, 0] = 0x01  # word of lane 0: byte 0, bit 0 -> bit 6 = byte 0 bit 6
    w[0, 8, 4] = 0x80  # byte 3 (row 8, column 4), bit 7 = word bit 31 -> bit 30 = byte 3 bit 6
    w[0, 8, 9] = 0x08  # lane 5 (m=1, l=1): byte 1 bit 3 = word bit 11 -> bit 12 = byte 1 bit 4
    out = sm90.interleave_mxfp4_weights(w)
    assert out[0, 0, 0] == 0x40 and out[0, 0, 3] == 0x40
    assert out[0, 8, 4 + 1] == 0x10  # m=1 -> row 0 + 8, columns 4l + byte = 4 + 1
    assert int((out != 0).sum()) == 3


def test_sm90_weight_interleave_is_a_bit_permutation():
    w = torch.randint(0, 256, (2, 32, 64), dtype=torch.uint8)
    out = sm90.interleave_mxfp4_weights(w)
    ones = lambda t: sum(int(((t.to(torch.int64) >> b) & 1).sum()) for b in range(8))  # noqa: E731
    assert ones(out) == ones(w)
    assert sorted(sm90.FP4_WORD_BIT_DESTINATION) == list(range(32))
    assert torch.equal(sm90.interleave_mxfp4_weights(torch.zeros_like(w)), torch.zeros_like(w))


# --- routing ----------------------------------------------------------------------------------------


def test_pack_topk_hand_example():
    ids = torch.tensor([[3, 0]], dtype=torch.int32)
    weights = torch.tensor([[1.0, -2.0]])  # bf16 0x3F80, 0xC000
    assert layouts.pack_topk(ids, weights).tolist() == [[0x33F80, 0xC000]]


@needs_flashinfer
def test_pack_topk_matches_flashinfer():
    from flashinfer.fused_moe.runners import _pack_prerouted_topk_ids

    ids = torch.randint(0, 256, (7, 8), dtype=torch.int32)
    weights = torch.rand(7, 8)
    expected = _pack_prerouted_topk_ids(SimpleNamespace(topk_ids=ids, topk_weights=weights))
    assert torch.equal(layouts.pack_topk(ids, weights), expected)


def test_routing_arguments_for_each_router():
    assert routing_arguments(Router("softmax", 8, 2))["routing_method_type"] == 4  # RenormalizeNaive
    assert routing_arguments(Router("softmax", 8, 2, renormalize=False))["routing_method_type"] == 0  # Default
    assert routing_arguments(Router("gpt_oss", 8, 2))["routing_method_type"] == 1  # Renormalize
    bias = torch.zeros(8)
    ds = routing_arguments(Router("deepseek_v3", 8, 2, n_group=4, topk_group=2, correction_bias=bias, routed_scaling_factor=2.5))
    assert (ds["routing_method_type"], ds["n_group"], ds["topk_group"], ds["routed_scaling_factor"]) == (2, 4, 2, 2.5)
    assert ds["routing_bias"].dtype == torch.bfloat16 and ds["norm_topk_prob"] is True


# --- the CUTLASS layout, end to end under a torch model of the kernel --------------------------------


def cutlass_model(args: dict) -> None:
    """What cutlass_fused_moe computes, in float32, from the arguments it got ([up; gate] rows)."""
    x, ids, scales = args["input"].float(), args["token_selected_experts"].long(), args["token_final_scales"]
    w13, w2, b13, b2 = (args.get(k) for k in ("fc1_expert_weights", "fc2_expert_weights", "fc1_expert_biases", "fc2_expert_biases"))
    out = torch.zeros(x.shape[0], w2.shape[1])
    for m, j in torch.cartesian_prod(torch.arange(x.shape[0]), torch.arange(ids.shape[1])).tolist():
        e = ids[m, j]
        h = w13[e].float() @ x[m] + (0 if b13 is None else b13[e].float())
        if int(args["activation_type"]) == 6:
            a = torch.relu(h) ** 2
        elif "swiglu_alpha" in args:
            up, gate = h.chunk(2)
            limit, alpha, beta = (float(args[f"swiglu_{n}"][e]) for n in ("limit", "alpha", "beta"))
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            a = gate * torch.sigmoid(alpha * gate) * (up + beta)
        else:
            up, gate = h.chunk(2)
            a = (torch.nn.functional.silu if int(args["activation_type"]) == 3 else torch.nn.functional.gelu)(gate) * up
        out[m] += scales[m, j] * (w2[e].float() @ a + (0 if b2 is None else b2[e].float()))
    args["output"].copy_(out)


@pytest.mark.parametrize("activation,bias", [("swiglu_oai", True), ("silu", False), ("gelu", True), ("relu2", False)])
def test_cutlass_bf16_layout_computes_the_reference(monkeypatch, activation, bias):
    """Gate/up swap, H and I padding (196 -> 200, 70 -> 72), biases and swiglu parameters: with a torch
    model of cutlass_fused_moe in place of the kernel, the experts give the reference's result."""
    enums = pytest.importorskip("flashinfer.tllm_enums")
    kernel = SimpleNamespace(cutlass_fused_moe=lambda **kwargs: cutlass_model(kwargs), ActivationType=enums.ActivationType)
    monkeypatch.setattr(flashinfer_cutlass, "flashinfer_module", lambda name="": kernel)
    p = MoEProblem.create(num_experts=4, top_k=2, hidden_size=196, intermediate_size=70, activation=activation,
                          has_bias=bias, max_tokens=8)
    x = torch.randn(7, 196).to(p.dtype)
    ids = torch.stack([torch.randperm(4)[:2] for _ in range(7)]).to(torch.int32)
    topk = TopK(ids, torch.softmax(torch.randn(7, 2), -1))
    dispatched = Dispatched(ActivationFormat.STANDARD, QuantizedTensor(data=x, scale=None, fmt=QuantFormat.NONE), topk)
    weights = random_weights(p)
    cutlass = flashinfer_cutlass.FlashInferCutlassExperts(p)
    assert (cutlass.geometry.hidden_padded, cutlass.geometry.inter_padded) == (200, 72)
    outs = []
    for experts in (cutlass, ReferenceExperts(p)):
        workspace = WorkspaceManager("cpu").take(experts.workspace_shapes(DispatchShape(ActivationFormat.STANDARD, 7)))
        outs.append(experts.apply(dispatched, experts.prepare_weights(weights), workspace).out)
    out, ref = outs[0], (outs[1] * topk.weights.unsqueeze(-1)).sum(1)
    assert relative_error(out.float(), ref) < 5e-3  # biases go to bf16 for the kernel
