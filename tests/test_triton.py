"""The Triton experts on CPU, in Triton's interpreter, against the reference experts and torch twins.

float16/float32 only: the interpreter computes bfloat16 wrongly (the GPU tests cover bf16). Shapes
are tiny so the whole module runs in well under a minute.
"""

import os
import shutil

if not shutil.which("nvidia-smi"):  # a CPU machine: the interpreter, before triton decorates any kernel
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402
import json  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("CPU-interpreter tests (TRITON_INTERPRET=1); on a GPU, tests/gpu/test_triton_gpu.py runs",
                allow_module_level=True)

from moe.experts._triton import config as cfg  # noqa: E402
from moe.experts._triton.align import align_block_size, align_block_size_reference  # noqa: E402
from moe.experts._triton.align import workspace_buffers as align_buffers  # noqa: E402
from moe.experts._triton.rows import (  # noqa: E402
    RowValidity,
    combine_slots_kernel,
    combine_slots_reference,
    fp8_scale_shape,
    quantize_fp8_rows,
    quantize_fp8_rows_reference,
)
from moe.experts._triton.gemm import (  # noqa: E402
    BatchedRows,
    DirectRows,
    SortedRows,
    grouped_gemm,
    grouped_gemm_reference,
)
from moe.errors import MoEConfigError  # noqa: E402
from moe.experts._triton.support import activation_format, config_key  # noqa: E402
from moe.experts._triton.weights import WeightOperand  # noqa: E402
from moe.experts._triton.weights import (  # noqa: E402
    mxfp4_half_split,
    mxfp4_scale_words,
    prepare_triton_weights,
    to_operand,
)
from moe.experts.reference import ReferenceExperts  # noqa: E402
from moe.experts.triton import TritonExperts  # noqa: E402
from moe.experts.triton_batched import TritonBatchedExperts  # noqa: E402
from moe.activation import Activation  # noqa: E402
from moe.formats import ActivationFormat, Dispatched, DispatchShape, OutputKind  # noqa: E402
from moe.platform import Platform  # noqa: E402
from moe.prepare_finalize.batched import BatchedPrepareFinalize  # noqa: E402
from moe.problem import MoEProblem, ParallelConfig  # noqa: E402
from moe.quant import QuantFormat, QuantizedTensor, quantize  # noqa: E402
from moe.quant.mx import dequantize_mxfp4  # noqa: E402
from moe.router import TopK  # noqa: E402
from moe.testing.tolerance import assert_close_moe, regime_for  # noqa: E402
from tests.helpers import assert_same_block_layout  # noqa: E402
from moe.weights import ExpertWeights  # noqa: E402
from moe.workspace import WorkspaceManager, WorkspaceShapes  # noqa: E402

SCHEMES = ("fp16", "fp8", "fp8_token", "fp8_block", "mxfp4")
ACTIVATIONS = ("silu", "gelu", "swiglu_oai", "relu2")


# --- helpers --------------------------------------------------------------------------------------


def make_problem(quant="fp16", activation="silu", *, E=4, k=2, H=64, I=96, bias=False,
                 dtype=torch.float16, expert_map=None, max_tokens=64) -> MoEProblem:
    parallel = ParallelConfig(expert_map=expert_map) if expert_map is not None else ParallelConfig()
    return MoEProblem.create(
        num_experts=E, top_k=k, hidden_size=H, intermediate_size=I, activation=activation,
        quant=quant, dtype=None if quant in ("fp16", "fp32") else dtype, has_bias=bias,
        max_tokens=max_tokens, parallel=parallel,
    )


def make_weights(p: MoEProblem) -> ExpertWeights:
    e, rows, h, i = p.local_num_experts, p.w13_rows, p.hidden_size, p.intermediate_size
    w13, w2 = torch.randn(e, rows, h) / h**0.5, torch.randn(e, h, i) / i**0.5
    b13 = torch.randn(e, rows) * 0.1 if p.has_bias else None
    b2 = torch.randn(e, h) * 0.1 if p.has_bias else None
    return ExpertWeights.from_dense(w13, w2, b13, b2, quant=p.quant, dtype=p.dtype)


def make_topk(num_tokens: int, p: MoEProblem) -> TopK:
    ids = [torch.randperm(p.num_experts)[: p.top_k] for _ in range(num_tokens)]
    ids = torch.stack(ids).int() if ids else torch.empty(0, p.top_k, dtype=torch.int32)
    return TopK(ids, torch.rand(num_tokens, p.top_k))


def run_experts(experts, dispatched, weights):
    prepared = experts.prepare_weights(weights)
    shapes = experts.workspace_shapes(DispatchShape(dispatched.format, dispatched.num_rows))
    return experts.apply(dispatched, prepared, WorkspaceManager().take(shapes, experts.name))


def reference_reduced(p, x, topk, weights) -> torch.Tensor:
    """The reference experts' output, weighted and summed over k, from activations quantized first."""
    fmt = p.quant.activation
    xq = quantize(x, fmt, "activation") if fmt is not QuantFormat.NONE else QuantizedTensor(
        data=x, scale=None, fmt=fmt)
    out = run_experts(ReferenceExperts(p), Dispatched(ActivationFormat.STANDARD, xq, topk), weights).out
    return (out * topk.weights.unsqueeze(-1)).sum(1)


def check_standard(p: MoEProblem, num_tokens: int) -> None:
    weights = make_weights(p)
    x = torch.randn(num_tokens, p.hidden_size).to(p.dtype)
    topk = make_topk(num_tokens, p)
    dispatched = Dispatched(ActivationFormat.STANDARD, QuantizedTensor(data=x, scale=None, fmt="none"), topk)
    result = run_experts(TritonExperts(p), dispatched, weights)
    assert result.kind is OutputKind.REDUCED and result.out.shape == (num_tokens, p.hidden_size)
    ref = reference_reduced(p, x, topk, weights)
    assert_close_moe(result.out.float(), ref, regime_for(p), context=f"{p.quant_name} {p.activation} M={num_tokens}")


# --- the experts against the reference ------------------------------------------------------------


@pytest.mark.parametrize("quant", SCHEMES)
@pytest.mark.parametrize("num_tokens", [0, 1, 7, 33])
def test_standard_schemes(quant, num_tokens):
    check_standard(make_problem(quant), num_tokens)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("quant", ["fp16", "fp8_block", "mxfp4"])
def test_standard_activations_with_bias(activation, quant):
    check_standard(make_problem(quant, activation, bias=True), 7)


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("quant", ["fp16", "fp8", "mxfp4"])
def test_standard_direct_and_sorted_rows(quant, direct, monkeypatch):
    """Both row sources at the same M: sorted blocks and one program per slot (decode)."""
    small = cfg.LaunchConfig(16, cfg.TileConfig(32, 64), cfg.TileConfig(32, 64), direct=direct)
    monkeypatch.setattr(cfg.ConfigTable, "lookup", lambda self, m: small)
    check_standard(make_problem(quant, E=8, k=3, expert_map=(-1, 0, -1, -1, 1, -1, 2, -1)), 5)


@pytest.mark.parametrize("quant,sizes", [("fp16", {}), ("fp8_block", {}), ("fp32", {"H": 80, "I": 48})])
@pytest.mark.parametrize("gated", [True, False])
def test_standard_tma_weight_tiles(quant, sizes, gated, monkeypatch):
    """Weight tiles by TMA descriptor: the same results, N and K tails included (fp32 80 x 48)."""
    tma = cfg.LaunchConfig(16, cfg.TileConfig(32, 64, tma=True), cfg.TileConfig(32, 32, tma=True))
    monkeypatch.setattr(cfg.ConfigTable, "lookup", lambda self, m: tma)
    monkeypatch.setattr("moe.experts.triton.uses_decode", lambda *a: False)  # fp8_block would decode 99 slots
    check_standard(make_problem(quant, "silu" if gated else "relu2", E=8, k=3, **sizes,
                                expert_map=(-1, 0, -1, -1, 1, -1, 2, -1)), 33)


@pytest.mark.parametrize("quant", ["mxfp4", "mxfp8"])  # scale words, loaded by pointer (weights.py)
def test_tma_weight_tiles_refuse_block_scaled_weights(quant):
    p = make_problem(quant)
    w = TritonExperts(p).prepare_weights(make_weights(p)).w13
    with pytest.raises(MoEConfigError, match=f"tma=True needs contiguous dense or fp8 weights.*got {quant}"):
        w.descriptor(32, 64)
    # a table asking for TMA tiles on MXFP4 weights fails at load, not at the first forward
    tma = cfg.LaunchConfig(16, cfg.TileConfig(32, 64, tma=True), cfg.TileConfig(32, 64))
    table = cfg.ConfigTable(config_key(p, "standard", torch.device("cpu")), ((1, tma),))
    with pytest.raises(MoEConfigError, match="tma=True needs"):
        prepare_triton_weights(make_weights(p), None, table)


def test_tma_descriptors_are_built_at_load_once():
    p = make_problem("fp16")
    tma = cfg.LaunchConfig(16, cfg.TileConfig(32, 64, tma=True), cfg.TileConfig(64, 32, tma=True))
    table = cfg.ConfigTable(config_key(p, "standard", torch.device("cpu")), ((1, tma),))
    prepared = prepare_triton_weights(make_weights(p), None, table)
    assert set(prepared.w13.descriptors) == {(32, 64)} and set(prepared.w2.descriptors) == {(64, 32)}
    assert prepared.w13.descriptor(32, 64) is prepared.w13.descriptors[(32, 64)]


def test_standard_fp32_odd_sizes():
    """K and N not multiples of the tiles (H=80, I=48) exercise the masked tails."""
    check_standard(make_problem("fp32", H=80, I=48, E=3, k=3), 33)


@pytest.mark.parametrize("quant", ["fp16", "fp8", "mxfp4"])
def test_standard_expert_map(quant):
    """Experts 1, 4, 6 of 8 live here; slots routed elsewhere contribute nothing."""
    expert_map = (-1, 0, -1, -1, 1, -1, 2, -1)
    check_standard(make_problem(quant, E=8, k=3, expert_map=expert_map), 33)


def test_standard_many_slots_uses_the_multi_launch_alignment():
    p = make_problem("fp16", E=8, k=4, H=32, I=32, max_tokens=1100)
    check_standard(p, 1100)  # 4400 slots > FUSED_MAX_SLOTS


@pytest.mark.parametrize("quant", ["fp16", "fp8_token", "fp8_block", "mxfp4"])
@pytest.mark.parametrize("num_tokens", [1, 33])
def test_batched(quant, num_tokens):
    p = make_problem(quant, "swiglu_oai" if quant == "mxfp4" else "silu", bias=quant == "mxfp4")
    weights = make_weights(p)
    x = torch.randn(num_tokens, p.hidden_size).to(p.dtype)
    topk = make_topk(num_tokens, p)
    prepare = BatchedPrepareFinalize(p)
    ws = WorkspaceManager().take(prepare.workspace_shapes(num_tokens))
    dispatched, _ = prepare.prepare(x, topk, p.quant.activation, ws)
    out = run_experts(TritonBatchedExperts(p), dispatched, weights).out
    ref = run_experts(ReferenceExperts(p), dispatched, weights).out
    counts = dispatched.tokens_per_expert.long()
    valid = torch.arange(out.shape[1]).unsqueeze(0) < counts.unsqueeze(1)  # rows past a count: garbage
    assert_close_moe(out[valid].float(), ref[valid], regime_for(p), context=f"batched {quant}")


def test_workspace_does_not_depend_on_routing():
    p = make_problem("fp8_block", E=8, k=3, expert_map=(-1, 0, -1, -1, 1, -1, 2, -1))
    shapes = TritonExperts(p).workspace_shapes(DispatchShape(ActivationFormat.STANDARD, 40))
    assert isinstance(shapes, WorkspaceShapes) and shapes.nbytes > 0
    assert {"out", "inter", "y", "sorted_slots", "x_q", "inter_scale"} <= set(shapes.names())


# --- kernels against their torch twins -------------------------------------------------------------


@pytest.mark.parametrize(
    "num_tokens,k,num_experts,block_m,use_map",
    [(1, 2, 4, 16, False), (7, 2, 4, 16, True), (33, 4, 8, 32, False), (600, 4, 8, 64, True), (3, 1, 1, 16, False),
     # more slots than FUSED_MAX_SLOTS, two launches (the last chunk partial): 4, 128 and 64 local experts
     (1100, 4, 8, 64, True), (1100, 8, 128, 64, False), (1500, 8, 128, 128, True)],
)
def test_align_matches_twin(num_tokens, k, num_experts, block_m, use_map):
    ids = torch.stack([torch.randperm(num_experts)[:k] for _ in range(num_tokens)]).int()
    expert_map, num_local = None, num_experts
    if use_map:
        local = torch.full((num_experts,), -1, dtype=torch.int32)
        chosen = torch.randperm(num_experts)[: num_experts // 2]
        local[chosen] = torch.arange(chosen.numel(), dtype=torch.int32)
        expert_map, num_local = local, chosen.numel()
    buffers = align_buffers(ids.numel(), num_local, (block_m,))
    ws = WorkspaceManager().take(WorkspaceShapes.of(**buffers))
    for name in ("sorted_slots", "expert_counts", "expert_ends", "local_ids", "slot_rows"):
        ws[name].fill_(-7)  # poison: what the GEMMs read must be written
    got = align_block_size(ids, expert_map, num_local, block_m, ws)
    want = align_block_size_reference(ids, expert_map, num_local, block_m)
    assert_same_block_layout(got, want)


@pytest.mark.parametrize("fmt", [QuantFormat.FP8_TENSOR, QuantFormat.FP8_ROW, QuantFormat.FP8_BLOCK])
@pytest.mark.parametrize("validity", ["all", "local", "batched"])
def test_fp8_row_quantization_is_bit_exact(fmt, validity):
    x = torch.randn(12, 200).half() * 3
    rule = {
        "all": RowValidity(),
        "local": RowValidity(topk_ids=torch.tensor([0, 3, 2, 1] * 3, dtype=torch.int32),
                             expert_map=torch.tensor([0, 1, 2, -1], dtype=torch.int32)),
        "batched": RowValidity(counts=torch.tensor([2, 0, 4], dtype=torch.int32), rows_per_expert=4),
    }[validity]
    x[~rule.mask(12, "cpu")] = float("nan")  # rows without data must not reach the amax
    q = torch.empty(12, 200, dtype=torch.float8_e4m3fn)
    scale = torch.empty(fp8_scale_shape(fmt, 12, 200))
    quantize_fp8_rows(x, fmt, q, scale, torch.zeros(1), rule)
    want, mask = quantize_fp8_rows_reference(x, fmt, rule)
    if fmt is QuantFormat.FP8_TENSOR:
        got = q.float() * scale
    elif fmt is QuantFormat.FP8_ROW:
        got = q.float() * scale
    else:
        got = q.float() * scale.repeat_interleave(128, dim=1)[:, :200]
    assert torch.equal(got[mask], want[mask])


@pytest.mark.parametrize("programs", [1, 2, 3])
def test_fp8_group_quantization_is_the_same_on_any_grid(programs):
    """The 128-group kernel's programs along K take the groups program_id(1), + num_programs(1), ...: one group
    each, all of K, or anything between gives the same codes and scales (K = 300: a partial last group)."""
    from moe.experts._triton import kernels
    from moe.experts._triton.rows import FP8_MODES

    x = torch.randn(40, 300)
    q = torch.empty(40, 300, dtype=torch.float8_e4m3fn)
    scale = torch.full((3 * 40,), float("nan"))  # [groups, rows]: every entry must be written
    kernels("rows").fp8_quant_kernel[(3, programs)](
        x, q, scale, scale, x, x, 40, 300, 0, x.stride(0), q.stride(0), 1, 40,
        MODE=FP8_MODES[QuantFormat.FP8_BLOCK], VALID=0, BLOCK_R=16, BLOCK_K=128)
    want, _ = quantize_fp8_rows_reference(x, QuantFormat.FP8_BLOCK)
    assert torch.equal(q.float() * scale.view(3, 40).t().repeat_interleave(128, dim=1)[:, :300], want)


def test_fp8_group_programs_follow_the_row_blocks():
    from moe.experts._triton.rows import LOOP_ROW_BLOCKS, fp8_group_programs

    assert fp8_group_programs(QuantFormat.FP8_BLOCK, 10240, 2048) == 16  # few row blocks: one group each
    assert fp8_group_programs(QuantFormat.FP8_BLOCK, 16 * LOOP_ROW_BLOCKS, 2048) == 1  # many: a loop over K
    assert fp8_group_programs(QuantFormat.FP8_ROW, 16, 2048) == 1  # a row's scale needs all of K


@pytest.mark.parametrize("with_map", [False, True])
def test_combine_matches_twin(with_map):
    y = torch.randn(5 * 3, 40).half()
    weights = torch.rand(5, 3)
    ids = torch.tensor([[0, 2, 1]] * 5, dtype=torch.int32)
    expert_map = torch.tensor([0, 1, -1], dtype=torch.int32) if with_map else None
    if with_map:
        y[1::3] = float("nan")  # slots elsewhere hold garbage
    out = combine_slots_kernel(y, weights, ids, expert_map, torch.empty(5, 40, dtype=torch.float16))
    assert_close_moe(out.float(), combine_slots_reference(y, weights, ids, expert_map), "fp16")


@pytest.mark.parametrize("with_map", [False, True])
def test_combine_gathers_sorted_rows_through_slot_rows(with_map):
    """A GEMM2 that stores by TMA leaves y's rows sorted (with padding rows between experts): the sum over k reads
    slot s at ``y[slot_rows[s]]`` and gives what it gives on y in slot order."""
    torch.manual_seed(0)
    ids = torch.tensor([[0, 2, 1], [1, 0, 2], [2, 1, 0], [0, 1, 2], [2, 0, 1]], dtype=torch.int32)
    expert_map = torch.tensor([0, 1, -1], dtype=torch.int32) if with_map else None
    num_local = 2 if with_map else 3
    layout = align_block_size_reference(ids, expert_map, num_local, 4)
    y_slots = torch.randn(15, 40).half()
    y_sorted = torch.full((layout.sorted_slots.numel(), 40), float("nan")).half()  # padding rows: never read
    here = layout.local_ids >= 0
    y_sorted[layout.slot_rows[here].long()] = y_slots[here]
    weights = torch.rand(5, 3)
    out = combine_slots_kernel(y_sorted, weights, ids, expert_map, torch.empty(5, 40, dtype=torch.float16),
                               layout.slot_rows)
    assert out.isfinite().all()
    assert_close_moe(out.float(), combine_slots_reference(y_slots, weights, ids, expert_map), "fp16")


def test_mxfp4_half_split_layout():
    codes = torch.randint(0, 16, (2, 3, 64), dtype=torch.uint8)
    canonical = codes[..., 0::2] | (codes[..., 1::2] << 4)
    split = mxfp4_half_split(canonical)
    groups = codes.view(2, 3, 2, 32)
    # byte j of each group of 32 holds elements j (low nibble) and j + 16 (high nibble)
    assert torch.equal(split.view(2, 3, 2, 16) & 0x0F, groups[..., :16])
    assert torch.equal(split.view(2, 3, 2, 16) >> 4, groups[..., 16:])


def test_mxfp4_scale_words_layout():
    scale = torch.randint(0, 256, (2, 3, 5), dtype=torch.uint8)  # 5 groups: 2 words, the last padded
    words = mxfp4_scale_words(scale)
    assert words.dtype == torch.int32 and words.shape == (2, 3, 2) and words.stride() == (6, 1, 3)
    as_bytes = torch.stack([(words >> (8 * b)) & 0xFF for b in range(4)], dim=-1).flatten(-2)
    assert torch.equal(as_bytes[..., :5], scale.int()) and not as_bytes[..., 5:].any()


@pytest.mark.parametrize("k,block_k", [(96, 64), (128, 64), (160, 128), (256, 256)])
def test_mxfp4_gemm_dequantizes_exactly(k, block_k):
    """One-hot rows of A read the kernel's dequantized weights back (float32: no rounding anywhere):
    bit for bit the reference dequantization, with K and N tails, every scale byte in [1, 240] (the
    kernel clamps above) and every byte position of the scale words."""
    e, n = 2, 40
    q = QuantizedTensor(data=torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8),
                        scale=torch.randint(1, 241, (e, n, k // 32), dtype=torch.uint8),
                        fmt="mxfp4", role="weight")
    a = torch.eye(k).repeat(e, 1)  # expert j's rows j * k .. j * k + k - 1
    out = torch.empty(e * k, n)
    rows = BatchedRows(torch.full((e,), k, dtype=torch.int32), k)
    grouped_gemm(a, None, to_operand(q, None), out, rows, None, 16, cfg.TileConfig(32, block_k))
    assert torch.equal(out.view(e, k, n), dequantize_mxfp4(q.data, q.scale).transpose(1, 2))


def _rows_for(kind: str, ids: torch.Tensor, a: torch.Tensor, num_experts: int, block_m: int):
    """(rows, A as the kernel reads it, [(output row, A row, local expert)]) for one row source."""
    m, k = ids.shape
    slots = ids.reshape(-1).long()
    if kind == "sorted":
        layout = align_block_size_reference(ids, None, num_experts, block_m)
        return SortedRows(layout, m * k, k), a, [(s, s // k, int(slots[s])) for s in range(m * k)]
    if kind == "direct":
        return DirectRows(ids.reshape(-1), None, k), a, [(s, s // k, int(slots[s])) for s in range(m * k)]
    counts = torch.bincount(slots, minlength=num_experts).int()
    per_expert = int(counts.max())
    batched = a.new_zeros(num_experts * per_expert, a.shape[1])
    rows = []
    for e in range(num_experts):
        tokens = (ids == e).any(dim=1).nonzero().flatten()
        batched[e * per_expert: e * per_expert + len(tokens)] = a[tokens]
        rows += [(e * per_expert + j, e * per_expert + j, e) for j in range(len(tokens))]
    return BatchedRows(counts, per_expert), batched, rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", ["sorted", "direct", "batched"])
@pytest.mark.parametrize("activation", [None, "silu", "relu2"])
def test_grouped_gemm_matches_its_torch_twin(dtype, kind, activation):
    """The kernel, on each row source (`ROW_CODES`), against `grouped_gemm_reference`: every routed row
    of the output is the twin's ``act(a[row] @ w[expert].T + bias)``, the gated halves fused."""
    e, k, m, hidden, n_out, block_m = 4, 2, 7, 64, 48, 16
    act = None if activation is None else Activation.parse(activation)
    n_w = 2 * n_out if act is not None and act.is_gated else n_out
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(e, n_w, hidden, generator=gen) / hidden**0.5).to(dtype)
    bias = 0.1 * torch.randn(e, n_w, generator=gen)
    a = torch.randn(m, hidden, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(m)]).int()
    rows, a_in, routed = _rows_for(kind, ids, a, e, block_m)
    out = torch.full((a_in.shape[0] if kind == "batched" else m * k, n_out), float("nan"), dtype=dtype)
    grouped_gemm(a_in, None, WeightOperand(w, None, bias, QuantFormat.NONE), out, rows, act, block_m,
                 cfg.TileConfig(32, 32))
    out_rows, a_rows, experts = (torch.tensor(column) for column in zip(*routed))
    want = grouped_gemm_reference(a_in[a_rows], w, bias, experts, act)
    tolerance = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out[out_rows].float(), want, **tolerance)


# --- declarations and configs ---------------------------------------------------------------------


def test_fp8_runs_weight_only_below_sm89():
    """An A100 has no fp8 tensor cores: the standard experts serve fp8 there weight-only (activations
    unquantized); the batched experts, which have no weight-only path, still need SM89."""
    p = make_problem("fp8")
    a100 = Platform(name="a100", device="cuda", capability=(8, 0), libraries=frozenset({"triton"}))
    h100 = Platform(name="h100", device="cuda", capability=(9, 0), libraries=frozenset({"triton"}))
    assert TritonExperts.check(p, a100) == [] and TritonExperts.check(p, h100) == []
    assert activation_format(p, a100) is QuantFormat.NONE and activation_format(p, h100) is QuantFormat.FP8_TENSOR
    assert any("SM89" in r for r in TritonBatchedExperts.check(p, a100))
    assert TritonExperts.check(make_problem("fp16"), a100) == []


def test_rejects_unsupported_schemes_with_reasons():
    """The batched experts have no weight-only path, so mxfp8 (weight-only in the standard experts) is refused."""
    p = make_problem("mxfp8")
    assert TritonExperts.check(p, None) == []
    reasons = TritonBatchedExperts.check(p, None)
    assert any("mxfp8" in r for r in reasons)


def test_config_lookup_and_roundtrip(tmp_path):
    key = cfg.ConfigKey(8, 2, 64, 96, "silu", "fp16", "standard", "NVIDIA H200")
    assert cfg.ConfigTable.load(key, tmp_path).lookup(5) == cfg.default_config(key, 5)
    small = cfg.LaunchConfig(16, cfg.TileConfig(32, 128), cfg.TileConfig(64, 128))
    large = cfg.LaunchConfig(128, cfg.TileConfig(128, 64, 8, 8, 3), cfg.TileConfig(128, 64, 8, 8, 4))
    path = cfg.ConfigTable(key, ((1, small), (4096, large))).save(tmp_path)
    assert path.name == "E=8,k=2,H=64,I=96,silu,fp16,standard,NVIDIA_H200.json"
    table = cfg.ConfigTable.load(key, tmp_path)
    assert table.lookup(2) == small and table.lookup(3000) == large
    assert table.lookup(64) == large  # log-scale tie between 1 and 4096 goes to the larger bucket
    decode = dataclasses.replace(small, direct=True)
    sparse = cfg.ConfigTable(key, ((1, decode), (256, large)))
    assert sparse.lookup(2) == decode and sparse.lookup(16) == large  # direct only near its bucket
    assert cfg.ConfigTable(key, ((1, decode),)).lookup(64) == cfg.default_config(key, 64)


def test_default_configs_are_valid():
    for activation in ("silu", "relu2"):
        for scheme in ("bf16", "fp8_block", "mxfp4"):
            key = cfg.ConfigKey(128, 8, 2048, 768, activation, scheme, "standard", "x")
            for m in (1, 16, 256, 4096, 65536):
                c = cfg.default_config(key, m)
                assert c.block_m in cfg.BLOCK_MS
                if scheme == "fp8_block":
                    assert 128 % c.gemm1.block_k == 0 and 128 % c.gemm2.block_k == 0


def test_shipped_config_files_parse():
    """Every shipped file is named by its key and holds launch configs, or (config.py's docstring) only a ``decode``
    section, with which the grouped GEMMs take the default config as without the file."""
    for path in cfg.CONFIG_DIR.glob("*.json"):
        data = json.loads(path.read_text())
        key = cfg.ConfigKey(**data["key"])
        assert key.filename == path.name, path
        table = cfg.ConfigTable.load(key)
        assert table.tuned or table.decode, path
        if not table.tuned:
            assert all(table.lookup(m) == cfg.default_config(key, m) for m in (1, 64, 4096)), path


def _table_on(device: str, block_m: int, tmp_path, **changes) -> cfg.ConfigKey:
    key = cfg.ConfigKey(128, 8, 2048, 768, "silu", "bf16", "standard", device)
    key = dataclasses.replace(key, **changes)
    tile = cfg.TileConfig(block_n=128, block_k=64, num_warps=4, num_stages=4)
    cfg.ConfigTable(key, ((1024, cfg.LaunchConfig(block_m, tile, tile)),)).save(tmp_path)
    return key


def test_a_gpu_without_its_own_table_reads_its_siblings(tmp_path):
    """H100 and H200 are one chip (SM90, same SMs and shared memory): an H100 takes the H200's table where
    it has none, its own where it has one, and no other architecture's or problem's table."""
    _table_on("NVIDIA H200", 64, tmp_path)
    _table_on("NVIDIA A100-SXM4-80GB", 32, tmp_path, hidden_size=4096)
    h100 = cfg.ConfigKey(128, 8, 2048, 768, "silu", "bf16", "standard", "NVIDIA H100 80GB HBM3")
    assert cfg.ConfigTable.load(h100, tmp_path).lookup(1024).block_m == 64
    a100 = dataclasses.replace(h100, device="NVIDIA A100-SXM4-80GB")
    assert not cfg.ConfigTable.load(a100, tmp_path).tuned  # the A100 table is another problem's
    assert not cfg.ConfigTable.load(dataclasses.replace(h100, top_k=4), tmp_path).tuned
    unknown = dataclasses.replace(h100, device="Some Future GPU")
    assert not cfg.ConfigTable.load(unknown, tmp_path).tuned
    _table_on("NVIDIA H100 80GB HBM3", 128, tmp_path)
    assert cfg.ConfigTable.load(h100, tmp_path).lookup(1024).block_m == 128
