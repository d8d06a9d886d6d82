"""The decode path (`_triton/decode.py`) on a CUDA GPU, bfloat16. MXFP4 W4A16: GPT-OSS-120B's real
shape at M = 1, 16, 64 against the reference experts, both dequantizations (packed bf16x2 PTX and
float32 math) and both program kinds. fp8_block and fp8_token W8A8: Qwen3-30B-A3B's shape at M = 1, 4,
16, 64 against the grouped-GEMM path of the scheme and the reference, the default configs and both program
kinds. Both:
CUDA-graph replay bit-equal to eager, no host sync."""

from __future__ import annotations

import pytest
import torch

from moe.experts._triton import decode
from moe.experts._triton.decode import DecodeConfig, DecodeTile
from moe.formats import ActivationFormat, Dispatched
from moe.quant import QuantizedTensor
from tests.gpu.test_triton_gpu import (assert_replay_equals_eager_without_sync, problem, reference, run,
                                      topk_for, weights_for)
from moe.experts.triton import TritonExperts
from moe.testing.tolerance import assert_close_moe, regime_for

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

FMA = DecodeTile(32, 128, 2, 2, dot=False)
DOT = DecodeTile(64, 128, 2, 16, dot=True)
DOT_ONE_SPLIT = DecodeTile(32, 256, 1, 16, dot=True, asm=False)


def gpt_oss(tokens):
    return problem("mxfp4", "swiglu_oai", E=128, k=4, H=2880, I=2880, bias=True, max_tokens=tokens)


def dispatched_for(p, tokens):
    x = torch.randn(tokens, p.hidden_size, device="cuda", dtype=p.dtype)
    topk = topk_for(p, tokens)
    return Dispatched(ActivationFormat.STANDARD, QuantizedTensor(data=x, scale=None, fmt="none"), topk)


@pytest.mark.parametrize("tokens", [1, 16, 64])
@pytest.mark.parametrize("tiles", [(FMA, DOT), (DOT, FMA), (DOT_ONE_SPLIT, DOT_ONE_SPLIT)], ids=["fma", "dot", "f32-dequant"])
def test_gpt_oss_decode_matches_reference(tokens, tiles, monkeypatch):
    monkeypatch.setattr("moe.experts.triton.decode_config", lambda m: DecodeConfig(*tiles))
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
    outs = []
    for asm in (True, False):
        tile = DecodeTile(32, 128, 1, 16, dot=True, asm=asm)
        monkeypatch.setattr("moe.experts.triton.decode_config", lambda m, t=tile: DecodeConfig(t, t))
        outs.append(run(experts, d, prepared).clone())
    assert torch.equal(outs[0], outs[1])


def qwen3(tokens, quant="fp8_block"):
    return problem(quant, "silu", E=128, k=8, H=2048, I=768, max_tokens=tokens)


@pytest.mark.parametrize("tokens", [1, 64])
@pytest.mark.parametrize("shape", [gpt_oss, qwen3], ids=["gpt-oss-mxfp4", "qwen3-fp8-block"])
def test_decode_cuda_graph_replay_equals_eager(tokens, shape):
    p = shape(tokens)
    experts = TritonExperts(p)
    prepared = experts.prepare_weights(weights_for(p))
    assert decode.uses_decode(prepared, p.quant.activation, tokens * p.top_k)
    assert_replay_equals_eager_without_sync(experts, prepared, p, tokens)


# --- fp8 128-block W8A8 ---------------------------------------------------------------------------

FP8_FMA = DecodeTile(32, 64, 2, 4, dot=False, asm=False)
FP8_DOT = DecodeTile(64, 128, 2, 16, dot=True, asm=False)


@pytest.mark.parametrize("tokens", [1, 4, 16, 64])
@pytest.mark.parametrize("tiles", [None, (FP8_FMA, FP8_DOT), (FP8_DOT, FP8_FMA)], ids=["default", "fma", "dot"])
@pytest.mark.parametrize("quant", ["fp8_block", "fp8_token"])
def test_qwen3_fp8_decode_matches_grouped_gemm_and_reference(quant, tokens, tiles, monkeypatch):
    """The decode kernels against the grouped GEMM on the same quantized operands (the activation codes
    and scales are the same; only the fp32 summation order and the bf16 intermediate's rounding differ:
    within bf16's bound) and against the reference experts (fp8's)."""
    if tiles is not None:
        monkeypatch.setattr("moe.experts.triton.fp8_decode_config", lambda m: DecodeConfig(*tiles))
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

