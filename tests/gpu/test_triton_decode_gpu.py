"""The decode path (`_triton/decode.py`) on a CUDA GPU, bfloat16. MXFP4 W4A16: GPT-OSS-120B's real
shape at M = 1, 16, 64 against the reference experts, both dequantizations (packed bf16x2 PTX and
float32 math) and both program kinds. NVFP4 (weight-only): Qwen3- and GPT-OSS-like shapes at M = 1, 3,
16 with block scales over e4m3's whole range, the PTX against the float32 math bit for bit and against
the weight-only reference. fp8_block and fp8_token W8A8: Qwen3-30B-A3B's shape at M = 1, 4, 16, 32
against the grouped-GEMM path of the scheme and the reference, the default configs and both program
kinds. All: CUDA-graph replay bit-equal to eager, no host sync."""

from __future__ import annotations

import inspect
import json
from dataclasses import replace

import pytest
import torch

from moe.experts._triton import decode
from moe.experts._triton.config import CONFIG_DIR, ConfigKey, ConfigTable
from moe.experts._triton.decode import DecodeConfig, DecodeTile, packed_dequantization
from moe.experts._triton.decode import _gemm as _GEMM
from moe.experts.reference import WeightOnlyReferenceExperts
from moe.experts.triton import TritonExperts
from moe.formats import ActivationFormat, Dispatched
from moe.quant import QuantFormat, QuantizedTensor
from moe.testing.tolerance import assert_close_moe, regime_for
from moe.weights import ExpertWeights
from tests.gpu.test_triton_gpu import (
    assert_replay_equals_eager_without_sync,
    problem,
    reference,
    run,
    topk_for,
    weights_for,
)

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

FMA = DecodeTile(32, 128, 2, 1, dot=False)
DOT = DecodeTile(64, 128, 2, 16, dot=True)
DOT_ONE_SPLIT = DecodeTile(32, 256, 1, 16, dot=True, asm=False)
MMA = DecodeTile(32, 128, 4, 8, dot=False, num_warps=2, num_stages=1, mma=True)
MMA_FUSED = DecodeTile(64, 64, 1, 8, dot=False, num_warps=4, num_stages=1, mma=True)
MMA_FINISH = DecodeTile(64, 256, 8, 8, dot=False, num_warps=4, num_stages=1, finish=True, mma=True)


def gpt_oss(tokens):
    return problem("mxfp4", "swiglu_oai", E=128, k=4, H=2880, I=2880, bias=True, max_tokens=tokens)


def dispatched_for(p, tokens):
    x = torch.randn(tokens, p.hidden_size, device="cuda", dtype=p.dtype)
    topk = topk_for(p, tokens)
    return Dispatched(ActivationFormat.STANDARD, QuantizedTensor(data=x, scale=None, fmt="none"), topk)


@pytest.mark.parametrize("tokens", [1, 16, 64])
@pytest.mark.parametrize("tiles", [(FMA, DOT), (DOT, FMA), (DOT_ONE_SPLIT, DOT_ONE_SPLIT)], ids=["fma", "dot", "f32-dequant"])
def test_gpt_oss_decode_matches_reference(tokens, tiles, monkeypatch):
    monkeypatch.setattr("moe.experts.triton.decode_config", lambda m, *table: DecodeConfig(*tiles))
    p = gpt_oss(tokens)
    weights = weights_for(p)
    experts = TritonExperts(p)
    prepared = experts.prepare_weights(weights)
    assert prepared.small_scales  # randn / sqrt(H) weights: the packed path really runs for asm tiles
    d = dispatched_for(p, tokens)
    out = run(experts, d, prepared)
    assert_close_moe(out.float(), reference(p, d.x.data, d.topk, weights), regime_for(p), context=f"decode M={tokens}")


def test_packed_and_float32_dequantization_agree(monkeypatch):
    """The bf16x2 PTX and the float32 path dequantize to the same bf16 weights: equal outputs."""
    p = gpt_oss(16)
    experts = TritonExperts(p)
    prepared = experts.prepare_weights(weights_for(p))
    d = dispatched_for(p, 16)
    with_ptx, without = outputs_with_and_without_ptx(
        experts, d, prepared, lambda asm: DecodeTile(32, 128, 1, 16, dot=True, asm=asm), monkeypatch)
    assert torch.equal(with_ptx, without)


def outputs_with_and_without_ptx(experts, d, prepared, make_tile, monkeypatch):
    """The experts' outputs with ``make_tile(asm=True)`` and ``make_tile(asm=False)`` for both GEMMs."""
    outs = []
    for asm in (True, False):
        tile = make_tile(asm)
        monkeypatch.setattr("moe.experts.triton.decode_config", lambda m, *table, t=tile: DecodeConfig(t, t))
        outs.append(run(experts, d, prepared).clone())
    return outs


@pytest.mark.parametrize("quant", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_fma_ptx_and_integer_dequantization_agree(quant, tokens, monkeypatch):
    """The FMA tiles' float16 PTX (`_decode._E2M1_F16X2`) and their integer ops build the same exact
    unscaled weights: equal outputs, for weights spread over 2**-3 .. 2**7 (MXFP4 scales far above 2,
    where the tensor-core path's bf16x2 PTX would not be exact); and both match the reference."""
    p = problem(quant, "silu", E=16, k=4, H=1024, I=512, max_tokens=tokens)
    weights = weights_for(p, spread=(0.125, 128.0))
    experts = TritonExperts(p)
    prepared = experts.prepare_weights(weights)
    d = dispatched_for(p, tokens)
    outs = outputs_with_and_without_ptx(
        experts, d, prepared, lambda asm: DecodeTile(64, 128, 2, 1, dot=False, asm=asm), monkeypatch)
    assert torch.equal(outs[0], outs[1])
    if quant == "nvfp4":  # weight-only: the reference dequantizes the weights, keeps x in bf16
        truth = WeightOnlyReferenceExperts(p)
        want = (run(truth, d, truth.prepare_weights(weights)) * d.topk.weights.unsqueeze(-1)).sum(1).float()
    else:
        want = reference(p, d.x.data, d.topk, weights)
    regime = "bf16" if quant == "nvfp4" else regime_for(p)  # as the NVFP4 tests below
    assert_close_moe(outs[0].float(), want, regime, context=f"fma ptx {quant} M={tokens}")


def qwen3(tokens, quant="fp8_block"):
    return problem(quant, "silu", E=128, k=8, H=2048, I=768, max_tokens=tokens)


@pytest.mark.parametrize("most", [False, True], ids=["one-token", "most-tokens"])
@pytest.mark.parametrize("shape", [gpt_oss, qwen3], ids=["gpt-oss-mxfp4", "qwen3-fp8-block"])
def test_decode_cuda_graph_replay_equals_eager(most, shape):
    """One token, and the most tokens the decode path takes (`decode.max_slots` slots: 512 for MXFP4, 256 for
    fp8_block)."""
    tokens = decode.max_slots(shape(1).quant.weight) // shape(1).top_k if most else 1
    p = shape(tokens)
    experts = TritonExperts(p)
    prepared = experts.prepare_weights(weights_for(p))
    assert decode.uses_decode(prepared, p.quant.activation, tokens * p.top_k)
    assert_replay_equals_eager_without_sync(experts, prepared, p, tokens)


# --- NVFP4 (e2m1, e4m3 scale per 16, fp32 global scale per expert), weight-only ---------------------


def nvfp4_problem(shape, tokens):
    if shape == "qwen3":
        return problem("nvfp4", "silu", E=128, k=8, H=2048, I=768, max_tokens=tokens)
    return problem("nvfp4", "swiglu_oai", E=128, k=4, H=2880, I=2880, bias=True, max_tokens=tokens)


def _spread_over_blocks(w):
    """``w`` with each block of 16 along K times 2**u, u uniform in [-20, 0]: after NVFP4 quantization the
    block scales run from 448 (the largest block) through e4m3's subnormals to 0."""
    factors = torch.exp2(-20 * torch.rand(*w.shape[:-1], w.shape[-1] // 16, 1, device=w.device))
    return (w.unflatten(-1, (-1, 16)) * factors).flatten(-2)


def nvfp4_weights(p):
    e, r, h, i = p.local_num_experts, p.w13_rows, p.hidden_size, p.intermediate_size
    spread = torch.linspace(0.25, 4.0, e, device="cuda").view(e, 1, 1)  # a global scale per expert
    w13 = _spread_over_blocks(torch.randn(e, r, h, device="cuda") / h**0.5) * spread
    w2 = _spread_over_blocks(torch.randn(e, h, i, device="cuda") / i**0.5) / spread
    b13 = 0.1 * torch.randn(e, r, device="cuda") if p.has_bias else None
    b2 = 0.1 * torch.randn(e, h, device="cuda") if p.has_bias else None
    weights = ExpertWeights.from_dense(w13, w2, b13, b2, quant=p.quant, dtype=p.dtype)
    for q in (weights.w13, weights.w2):  # the premise: scales at e4m3's top, its subnormals and 0
        codes = q.scale.view(torch.uint8) & 0x7F
        assert (codes == 0x7E).any() and ((codes > 0) & (codes < 8)).any() and (codes == 0).any()
    return weights


def run_nvfp4(p, tokens, tiles, monkeypatch, d=None, weights=None):
    """(output, dispatched, weights, the ``asm`` flag of each GEMM launch) of the decode path."""
    monkeypatch.setattr("moe.experts.triton.decode_config", lambda m, *table: DecodeConfig(*tiles))
    launches = []
    real = decode._gemm
    # the launch's asm argument, read by the unpatched launcher's signature (``real`` may be a patch already)
    asm = lambda *a, **k: inspect.signature(_GEMM).bind(*a, **k).arguments["asm"]  # noqa: E731
    monkeypatch.setattr(decode, "_gemm", lambda *a, **k: launches.append(asm(*a, **k)) or real(*a, **k))
    weights = nvfp4_weights(p) if weights is None else weights
    experts = TritonExperts(p)
    prepared = experts.prepare_weights(weights)
    d = dispatched_for(p, tokens) if d is None else d
    assert prepared.weight_only and packed_dequantization(prepared, d.x.data)
    return run(experts, d, prepared).clone(), d, weights, launches


@pytest.mark.parametrize("tokens", [1, 3, 16])
@pytest.mark.parametrize("shape", ["qwen3", "gpt_oss"])
@pytest.mark.parametrize("tiles", [(FMA, DOT), (DOT, FMA)], ids=["fma", "dot"])
def test_nvfp4_packed_decode_matches_reference_and_float32_math(shape, tokens, tiles, monkeypatch):
    """The PTX path (scales biased by 2**118, the rest in the global scale) equals the float32 path bit
    for bit -- the same bf16 weights up to a power of two -- and the weight-only reference."""
    p = nvfp4_problem(shape, tokens)
    out, d, weights, launches = run_nvfp4(p, tokens, tiles, monkeypatch)
    assert launches == [True, True]
    exact_tiles = tuple(replace(t, asm=False) for t in tiles)
    f32, _, _, launches = run_nvfp4(p, tokens, exact_tiles, monkeypatch, d, weights)
    assert launches == [False, False]
    assert torch.equal(out, f32)
    truth = WeightOnlyReferenceExperts(p)
    ref = run(truth, d, truth.prepare_weights(weights))
    ref = (ref * d.topk.weights.unsqueeze(-1)).sum(1)
    assert ref.abs().max() > 0
    assert_close_moe(out.float(), ref.float(), "bf16", context=f"nvfp4 {shape} decode M={tokens}")


@pytest.mark.parametrize("tokens", [1, 16])
def test_nvfp4_decode_cuda_graph_replay_equals_eager(tokens):
    p = nvfp4_problem("gpt_oss", tokens)
    experts = TritonExperts(p)
    prepared = experts.prepare_weights(nvfp4_weights(p))
    assert decode.uses_decode(prepared, QuantFormat.NONE, tokens * p.top_k)
    assert_replay_equals_eager_without_sync(experts, prepared, p, tokens)


# --- fp8 128-block W8A8 ---------------------------------------------------------------------------

FP8_FMA = DecodeTile(32, 64, 2, 4, dot=False, asm=False)
FP8_DOT = DecodeTile(64, 128, 2, 16, dot=True, asm=False)
FP8_DOT_FINISH = replace(FP8_DOT, splits=4, finish=True)  # a program per slot at any M, no epilogue launch
FP8_TMA_FINISH = replace(FP8_DOT_FINISH, block_n=128, tma=True)  # the weights by TMA descriptor


@pytest.mark.parametrize("tokens", [1, 4, 16, 32])  # 32 x k = 8: DECODE_MAX_SLOTS, the decode path's last M
@pytest.mark.parametrize("tiles", [None, (FP8_FMA, FP8_DOT), (FP8_DOT, FP8_FMA), (FP8_DOT_FINISH, FP8_DOT_FINISH),
                                   (FP8_TMA_FINISH, FP8_TMA_FINISH), (FP8_TMA_FINISH, FP8_DOT)],
                         ids=["default", "fma", "dot", "dot-finish", "tma-finish", "tma-dot"])
@pytest.mark.parametrize("quant", ["fp8_block", "fp8_token"])
def test_qwen3_fp8_decode_matches_grouped_gemm_and_reference(quant, tokens, tiles, monkeypatch):
    """The decode kernels against the grouped GEMM on the same quantized operands (the activation codes
    and scales are the same; only the fp32 summation order and the bf16 intermediate's rounding differ:
    within bf16's bound) and against the reference experts (fp8's)."""
    if tiles is not None:
        monkeypatch.setattr("moe.experts.triton.fp8_decode_config", lambda m, *table: DecodeConfig(*tiles))
    p = qwen3(tokens, quant)
    weights = weights_for(p)
    experts = TritonExperts(p)
    prepared = experts.prepare_weights(weights)
    assert decode.uses_decode(prepared, p.quant.activation, tokens * p.top_k)
    d = dispatched_for(p, tokens)
    out = run(experts, d, prepared).float().clone()
    monkeypatch.setattr("moe.experts.triton.uses_decode", lambda *a: False)
    grouped = run(experts, d, prepared).float()
    context = f"{quant} decode M={tokens} {tiles}"
    assert_close_moe(out, grouped, "bf16", context=context + " vs grouped GEMM")
    assert_close_moe(out, reference(p, d.x.data, d.topk, weights), regime_for(p), context=context + " vs reference")



def gpt_oss_fp8(tokens):
    return problem("fp8_block", "swiglu_oai", E=128, k=4, H=2880, I=2880, bias=True, max_tokens=tokens)


@pytest.mark.parametrize("tokens", [1, 3, 16])
def test_gpt_oss_fp8_tma_tiles_match_the_pointer_tiles(tokens, monkeypatch):
    """GPT-OSS-120B's shape by TMA descriptor: K = 2880 ends in half a 128-column step (TMA's zero fill), I = 2880
    in half a 128-row tile (the tail reads the up rows, never stored); against the same tiles with pointer loads,
    the grouped GEMM and the reference."""
    p = gpt_oss_fp8(tokens)
    weights = weights_for(p)
    experts = TritonExperts(p)
    prepared = experts.prepare_weights(weights)
    d = dispatched_for(p, tokens)
    outs = {}
    for tma in (True, False):
        tile = replace(FP8_TMA_FINISH, tma=tma)
        monkeypatch.setattr("moe.experts.triton.fp8_decode_config", lambda m, *table: DecodeConfig(tile, tile))
        outs[tma] = run(experts, d, prepared).float().clone()
    monkeypatch.setattr("moe.experts.triton.uses_decode", lambda *a: False)
    grouped = run(experts, d, prepared).float()
    context = f"gpt-oss fp8_block tma decode M={tokens}"
    assert_close_moe(outs[True], outs[False], "bf16", context=context + " vs pointer loads")
    assert_close_moe(outs[True], grouped, "bf16", context=context + " vs grouped GEMM")
    assert_close_moe(outs[True], reference(p, d.x.data, d.topk, weights), regime_for(p), context=context + " vs reference")


def deepseek_slice_fp8(tokens):
    return problem("fp8_block", "silu", E=32, k=8, H=7168, I=2048, max_tokens=tokens)


@pytest.mark.parametrize("shape,tokens", [(qwen3, 1), (qwen3, 2), (qwen3, 3), (qwen3, 8), (qwen3, 12), (qwen3, 24),
                                          (gpt_oss_fp8, 1), (gpt_oss_fp8, 2), (gpt_oss_fp8, 3), (gpt_oss_fp8, 4),
                                          (gpt_oss_fp8, 8), (gpt_oss_fp8, 12), (gpt_oss_fp8, 24),
                                          (deepseek_slice_fp8, 3), (deepseek_slice_fp8, 5)])
def test_a_shapes_own_fp8_decode_entries_match_the_grouped_gemm(shape, tokens, monkeypatch):
    """The ``decode`` entries of this GPU's tables (the H200's: Qwen3-30B-A3B, GPT-OSS-120B, the DeepSeek-V3 EP8
    slice): a tiles entry against the grouped GEMM and the reference, a "grouped" entry the grouped GEMM's own
    output."""
    p = shape(tokens)
    weights = weights_for(p)
    experts = TritonExperts(p)
    prepared = experts.prepare_weights(weights)
    if not [m for m, _ in prepared.configs.decode if m <= tokens]:
        pytest.skip(f"no decode entry at M <= {tokens} in this GPU's table ({prepared.configs.key.device})")
    config = decode.fp8_decode_config(tokens, prepared.configs)
    d = dispatched_for(p, tokens)
    out = run(experts, d, prepared).float().clone()
    monkeypatch.setattr("moe.experts.triton.uses_decode", lambda *a: False)
    grouped = run(experts, d, prepared).float()
    context = f"{p.quant.weight.value} table decode entry M={tokens} {config}"
    if config is None:
        assert torch.equal(out, grouped), context
        return
    assert_close_moe(out, grouped, "bf16", context=context + " vs grouped GEMM")
    assert_close_moe(out, reference(p, d.x.data, d.topk, weights), regime_for(p), context=context + " vs reference")


@pytest.mark.parametrize("tile", [FP8_DOT_FINISH, FP8_TMA_FINISH], ids=["pointers", "tma"])
def test_fp8_finish_tiles_cuda_graph_replay_equals_eager(tile, monkeypatch):
    """One token on tensor-core tiles that finish their own split epilogue: the tickets are back at 0 after
    each launch, so every replay equals an eager call bit for bit."""
    monkeypatch.setattr("moe.experts.triton.fp8_decode_config", lambda m, *table: DecodeConfig(tile, tile))
    p = qwen3(1)
    experts = TritonExperts(p)
    prepared = experts.prepare_weights(weights_for(p))
    assert_replay_equals_eager_without_sync(experts, prepared, p, 1)
    assert int(prepared.decode_tickets.count_nonzero()) == 0


def weight_only_reference(p, d, weights):
    truth = WeightOnlyReferenceExperts(p)
    return (run(truth, d, truth.prepare_weights(weights)) * d.topk.weights.unsqueeze(-1)).sum(1).float()


def fp4_weights(p):
    """Random weights of an fp4 problem; NVFP4's block scales span e4m3's range (its global scale differs by expert)."""
    return weights_for(p, spread=(0.125, 128.0)) if p.quant.name == "nvfp4" else weights_for(p)


def assert_matches_fp4_reference(out, p, d, weights, context):
    """``out`` against the reference of an fp4 problem: NVFP4's weight-only one in bf16's regime, MXFP4's the usual."""
    if p.quant.name == "nvfp4":
        assert_close_moe(out.float(), weight_only_reference(p, d, weights), "bf16", context=context)
    else:
        assert_close_moe(out.float(), reference(p, d.x.data, d.topk, weights), regime_for(p), context=context)


def mma_case(p, tokens):
    """(weights, experts, prepared weights, dispatched input) of ``p`` at ``tokens``, where the MMA tiles can run."""
    weights = fp4_weights(p)
    experts = TritonExperts(p)
    prepared = experts.prepare_weights(weights)
    d = dispatched_for(p, tokens)
    assert decode.mma_ready(prepared, d.x.data)
    return weights, experts, prepared, d


def mma_problem(quant, tokens):
    """The MMA tiles' tests' problems: GPT-OSS-120B's MXFP4 shape, or a Qwen3-like NVFP4 one."""
    if quant == "mxfp4":
        return gpt_oss(tokens)
    return problem("nvfp4", "silu", E=128, k=8, H=2048, I=768, max_tokens=tokens)


@pytest.mark.parametrize("quant", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("tokens", [1, 3, 33, 64])
@pytest.mark.parametrize("tile", [MMA, MMA_FUSED, MMA_FINISH], ids=["splits", "fused", "finish"])
def test_unpredicated_mma_tiles_give_the_predicated_tiles_bits(quant, tokens, tile, monkeypatch):
    """`DecodeTile.unpredicated` changes how the weights are loaded, not what is summed: the steps an unrolled loop
    runs past a split's end (``finish``: 45 K blocks in 8 splits of 6, loaded 4 at a time) re-read the split's last
    weights against zero activations, where the predicated loads read zeros."""
    _, experts, prepared, d = mma_case(mma_problem(quant, tokens), tokens)
    outs = []
    for t in (tile, replace(tile, unpredicated=True)):
        monkeypatch.setattr("moe.experts.triton.decode_config", lambda m, *table, t=t: DecodeConfig(t, t))
        outs.append(run(experts, d, prepared).float().clone())
    assert torch.equal(outs[0], outs[1]), (outs[0] - outs[1]).abs().max()


def unpredicated_entries():
    """(table file, M, entry) of every shipped table's decode entry with an `unpredicated` tile, on any GPU."""
    found = []
    for path in sorted(CONFIG_DIR.glob("*.json")):
        data = json.loads(path.read_text())
        for m, entry in ConfigTable.from_json(ConfigKey(**data["key"]), data).decode:
            if entry in ("default", "grouped"):
                continue
            config = decode.table_decode_config(entry)
            if config.gemm1.unpredicated or config.gemm2.unpredicated:
                found.append((path.name, m, entry))
    return found


@pytest.mark.parametrize("name, tokens, entry", unpredicated_entries(), ids=lambda v: str(v)[:40])
def test_the_tables_unpredicated_entries_give_the_predicated_tiles_bits(name, tokens, entry, monkeypatch):
    """The shipped entries that load their weights unpredicated (the H200's GPT-OSS-120B MXFP4 / NVFP4 at one token),
    forced on whatever SM90 runs this: the same bits as the same tiles predicated, and the reference."""
    config = decode.table_decode_config(entry)
    plain = DecodeConfig(replace(config.gemm1, unpredicated=False), replace(config.gemm2, unpredicated=False))
    key = json.loads((CONFIG_DIR / name).read_text())["key"]
    p = problem(key["scheme"], key["activation"], E=key["num_experts"], k=key["top_k"], H=key["hidden_size"],
                I=key["intermediate_size"], bias=key["activation"] == "swiglu_oai", max_tokens=tokens)
    weights, experts, prepared, d = mma_case(p, tokens)
    outs = []
    for chosen in (config, plain):
        monkeypatch.setattr("moe.experts.triton.decode_config", lambda m, *table, c=chosen: c)
        outs.append(run(experts, d, prepared).float().clone())
    assert torch.equal(outs[0], outs[1]), (outs[0] - outs[1]).abs().max()
    assert_matches_fp4_reference(outs[0], p, d, weights, f"{name} M={tokens}")


@pytest.mark.parametrize("quant", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("tokens", [1, 3, 33, 64])
@pytest.mark.parametrize("tiles", [(MMA, MMA), (MMA_FUSED, MMA_FUSED), (MMA_FINISH, MMA_FINISH)],
                         ids=["splits", "fused", "finish"])
def test_mma_tiles_match_reference(quant, tokens, tiles, monkeypatch):
    """The MMA-fragment tiles (`_decode_mma`): GPT-OSS-120B's MXFP4 shape and a Qwen3-like NVFP4 one (8 of 128
    experts: at 33 and 64 tokens some experts take more than the MMA's 8 tokens, some none), against the
    reference; the NVFP4 block scales over e4m3's range. ``finish`` tiles (K steps of 64 loaded 4 at a time, past
    the splits' ends too) run a program per slot at every M and apply the split epilogue themselves: from 33 tokens
    several programs read one expert's weights."""
    monkeypatch.setattr("moe.experts.triton.decode_config", lambda m, *table: DecodeConfig(*tiles))
    p = mma_problem(quant, tokens)
    weights, experts, prepared, d = mma_case(p, tokens)
    assert_matches_fp4_reference(run(experts, d, prepared), p, d, weights, f"mma {quant} M={tokens}")


@pytest.mark.parametrize("quant", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("shape", ["qwen3", "gpt-oss"])
def test_a_shapes_own_weight_only_decode_entries_match_the_grouped_gemm(shape, quant):
    """Every tiles entry of this GPU's weight-only tables' ``decode`` sections (the H200's: Qwen3-30B-A3B and
    GPT-OSS-120B, MXFP4 and NVFP4, at one token; programs per slot at two, Qwen3's up to eight, GPT-OSS's at eight and
    nine; Qwen3's per expert at nine to thirteen): at its M, against the grouped GEMM and the reference, and CUDA-graph
    replay equal to eager."""
    def shaped(tokens):
        if shape == "qwen3":
            return problem(quant, "silu", E=128, k=8, H=2048, I=768, max_tokens=tokens)
        return problem(quant, "swiglu_oai", E=128, k=4, H=2880, I=2880, bias=True, max_tokens=tokens)

    p = shaped(64)
    weights = fp4_weights(p)
    experts = TritonExperts(p)
    prepared = experts.prepare_weights(weights)
    entries = [(m, entry) for m, entry in prepared.configs.decode if entry not in ("default", "grouped")]
    assert all(m <= p.max_tokens for m, _ in entries), entries
    if not entries:
        pytest.skip(f"no decode tiles entry in this GPU's table ({prepared.configs.key.device})")
    for tokens, entry in entries:
        config = decode.decode_config(tokens * p.top_k / p.local_num_experts, tokens, prepared.configs)
        want = decode.table_decode_config(entry)
        d = dispatched_for(p, tokens)
        assert decode.mma_ready(prepared, d.x.data) and config.uses_mma
        assert (config.gemm1, config.gemm2) == (want.gemm1, want.gemm2)
        out = run(experts, d, prepared).float().clone()
        context = f"{quant} {shape} table decode entry M={tokens} {config}"
        assert_matches_fp4_reference(out, p, d, weights, context + " vs reference")
        assert_replay_equals_eager_without_sync(experts, prepared, p, tokens)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("moe.experts.triton.uses_decode", lambda *a: False)
            grouped = run(experts, d, prepared).float()
        assert_close_moe(out, grouped, "bf16", context=context + " vs grouped GEMM")


@pytest.mark.parametrize("tokens, tile", [(16, MMA), (1, MMA_FINISH), (3, MMA_FINISH),
                                          (1, replace(MMA_FINISH, unpredicated=True))],
                         ids=["splits", "finish", "finish-per-slot", "finish-unpredicated"])
def test_mma_tiles_cuda_graph_replay_equals_eager(tokens, tile, monkeypatch):
    monkeypatch.setattr("moe.experts.triton.decode_config", lambda m, *table: DecodeConfig(tile, tile))
    p = gpt_oss(tokens)
    experts = TritonExperts(p)
    prepared = experts.prepare_weights(weights_for(p))
    assert_replay_equals_eager_without_sync(experts, prepared, p, tokens)


def test_mma_tiles_refuse_weights_without_fragments(monkeypatch):
    monkeypatch.setattr("moe.experts.triton.decode_config", lambda m, *table: DecodeConfig(MMA, MMA))
    p = gpt_oss(1)
    experts = TritonExperts(p)
    prepared = experts.prepare_weights(weights_for(p))
    bare = replace(prepared, w13=replace(prepared.w13, fragments=None))
    with pytest.raises(Exception, match="mma=True tiles need fp4 weights prepared with their MMA fragments"):
        run(experts, dispatched_for(p, 1), bare)


def test_the_mma_tiles_nvfp4_scale_pairs_are_exact_for_every_e4m3_byte():
    """`_decode_mma`'s PTX builds each NVFP4 scale's biased bf16x2 pair from the e4m3 byte with bit operations and
    two bf16 fmas by 2**119, the first on a bfloat16 subnormal where e4m3's is: on the GPU, every one of the 256
    bytes (four to a word, as the kernel loads them) gives `e4m3_bf16_biased`'s value in both halves."""
    import triton
    import triton.language as tl

    from moe.experts._triton._decode_mma import _e4m3_pairs_ptx
    from tests.test_nvfp4_asm import biased_scales

    asm = ("{\n.reg .b32 x, negz, two119;\nmov.b32 negz, 0x80008000;\nmov.b32 two119, 0x7B007B00;\n"
           + _e4m3_pairs_ptx("$4", ("$0", "$1", "$2", "$3")) + "}")

    @triton.jit
    def pairs_kernel(words_ptr, out_ptr, ASM: tl.constexpr):
        i = tl.arange(0, 64)
        p0, p1, p2, p3 = tl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,r", [tl.load(words_ptr + i)],
                                                   dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True,
                                                   pack=1)
        tl.store(out_ptr + i * 4, p0)
        tl.store(out_ptr + i * 4 + 1, p1)
        tl.store(out_ptr + i * 4 + 2, p2)
        tl.store(out_ptr + i * 4 + 3, p3)

    words = torch.arange(256, dtype=torch.uint8).view(torch.int32).cuda()  # byte k of word w: 4w + k
    out = torch.empty(256, dtype=torch.int32, device="cuda")
    pairs_kernel[(1,)](words, out, ASM=asm)
    halves = out.cpu().view(torch.bfloat16).view(256, 2)
    want = biased_scales()
    assert torch.equal(halves[:, 0].view(torch.int16), want.view(torch.int16))
    assert torch.equal(halves[:, 1].view(torch.int16), want.view(torch.int16))
