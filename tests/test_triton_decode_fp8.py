"""The fp8 W8A8 decode path of the Triton experts (`_triton/decode.py`, K loop in `_triton/_decode_fp8.py`),
128-block (fp8_block) and per-token (fp8_token), in Triton's CPU interpreter: against the grouped-GEMM path
of the same scheme and the reference experts (one token, ragged token counts, experts hit 0, 1 or many
times, an expert map, K not a multiple of 128, N tiles whose up rows straddle two weight-scale blocks,
bias, gated and not, FMA and tensor-core programs, split-K), which path runs at which M, and that the
in-loop activation quantization gives `quantize_fp8_rows`' codes and scales bit for bit."""

import os
import shutil
import dataclasses
from types import SimpleNamespace

if not shutil.which("nvidia-smi"):  # a CPU machine: the interpreter, before triton decorates any kernel
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("CPU-interpreter tests; on a GPU, tests/gpu/test_triton_decode_gpu.py runs", allow_module_level=True)

from moe.errors import MoEConfigError  # noqa: E402
from moe.experts._triton import decode  # noqa: E402
from moe.experts._triton.decode import DecodeConfig, DecodeTile  # noqa: E402
from moe.experts._triton.rows import quantize_fp8_rows  # noqa: E402
from moe.experts._triton.weights import WeightOperand  # noqa: E402
from moe.experts.triton import TritonExperts  # noqa: E402
from moe.formats import ActivationFormat, Dispatched, DispatchShape  # noqa: E402
from moe.quant import QuantFormat, QuantizedTensor  # noqa: E402
from moe.testing.tolerance import assert_close_moe, regime_for  # noqa: E402
from tests.test_triton import make_problem, make_weights, reference_reduced, run_experts  # noqa: E402
from tests.test_triton_decode import routed  # noqa: E402

FMA = DecodeTile(block_n=16, block_k=128, splits=3, block_m=2, dot=False)
FMA_PIECES = DecodeTile(block_n=32, block_k=32, splits=1, block_m=4, dot=False)  # a group in 4 pieces, fused
DOT = DecodeTile(block_n=16, block_k=64, splits=2, block_m=16, dot=True)
DOT_ONE_SPLIT = DecodeTile(block_n=32, block_k=128, splits=1, block_m=16, dot=True)


def dispatched_for(x, topk):
    return Dispatched(ActivationFormat.STANDARD, QuantizedTensor(data=x, scale=None, fmt="none"), topk)


def run_both(p, num_tokens, config, monkeypatch, hot=False, dtype=torch.float16):
    """(decode output, grouped-GEMM output, reference) for one routing; asserts the decode path ran."""
    monkeypatch.undo()  # a previous call's patches (the grouped path's last)
    monkeypatch.setattr("moe.experts.triton.fp8_decode_config", lambda m, *table: config)
    called = []
    real = decode.decode_experts
    monkeypatch.setattr("moe.experts.triton.decode_experts", lambda *a: called.append(1) or real(*a))
    weights = make_weights(p)
    x = torch.randn(num_tokens, p.hidden_size).to(dtype)
    topk = routed(num_tokens, p, hot)
    out = run_experts(TritonExperts(p), dispatched_for(x, topk), weights).out.float().clone()
    assert called == [1]  # the decode path ran
    monkeypatch.setattr("moe.experts.triton.uses_decode", lambda *a: False)
    grouped = run_experts(TritonExperts(p), dispatched_for(x, topk), weights).out.float()
    assert called == [1]  # and the grouped GEMM the second time
    return out, grouped, reference_reduced(p, x, topk, weights)


def check(p, num_tokens, config, monkeypatch, hot=False, dtype=torch.float16):
    """The decode path against the grouped GEMM (the same quantized operands: only the fp32 summation
    order and the intermediate's rounding differ, so within fp16's bound) and the reference."""
    out, grouped, ref = run_both(p, num_tokens, config, monkeypatch, hot, dtype)
    context = f"fp8_block decode M={num_tokens} {config}"
    assert_close_moe(out, grouped, "fp16", context=context + " vs grouped GEMM")
    assert_close_moe(out, ref, regime_for(p), context=context + " vs reference")


def qwen_like(quant="fp8_block", **kw):
    """Small (the interpreter runs every program): H = 160 (K of gemm1 = 128 + 32, a ragged group),
    I = 96 (gemm1's up rows 96..191 straddle the weight-scale blocks 0 and 1)."""
    args = dict(E=8, k=4, H=160, I=96, bias=True, max_tokens=64)
    args.update(kw)
    return make_problem(quant, "swiglu_oai", **args)


TILE_MIXES = {"fma": (FMA, FMA_PIECES), "dot-gemm1": (DOT, FMA), "dot-gemm2": (FMA_PIECES, DOT_ONE_SPLIT)}


# every mix at M = 1 and 3; M = 9 (many row chunks: the interpreter's slowest) once here, the tensor cores at 33 in the fp8_token test
@pytest.mark.parametrize("num_tokens,mix", [(m, mix) for mix in TILE_MIXES for m in (1, 3)] + [(9, "fma")])
def test_fp8_decode_matches_grouped_gemm_and_reference(num_tokens, mix, monkeypatch):
    """M = 1 (a program group per slot, experts hit 0 or 1 times), 3 and 9 (36 slots grouped by expert,
    ragged counts: 36 distinct-per-token slots on 8 experts put >= 5 on some expert, more than the FMA
    tiles' 2 and 4 rows, so its programs loop over several row chunks, the last one partial or full)."""
    tiles = TILE_MIXES[mix]
    check(qwen_like(), num_tokens, DecodeConfig(*tiles), monkeypatch)


@pytest.mark.parametrize("num_tokens,tiles", [(1, (FMA, DOT)), (33, (DOT_ONE_SPLIT, FMA_PIECES))],
                         ids=["fma-dot-1", "dot-fma-33"])
def test_fp8_token_decode_matches_grouped_gemm_and_reference(num_tokens, tiles, monkeypatch):
    """Per-token fp8 (a scale per row from all of K, a weight scale per channel): the same kernels."""
    check(qwen_like("fp8_token"), num_tokens, DecodeConfig(*tiles), monkeypatch)


def test_fp8_decode_one_expert_many_times(monkeypatch):
    """17 tokens all on experts 0 and 1: 17 slots per expert (a chunk of 16 rows and a ragged one of 1 for
    the tensor cores, 8 of 2 and a ragged one of 1 for the FMAs), 6 experts idle."""
    check(qwen_like(k=2), 17, DecodeConfig(DOT, FMA), monkeypatch, hot=True)


@pytest.mark.parametrize("quant", ["fp8_block", "fp8_token"])
def test_fp8_decode_expert_map_fp32(quant, monkeypatch):
    """3 local experts of 8 (-1 elsewhere: those slots contribute nothing), float32 activations, K = 200
    and 72 (neither a multiple of 128), silu without bias."""
    p = make_problem(quant, "silu", E=8, k=3, H=200, I=72, dtype=torch.float32,
                     expert_map=(-1, 0, -1, -1, 1, -1, 2, -1))
    for tokens, tiles in ((1, (FMA, DOT)), (5, (DOT_ONE_SPLIT, FMA_PIECES))):
        check(p, tokens, DecodeConfig(*tiles), monkeypatch, dtype=torch.float32)


def test_fp8_decode_non_gated(monkeypatch):
    """relu2 (w13 has I rows, no up half), K = 256 (whole groups: the unmasked loads), with and without bias."""
    for bias in (False, True):
        p = make_problem("fp8_block", "relu2", E=8, k=2, H=256, I=128, bias=bias)
        check(p, 3, DecodeConfig(FMA_PIECES, DOT), monkeypatch)


def test_fp8_decode_default_configs(monkeypatch):
    """The shipped per-M configs (the M = 1 and 2 buckets; 40 tokens take the latter) run and agree."""
    p = qwen_like(k=2)
    for tokens in (1, 2, 40):
        check(p, tokens, decode.fp8_decode_config(tokens), monkeypatch)


def test_fp8_decode_path_taken_by_slot_count(monkeypatch):
    """fp8_block W8A8 takes the decode kernels up to DECODE_MAX_SLOTS slots and the grouped GEMM above."""
    p = make_problem("fp8_block", "silu", E=8, k=4, H=64, I=64, max_tokens=80)
    weights = make_weights(p)
    calls = []
    real = decode.decode_experts
    monkeypatch.setattr("moe.experts.triton.decode_experts", lambda *a: calls.append(a[1].shape[0]) or real(*a))
    for tokens in (1, 64, 65):  # 4, 256 and 260 slots
        x = torch.randn(tokens, p.hidden_size).half()
        topk = routed(tokens, p)
        out = run_experts(TritonExperts(p), dispatched_for(x, topk), weights).out
        assert_close_moe(out.float(), reference_reduced(p, x, topk, weights), regime_for(p), context=f"M={tokens}")
    assert calls == [1, 64]


def test_fp8_weight_only_mode_keeps_the_grouped_gemm():
    """fp8 weights read with unquantized activations (GPUs without fp8 tensor cores) are not decode's, nor
    per-tensor fp8; fp8_block and fp8_token W8A8 are, and declare the partial-sum workspace."""
    for fmt in (QuantFormat.FP8_BLOCK, QuantFormat.FP8_ROW):
        assert decode.decodes(fmt, fmt) and not decode.decodes(fmt, QuantFormat.NONE)
    assert not decode.decodes(QuantFormat.FP8_TENSOR, QuantFormat.FP8_TENSOR)
    shapes = TritonExperts(make_problem("fp8_block")).workspace_shapes(DispatchShape(ActivationFormat.STANDARD, 4))
    assert {"decode_part1", "decode_part2"} <= {name for name, _ in shapes.buffers}


def test_fp8_decode_rejects_a_block_k_not_dividing_the_group(monkeypatch):
    monkeypatch.setattr("moe.experts.triton.fp8_decode_config",
                        lambda m, *table: DecodeConfig(DecodeTile(16, 96, 2, 1, dot=False), FMA))
    p = make_problem("fp8_block")
    x = torch.randn(1, p.hidden_size).half()
    with pytest.raises(MoEConfigError, match="block_k dividing the 128-column K step.*got 96"):
        run_experts(TritonExperts(p), dispatched_for(x, routed(1, p)), make_weights(p))


@pytest.mark.parametrize("fmt", [QuantFormat.FP8_BLOCK, QuantFormat.FP8_ROW])
@pytest.mark.parametrize("tile", [FMA, FMA_PIECES, DOT], ids=["fma", "fma-pieces", "dot"])
def test_fp8_decode_quantizes_activations_as_quantize_fp8_rows(tile, fmt):
    """Identity weights (e4m3 1.0, scales 1.0): the GEMM's output column n is row j's dequantized
    activation q[j, n] * its scale (fp8_block: scale[j, n // 128]; fp8_token: scale[j]) -- one rounding,
    the same in both -- so it must equal what `quantize_fp8_rows` stores, bit for bit. K = 200: a whole
    group and a ragged last one (72 columns); rows of very different magnitudes, an all-zero group (scale 1),
    values on e4m3 ties."""
    k, experts = 200, 4
    x = torch.randn(experts, k) * torch.tensor([1e-3, 1.0, 30.0, 500.0])[:, None]
    x[1, :128] = 0.0
    x[2, :8] = torch.tensor([1.0625, 1.1875, -3.25, 448.0, 0.001953125, 2**-9 * 3, 1.03125, -1.09375])
    x = x.half()
    block = fmt is QuantFormat.FP8_BLOCK
    w = WeightOperand(torch.eye(k).expand(experts, k, k).to(torch.float8_e4m3fn).contiguous(),
                      torch.ones((experts, 2, 2) if block else (experts, k, 1)), None, fmt)
    ids = torch.arange(experts, dtype=torch.int32)[None, :]  # one token, slot j on expert j
    routing = decode._routing(ids, SimpleNamespace(expert_map=None), experts, None)  # one token: no alignment
    part = torch.full((tile.splits, experts, k), float("nan"))
    decode._gemm(x, w, None, part, routing, None, 1, tile, False)  # A_ROW_DIV 1: slot j reads row j
    got = part.sum(0)
    q, scale = torch.empty(experts, k, dtype=torch.float8_e4m3fn), torch.empty(experts, 2 if block else 1)
    quantize_fp8_rows(x, fmt, q, scale, torch.empty(1))
    want = q.float() * (scale.repeat_interleave(128, 1)[:, :k] if block else scale)
    assert torch.equal(got, want)
    assert scale[0, 0] < 1e-5 and scale[3, 0] > 0.5  # the case covers what it claims
    assert not block or scale[1, 0] == 1.0


TMA_TILES = {
    # H = 160: GEMM1's second K step is 32 columns (TMA's zero fill past K); I = 96: GEMM1's N tiles of 32, the
    # up rows 96 further in the descriptor's rows; GEMM2 a 64-column tile past its 160 rows (the next expert's)
    "one-split": DecodeConfig(DecodeTile(32, 128, 1, 16, dot=True, tma=True),
                              DecodeTile(64, 128, 1, 16, dot=True, tma=True)),
    # a 128-column step in two 64-column descriptor loads, two K splits, finishing tiles
    "pieces-finish": DecodeConfig(DecodeTile(32, 64, 2, 16, dot=True, finish=True, tma=True),
                                  DecodeTile(32, 64, 2, 16, dot=True, finish=True, tma=True)),
}


@pytest.mark.parametrize("quant", ["fp8_block", "fp8_token"])
@pytest.mark.parametrize("name", list(TMA_TILES))
@pytest.mark.parametrize("num_tokens", [1, 3])
def test_fp8_decode_tma_tiles_equal_the_pointer_tiles(quant, name, num_tokens, monkeypatch):
    """``tma=True`` tiles load the weights by descriptor: the same tiles with pointer loads give the same bits
    (every product and sum is the same; only the loads differ), and both agree with the reference."""
    config = TMA_TILES[name]
    pointers = DecodeConfig(*(dataclasses.replace(t, tma=False) for t in (config.gemm1, config.gemm2)))
    p = qwen_like(quant)
    torch.manual_seed(num_tokens)
    by_tma, _, ref = run_both(p, num_tokens, config, monkeypatch)
    torch.manual_seed(num_tokens)
    by_pointers, _, _ = run_both(p, num_tokens, pointers, monkeypatch)
    assert torch.equal(by_tma, by_pointers)
    assert_close_moe(by_tma, ref, regime_for(p), context=f"{quant} tma decode M={num_tokens} {name}")


def test_fp8_decode_tma_tiles_reject_what_they_cannot_load(monkeypatch):
    """A TMA decode tile is a tensor-core tile of fp8 W8A8 weights: an FMA or MMA one, or fp4 weights, is refused
    with the reason."""
    with pytest.raises(MoEConfigError, match="tma=True decode tiles are tensor-core tiles.*dot=False"):
        DecodeTile(32, 128, 1, 1, dot=False, tma=True)
    w = WeightOperand(torch.zeros(2, 64, 16, dtype=torch.uint8), torch.zeros(2, 64, 1, dtype=torch.uint8), None,
                      QuantFormat.MXFP4)
    with pytest.raises(MoEConfigError, match="tma=True decode tiles run fp8 W8A8 weights.*got mxfp4"):
        decode._check_tma(torch.zeros(1, 32), w)
