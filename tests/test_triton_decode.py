"""The MXFP4 / NVFP4 W4A16 decode path of the Triton experts (`_triton/decode.py`) in Triton's CPU
interpreter, against the reference experts: one token (a group per slot), several tokens (slots
grouped by expert: experts hit 0, 1 or many times), split-K and the fused single-split epilogue,
tensor-core and FMA programs, ragged K, biases, swiglu_oai, an expert map."""

import os
import shutil
from dataclasses import replace

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
from moe.experts.triton import TritonExperts  # noqa: E402
from moe.formats import ActivationFormat, Dispatched  # noqa: E402
from moe.quant import QuantFormat, QuantizedTensor  # noqa: E402
from moe.router import TopK  # noqa: E402
from moe.testing.tolerance import assert_close_moe, regime_for  # noqa: E402
from tests.test_triton import make_problem, make_weights, reference_reduced, run_experts  # noqa: E402

FMA = DecodeTile(block_n=32, block_k=64, splits=3, block_m=1, dot=False)  # fp4 FMA tiles: one row at a time
DOT = DecodeTile(block_n=16, block_k=128, splits=1, block_m=16, dot=True)
DOT_SPLIT = DecodeTile(block_n=32, block_k=64, splits=2, block_m=16, dot=True)


def routed(num_tokens, p, hot=False):
    """Top-k ids: random distinct experts per token; ``hot``: every token on experts 0..k-1 (one
    expert many times, most experts 0 times)."""
    if hot:
        ids = torch.arange(p.top_k).repeat(num_tokens, 1).int()
    else:
        ids = torch.stack([torch.randperm(p.num_experts)[: p.top_k] for _ in range(num_tokens)]).int()
    return TopK(ids, torch.rand(num_tokens, p.top_k))


def check(p, num_tokens, config, monkeypatch, hot=False, dtype=torch.float16):
    monkeypatch.setattr(decode, "decode_config", lambda m, *table: config)
    called = []
    real = decode.decode_experts
    monkeypatch.setattr("moe.experts.triton.decode_experts", lambda *a: called.append(1) or real(*a))
    monkeypatch.setattr("moe.experts.triton.decode_config", lambda m, *table: config)
    weights = make_weights(p)
    x = torch.randn(num_tokens, p.hidden_size).to(dtype)
    topk = routed(num_tokens, p, hot)
    dispatched = Dispatched(ActivationFormat.STANDARD, QuantizedTensor(data=x, scale=None, fmt="none"), topk)
    out = run_experts(TritonExperts(p), dispatched, weights).out
    assert called == [1]  # the decode path ran
    ref = reference_reduced(p, x, topk, weights)
    assert_close_moe(out.float(), ref, regime_for(p), context=f"decode M={num_tokens} {config}")


def gpt_oss_like(**kw):
    args = dict(E=8, k=4, H=64, I=96, bias=True, max_tokens=64)  # small: the interpreter runs every program
    args.update(kw)
    return make_problem("mxfp4", "swiglu_oai", **args)


# M = 5: 20 distinct-per-token slots on 8 experts put >= 3 on some expert, so the FMA programs (a row at a time)
# loop over several rows; the tensor-core tiles' 16 rows hold any count <= M
@pytest.mark.parametrize("num_tokens", [1, 3, 5])
@pytest.mark.parametrize("tiles", [(FMA, FMA), (DOT, DOT_SPLIT), (DOT_SPLIT, DOT)], ids=["fma", "dot", "dot-split"])
def test_decode_matches_reference(num_tokens, tiles, monkeypatch):
    check(gpt_oss_like(), num_tokens, DecodeConfig(*tiles), monkeypatch)


@pytest.mark.parametrize("tiles", [(FMA, DOT_SPLIT), (DOT, FMA)], ids=["fma", "dot"])
def test_decode_one_expert_many_times(tiles, monkeypatch):
    """17 tokens all on experts 0 and 1: 17 slots per expert (a chunk of 16 rows and a ragged one of 1 for
    the tensor cores, 17 single rows for the FMAs), 6 experts idle."""
    check(gpt_oss_like(k=2), 17, DecodeConfig(*tiles), monkeypatch, hot=True)


def test_decode_ragged_k_expert_map_fp32(monkeypatch):
    """K = 160 and 96 (not multiples of BLOCK_K = 64/128), 3 local experts of 8, float32."""
    p = make_problem("mxfp4", "swiglu_oai", E=8, k=3, H=160, I=96, bias=True, dtype=torch.float32,
                     expert_map=(-1, 0, -1, -1, 1, -1, 2, -1))
    for tokens in (1, 5):
        check(p, tokens, DecodeConfig(FMA, DOT_SPLIT), monkeypatch, dtype=torch.float32)


def test_decode_non_gated_without_bias(monkeypatch):
    check(make_problem("mxfp4", "relu2", E=8, k=2, H=64, I=96), 3, DecodeConfig(DOT_SPLIT, FMA), monkeypatch)


ALIGN_KERNELS = {"align_fused_kernel", "rank_kernel", "place_kernel"}


def check_finishing(p, tile, num_tokens, want_epilogues, monkeypatch, hot=False):
    """Under ``tile`` with ``finish=True``: the epilogue launches that run are ``want_epilogues`` (the last
    program to store a row's partial sums applies the rest, `_decode._finish_if_last`), the tickets are all 0
    afterwards, and the output has the same bits as with both epilogue launches (the weights without
    tickets, and ``tile`` itself, finish=False); returns the kernels the finishing run and the finish=False one
    launched."""
    from moe.formats import DispatchShape
    from moe.testing.triton_launches import record_launches
    from moe.workspace import WorkspaceManager

    finishing = replace(tile, finish=True)
    config = DecodeConfig(finishing, finishing)
    for lookup in ("decode_config", "fp8_decode_config"):
        monkeypatch.setattr(f"moe.experts.triton.{lookup}", lambda m, *table: config)
    experts = TritonExperts(p)
    prepared = experts.prepare_weights(make_weights(p))
    assert prepared.decode_tickets is not None and prepared.decode_tickets.dtype == torch.int32
    x = torch.randn(num_tokens, p.hidden_size).to(torch.float16)
    dispatched = Dispatched(ActivationFormat.STANDARD, QuantizedTensor(data=x, scale=None, fmt="none"),
                            routed(num_tokens, p, hot))

    def run(weights):
        shapes = experts.workspace_shapes(DispatchShape(dispatched.format, dispatched.num_rows))
        with record_launches() as launched:
            out = experts.apply(dispatched, weights, WorkspaceManager().take(shapes, experts.name)).out.clone()
        return out, {r.kernel for r in launched}

    epilogues = {"activate_splits_kernel", "combine_splits_kernel"}
    finished, kernels = run(prepared)
    assert kernels & epilogues == want_epilogues
    assert int(prepared.decode_tickets.count_nonzero()) == 0
    launched, kernels = run(replace(prepared, decode_tickets=None))
    assert epilogues <= kernels
    assert torch.equal(finished, launched)
    for lookup in ("decode_config", "fp8_decode_config"):
        monkeypatch.setattr(f"moe.experts.triton.{lookup}", lambda m, *table: DecodeConfig(tile, tile))  # finish=False
    unfinished, plain = run(prepared)
    assert epilogues <= plain
    assert torch.equal(unfinished, finished)
    return kernels, plain


# 3 tokens: 12 distinct-per-token slots on 8 experts put >= 2 on some expert (a program group of several rows)
@pytest.mark.parametrize("num_tokens,expert_map", [(1, None), (3, None), (3, (-1, 0, 1, -1, 2, 3, -1, 4))],
                         ids=["one-token", "grouped", "expert-map"])
def test_fma_tiles_finish_their_own_epilogue(num_tokens, expert_map, monkeypatch):
    """Split-K FMA tiles (one row per program) finish their own epilogue at any M, so neither epilogue launch
    runs -- but GEMM2's with an expert map: a token may have no expert here."""
    want = {"combine_splits_kernel"} if expert_map else set()
    check_finishing(gpt_oss_like(expert_map=expert_map), FMA, num_tokens, want, monkeypatch)


@pytest.mark.parametrize("quant", ["mxfp4", "fp8_block"])
@pytest.mark.parametrize("num_tokens,hot", [(1, False), (2, False), (3, True)], ids=["one-token", "two", "shared"])
def test_tensor_core_tiles_that_finish_take_a_program_per_slot(quant, num_tokens, hot, monkeypatch):
    """Split-K tensor-core tiles (16 rows) that finish their own epilogue run a program per slot at any M
    (`DecodeConfig.per_slot`): no alignment launch and no epilogue launch, the same bits as the programs per
    expert the same tiles run without ``finish`` (alignment, both epilogue launches) -- ``shared``: 3 tokens on the
    same 4 experts, each expert's weights read by 3 programs."""
    p = make_problem(quant, "swiglu_oai", E=8, k=4, H=256 if quant == "fp8_block" else 64, I=96, bias=True,
                     max_tokens=64)
    finished, plain = check_finishing(p, DOT_SPLIT, num_tokens, set(), monkeypatch, hot)
    assert not finished & ALIGN_KERNELS
    assert bool(plain & ALIGN_KERNELS) is (num_tokens > 1)  # one token never aligns


def test_a_program_per_slot_with_an_expert_map(monkeypatch):
    """Finishing tensor-core tiles with an expert map: GEMM1 finishes per slot, GEMM2's combine launch still runs
    (a token may have no expert here), and slots on other ranks' experts are skipped."""
    p = make_problem("mxfp4", "swiglu_oai", E=8, k=4, H=64, I=96, bias=True, max_tokens=64,
                     expert_map=(-1, 0, 1, -1, 2, 3, -1, 4))
    finished, _ = check_finishing(p, DOT_SPLIT, 3, {"combine_splits_kernel"}, monkeypatch)
    assert not finished & ALIGN_KERNELS
    check(p, 3, DecodeConfig(replace(DOT_SPLIT, finish=True), replace(DOT_SPLIT, finish=True)), monkeypatch)


def test_per_slot_follows_the_finishing_tiles():
    """`DecodeConfig.per_slot`: a finishing MMA or tensor-core tile on either GEMM; FMA tiles take a row per program
    anyway and leave the routing grouped."""
    fma = replace(FMA, finish=True)
    assert DOT.takes_expert_slots and decode.mma_tile(32, 2, 4).takes_expert_slots and not FMA.takes_expert_slots
    assert DecodeConfig(replace(DOT_SPLIT, finish=True), DOT).per_slot
    assert DecodeConfig(DOT, decode.mma_tile(32, 2, 4, finish=True)).per_slot
    assert not DecodeConfig(fma, fma).per_slot and not DecodeConfig(DOT_SPLIT, DOT).per_slot


def test_decode_tile_rejects_bad_values():
    with pytest.raises(MoEConfigError, match="splits must be in 1..8"):
        DecodeTile(splits=9)
    with pytest.raises(MoEConfigError, match="block_k must be a multiple of 32"):
        DecodeTile(block_k=48)
    with pytest.raises(MoEConfigError, match="dot=True needs block_m >= 16"):
        DecodeTile(block_m=4, dot=True)
    with pytest.raises(MoEConfigError, match=r"finish=True FMA tiles take one row at a time: block_m=1 \(got 2\)"):
        DecodeTile(block_m=2, dot=False, finish=True)
    assert DecodeTile(block_m=16, dot=True, finish=True).finish  # tensor-core tiles finish with a program per slot
    with pytest.raises(MoEConfigError, match=r"unpredicated=True .* needs mma=True \(got mma=False\)"):
        DecodeTile(block_m=16, dot=True, unpredicated=True)
    assert replace(decode.mma_tile(16, 2, 4, finish=True), unpredicated=True).unpredicated


@pytest.mark.parametrize("quant", ["mxfp4", "nvfp4", "mxfp8"])
def test_fp4_and_mxfp8_fma_tiles_take_one_row(quant, monkeypatch):
    """FMA tiles of the weight-only formats run one row at a time (`_decode._gemv_k_loop`); more is refused
    with the argument, the value and the constraint, before any launch."""
    tile = DecodeTile(block_n=16, block_k=64, splits=1, block_m=2, dot=False)
    with pytest.raises(MoEConfigError, match=r"FMA decode tiles take one row at a time: block_m must be 1 \(got 2\)"):
        check(make_problem(quant, "silu", E=8, k=2, H=64, I=96), 1, DecodeConfig(tile, tile), monkeypatch)


def test_weight_only_decode_path_taken_up_to_512_slots(monkeypatch):
    """NVFP4 takes the decode kernels up to `WEIGHT_ONLY_DECODE_MAX_SLOTS` (512) slots and the grouped GEMM
    above; fp8 W8A8 keeps 256 (tests/test_triton_decode_fp8.py)."""
    assert decode.max_slots(QuantFormat.NVFP4) == decode.WEIGHT_ONLY_DECODE_MAX_SLOTS == 512
    assert decode.max_slots(QuantFormat.FP8_BLOCK) == decode.DECODE_MAX_SLOTS == 256
    from moe.experts.reference import WeightOnlyReferenceExperts

    p = make_problem("nvfp4", "silu", E=8, k=4, H=64, I=64, max_tokens=132)
    weights = make_weights(p)
    calls = []
    real = decode.decode_experts
    monkeypatch.setattr("moe.experts.triton.decode_experts", lambda *a: calls.append(a[1].shape[0]) or real(*a))
    for tokens in (128, 129):  # 512 and 516 slots
        x = torch.randn(tokens, p.hidden_size).to(p.dtype)
        topk = routed(tokens, p)
        d = Dispatched(ActivationFormat.STANDARD, QuantizedTensor(data=x, scale=None, fmt="none"), topk)
        out = run_experts(TritonExperts(p), d, weights).out
        want = (run_experts(WeightOnlyReferenceExperts(p), d, weights).out * topk.weights.unsqueeze(-1)).sum(1)
        assert_close_moe(out.float(), want.float(), regime_for(p), context=f"nvfp4 M={tokens}")
    assert calls == [128]


@pytest.mark.parametrize("rows_per_expert", [0.03125, 0.0625, 0.125, 0.25, 0.5, 1.0, 2.0, 4.0])
def test_decode_config_by_rows_per_expert(rows_per_expert):
    """GPT-OSS-120B (k/E = 1/32) at M = 1 .. 64 and Qwen3-30B-A3B (1/16) at M = 1 .. 64: the buckets the H200
    sweeps picked -- MMA-fragment tiles everywhere, finishing their own split epilogue with programs per slot below
    0.25 rows per expert (GPT-OSS up to 7 tokens, Qwen3 up to 3), where the launches weigh -- each with the FMA /
    tensor-core config of its bucket as the fallback (FMA tiles below one row per expert)."""
    config = decode.decode_config(rows_per_expert)
    assert config.gemm1.mma and config.gemm2.mma
    assert config.gemm1.finish is config.gemm2.finish is config.per_slot is (rows_per_expert < 0.25)
    fallback = config.fallback
    assert fallback is not None and not fallback.uses_mma and fallback.fallback is None
    assert fallback.gemm1.dot is (rows_per_expert >= 1.0)
    assert all(t.block_m == (16 if t.dot else 1) for t in (fallback.gemm1, fallback.gemm2))


def test_a_shapes_own_weight_only_decode_entries_come_first():
    """A table's ``decode`` entries (config.py) serve the weight-only formats as they serve fp8: the shape's own tiles
    at and above their M, with the bucket's FMA / tensor-core fallback attached; ``"default"`` the bucket's config;
    ``"grouped"`` none (the grouped GEMMs run). The H200's packaged tables hold entries for Qwen3-30B-A3B and
    GPT-OSS-120B, MXFP4 and NVFP4, at one token (session 23) and, with programs per slot, at two (session 24); Qwen3's
    also at three (session 24), four to eight (session 25, per slot) and nine to thirteen (session 25, per expert),
    GPT-OSS's at eight and nine (session 25, per slot; benchmarks/results/fp4_gemv_decode_nvidia-h200.md); in between
    and after, the buckets."""
    import dataclasses

    from moe.experts._triton.config import ConfigKey, ConfigTable

    own = {"gemm1": dataclasses.asdict(decode.mma_tile(64, 2, 8, finish=True)),
           "gemm2": dataclasses.asdict(decode.mma_tile(16, 2, 2, finish=True))}
    key = ConfigKey(128, 8, 2048, 768, "silu", "mxfp4", "standard", "NVIDIA H200")
    table = ConfigTable.from_json(key, {"configs": {}, "decode": {"1": own, "2": "default", "3": "grouped"}})
    one = decode.decode_config(0.0625, 1, table)
    assert (one.gemm1, one.gemm2) == (decode.mma_tile(64, 2, 8, finish=True), decode.mma_tile(16, 2, 2, finish=True))
    assert one.fallback == decode.decode_config(0.0625).fallback is not None
    assert decode.decode_config(0.125, 2, table) == decode.decode_config(0.125)
    assert decode.decode_config(0.1875, 3, table) is None
    # (shape, the M of its entries' tiles, the last M whose entry finishes per slot)
    packaged_entries = [((128, 8, 2048, 768, "silu"), {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13}, 8),
                        ((128, 4, 2880, 2880, "swiglu_oai"), {1, 2, 8, 9}, 9)]
    for shape, own_at, last_per_slot in packaged_entries:
        k = shape[1]
        for quant in ("mxfp4", "nvfp4"):
            packaged = ConfigTable.load(ConfigKey(*shape, quant, "standard", "NVIDIA H200"))
            section = dict(packaged.decode)
            assert all(entry != "grouped" for entry in section.values()), (shape, quant)
            for tokens in range(1, max(own_at) + 3):
                rows = tokens * k / 128
                config = decode.decode_config(rows, tokens, packaged)
                assert config.gemm1.mma and config.gemm2.mma, (shape, quant, tokens)
                assert config.fallback == decode.decode_config(rows).fallback, (shape, quant, tokens)
                entry = section[max(m for m in section if m <= tokens)]  # e.g. Qwen3 MXFP4's M = 7: its M = 6 entry
                assert (entry != "default") is (tokens in own_at), (shape, quant, tokens)
                if entry == "default":
                    assert config == decode.decode_config(rows), (shape, quant, tokens)
                    assert config.per_slot is (rows < 0.25), (shape, quant, tokens)  # the buckets' rule
                    continue
                want = decode.table_decode_config(entry)
                assert (config.gemm1, config.gemm2) == (want.gemm1, want.gemm2), (shape, quant, tokens)
                assert config.per_slot is (tokens <= last_per_slot), (shape, quant, tokens)


def test_mma_configs_fall_back_where_the_mma_tiles_cannot_run(monkeypatch):
    """On this CPU no weights carry MMA fragments (the interpreter runs no PTX): the default configs run their
    fallback, and an MMA config without one says what it needs."""
    p = gpt_oss_like()
    mma = decode.mma_tile(32, 2, 2)
    check(p, 3, DecodeConfig(mma, mma, fallback=DecodeConfig(FMA, DOT_SPLIT)), monkeypatch)
    with pytest.raises(MoEConfigError, match="mma=True tiles need fp4 weights prepared with their MMA fragments"):
        check(p, 3, DecodeConfig(mma, mma), monkeypatch)


@pytest.mark.parametrize("quant", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("num_tokens,tiles", [(1, (FMA, FMA)), (3, (DOT, DOT_SPLIT)), (5, (DOT_SPLIT, FMA))],
                         ids=["fma-1", "dot-3", "dot-split-5"])
def test_weight_only_decode_matches_the_weight_only_reference(quant, num_tokens, tiles, monkeypatch):
    """NVFP4 weights (e4m3 scale per 16, fp32 global scale per expert) and MXFP8 weights (e4m3 elements,
    e8m0 scale per 32) with fp16 activations: the decode kernels against the weight-only reference
    (activations never rounded), experts of very different magnitudes so a missing or misplaced scale
    shows."""
    from moe.experts.reference import WeightOnlyReferenceExperts
    from moe.weights import ExpertWeights

    config = DecodeConfig(*tiles)
    monkeypatch.setattr("moe.experts.triton.decode_config", lambda m, *table: config)
    called = []
    real = decode.decode_experts
    monkeypatch.setattr("moe.experts.triton.decode_experts", lambda *a: called.append(1) or real(*a))
    p = make_problem(quant, "silu", E=8, k=4, H=64, I=96)
    spread = torch.logspace(-2, 2, p.num_experts).view(-1, 1, 1)
    w13 = torch.randn(p.num_experts, p.w13_rows, p.hidden_size) / p.hidden_size**0.5 * spread
    w2 = torch.randn(p.num_experts, p.hidden_size, p.intermediate_size) / p.intermediate_size**0.5 / spread
    weights = ExpertWeights.from_dense(w13, w2, quant=p.quant, dtype=p.dtype)
    x = torch.randn(num_tokens, p.hidden_size).to(p.dtype)
    topk = routed(num_tokens, p)
    dispatched = Dispatched(ActivationFormat.STANDARD, QuantizedTensor(data=x, scale=None, fmt="none"), topk)
    out = run_experts(TritonExperts(p), dispatched, weights).out
    assert called == [1]
    truth = WeightOnlyReferenceExperts(p)
    want = run_experts(truth, dispatched, weights).out
    want = (want * topk.weights.unsqueeze(-1)).sum(1)
    assert_close_moe(out.float(), want.float(), regime_for(p), context=f"{quant} decode M={num_tokens}")
