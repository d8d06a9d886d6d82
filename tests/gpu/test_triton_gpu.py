"""The Triton experts on a CUDA GPU: bfloat16 and every scheme against reference, CUDA-graph capture,
no host synchronization, and the alignment at a real model's size."""

from __future__ import annotations

import pytest
import torch

from moe.experts._triton.align import align_block_size, align_block_size_reference
from moe.experts._triton.align import workspace_buffers as align_buffers
from moe.experts._triton.config import TileConfig
from moe.experts._triton.gemm import BatchedRows, grouped_gemm
from moe.experts._triton.weights import to_operand
from moe.experts.reference import ReferenceExperts
from moe.experts.triton import TritonExperts
from moe.experts.triton_batched import TritonBatchedExperts
from moe.formats import ActivationFormat, Dispatched, DispatchShape
from moe.platform import Platform
from moe.prepare_finalize.batched import BatchedPrepareFinalize
from moe.problem import MoEProblem, ParallelConfig
from moe.quant import QuantFormat, QuantizedTensor, quantize
from moe.quant.mx import dequantize_mxfp4
from moe.router import TopK
from moe.testing.poison import PoisonedWorkspace
from moe.testing.tolerance import assert_close_moe, regime_for
from moe.weights import ExpertWeights
from moe.workspace import WorkspaceManager, WorkspaceShapes
from tests.helpers import assert_same_block_layout

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

SCHEMES = ("bf16", "fp16", "fp8", "fp8_token", "fp8_block", "mxfp4")


def problem(quant, activation="silu", *, E=16, k=4, H=512, I=384, bias=False, expert_map=None, max_tokens=512):
    parallel = ParallelConfig(expert_map=expert_map) if expert_map else ParallelConfig()
    return MoEProblem.create(num_experts=E, top_k=k, hidden_size=H, intermediate_size=I, activation=activation,
                             quant=quant, dtype=None if quant in ("bf16", "fp16") else torch.bfloat16,
                             has_bias=bias, max_tokens=max_tokens, parallel=parallel)


def weights_for(p, spread: tuple[float, float] | None = None):
    """Random canonical weights; ``spread=(low, high)`` scales expert e's w13 from low to high linearly, so
    that per-expert scales (fp8 per tensor, NVFP4's global scale) differ from expert to expert."""
    e, r, h, i = p.local_num_experts, p.w13_rows, p.hidden_size, p.intermediate_size
    w13, w2 = torch.randn(e, r, h, device="cuda") / h**0.5, torch.randn(e, h, i, device="cuda") / i**0.5
    if spread is not None:
        w13 = w13 * torch.linspace(*spread, e, device="cuda").view(e, 1, 1)
    b13 = 0.1 * torch.randn(e, r, device="cuda") if p.has_bias else None
    b2 = 0.1 * torch.randn(e, h, device="cuda") if p.has_bias else None
    return ExpertWeights.from_dense(w13, w2, b13, b2, quant=p.quant, dtype=p.dtype)


def topk_for(p, tokens):
    ids = torch.rand(tokens, p.num_experts, device="cuda").argsort(1)[:, : p.top_k].int()
    return TopK(ids, torch.rand(tokens, p.top_k, device="cuda"))


def run(experts, dispatched, prepared):
    shapes = experts.workspace_shapes(DispatchShape(dispatched.format, dispatched.num_rows))
    return experts.apply(dispatched, prepared, WorkspaceManager("cuda").take(shapes)).out


def run_poisoned(experts, dispatched, prepared):
    """`run` in a workspace whose bytes are all 0xFF at the start (NaN in every float dtype, e4m3 included),
    between guard bytes: (output, the guards' violations)."""
    poisoned = PoisonedWorkspace(experts.workspace_shapes(DispatchShape(dispatched.format, dispatched.num_rows)),
                                 "cuda")
    return experts.apply(dispatched, prepared, poisoned.workspace).out, poisoned.violations()


def assert_poisoned_run_equals_run(layer, tokens: int, prepared) -> None:
    """The layer's output from a NaN-filled workspace is finite and bit-equal to `run`'s: nothing it reads was
    left unwritten (the sorted paths' padding rows are never written: a GEMM computes them, nothing reads them)."""
    p, experts, _, _ = layer
    x = torch.randn(tokens, p.hidden_size, device="cuda", dtype=p.dtype)
    dispatched = Dispatched(ActivationFormat.STANDARD, QuantizedTensor(data=x, scale=None, fmt="none"),
                            topk_for(p, tokens))
    got, violations = run_poisoned(experts, dispatched, prepared)
    assert violations == []
    assert torch.isfinite(got).all()
    assert torch.equal(got, run(experts, dispatched, prepared))


def reference(p, x, topk, weights):
    fmt = p.quant.activation
    xq = quantize(x, fmt, "activation") if fmt is not QuantFormat.NONE else QuantizedTensor(data=x, scale=None, fmt=fmt)
    ref = ReferenceExperts(p)
    out = run(ref, Dispatched(ActivationFormat.STANDARD, xq, topk), ref.prepare_weights(weights))
    return (out * topk.weights.unsqueeze(-1)).sum(1)


def check(p, tokens):
    weights = weights_for(p)
    x = torch.randn(tokens, p.hidden_size, device="cuda", dtype=p.dtype)
    topk = topk_for(p, tokens)
    experts = TritonExperts(p)
    assert experts.check(p, Platform.detect()) == []
    out = run(experts, Dispatched(ActivationFormat.STANDARD, QuantizedTensor(data=x, scale=None, fmt="none"), topk),
              experts.prepare_weights(weights))
    assert_close_moe(out.float(), reference(p, x, topk, weights), regime_for(p),
                     context=f"{p.quant_name} {p.activation} M={tokens}")


@pytest.mark.parametrize("tokens", [1, 37, 512])
@pytest.mark.parametrize("quant", SCHEMES)
def test_schemes(quant, tokens):
    check(problem(quant), tokens)


@pytest.mark.parametrize("activation", ["gelu", "swiglu_oai", "relu2"])
@pytest.mark.parametrize("quant", ["bf16", "fp8_block", "mxfp4"])
def test_activations_with_bias(activation, quant):
    check(problem(quant, activation, bias=True), 100)


@pytest.mark.parametrize("block_m,block_n,block_k", [(16, 64, 128), (64, 128, 64), (128, 128, 64)])
@pytest.mark.parametrize("quant", ["bf16", "fp8_block"])
def test_tma_weight_tiles(quant, block_m, block_n, block_k, monkeypatch):
    from moe.experts._triton import config as cfg

    tile = TileConfig(block_n, block_k, 8 if block_m > 16 else 1, 8 if block_m == 128 else 4, 3, tma=True)
    monkeypatch.setattr(cfg.ConfigTable, "lookup", lambda self, m: cfg.LaunchConfig(block_m, tile, tile))
    check(problem(quant, E=16, k=4, H=576, I=320, expert_map=tuple(range(8)) + (-1,) * 8), 300)


def test_gpt_oss_like_sizes_and_expert_map():
    """H = I = 2880 (not a multiple of 128 or 256) and experts elsewhere."""
    expert_map = tuple(i // 2 if i % 2 == 0 else -1 for i in range(8))
    check(problem("mxfp4", "swiglu_oai", E=8, k=4, H=2880, I=2880, bias=True, expert_map=expert_map), 65)
    check(problem("bf16", E=8, k=4, H=2880, I=2880, expert_map=expert_map), 65)


@pytest.mark.parametrize("block_m,block_k", [(16, 64), (64, 128), (16, 256)])
def test_mxfp4_gemm_dequantizes_exactly(block_m, block_k):
    """One-hot bf16 rows of A read the kernel's dequantized weights back: bit for bit the reference
    dequantization (K = 2880: a K tail for 128 and 256; N = 72: an N tail; mma v2 and wgmma tiles)."""
    e, n, k = 2, 72, 2880
    q = QuantizedTensor(data=torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device="cuda"),
                        scale=torch.randint(100, 150, (e, n, k // 32), dtype=torch.uint8, device="cuda"),
                        fmt="mxfp4", role="weight")
    a = torch.eye(k, device="cuda", dtype=torch.bfloat16).repeat(e, 1)
    out = torch.empty(e * k, n, device="cuda", dtype=torch.bfloat16)
    rows = BatchedRows(torch.full((e,), k, dtype=torch.int32, device="cuda"), k)
    grouped_gemm(a, None, to_operand(q, None), out, rows, None, block_m, TileConfig(64, block_k))
    want = dequantize_mxfp4(q.data, q.scale).transpose(1, 2).to(torch.bfloat16)
    assert torch.equal(out.view(e, k, n), want)


@pytest.mark.parametrize("quant", ["bf16", "fp8_token", "mxfp4"])
def test_batched(quant):
    p = problem(quant)
    weights = weights_for(p)
    x = torch.randn(200, p.hidden_size, device="cuda", dtype=p.dtype)
    topk = topk_for(p, 200)
    prepare = BatchedPrepareFinalize(p, max_tokens_per_expert=200)
    prepare.load("cuda")
    dispatched, _ = prepare.prepare(x, topk, p.quant.activation,
                                    WorkspaceManager("cuda").take(prepare.workspace_shapes(200)))
    experts, ref = TritonBatchedExperts(p), ReferenceExperts(p)
    out = run(experts, dispatched, experts.prepare_weights(weights))
    want = run(ref, dispatched, ref.prepare_weights(weights))
    valid = torch.arange(out.shape[1], device="cuda")[None] < dispatched.tokens_per_expert[:, None]
    assert_close_moe(out[valid].float(), want[valid], regime_for(p))


@pytest.mark.parametrize("quant,tma", [("bf16", False), ("fp8", False), ("bf16", True)])
def test_cuda_graph_replay_without_host_sync(quant, tma, monkeypatch):
    if tma:  # the TMA descriptors are kernel arguments built at launch: captured by value
        from moe.experts._triton import config as cfg

        tile = TileConfig(128, 64, 8, 8, 3, tma=True)
        monkeypatch.setattr(cfg.ConfigTable, "lookup", lambda self, m: cfg.LaunchConfig(64, tile, tile))
    p = problem(quant, E=32, k=8, H=1024, I=512, max_tokens=300)
    experts = TritonExperts(p)
    assert_replay_equals_eager_without_sync(experts, experts.prepare_weights(weights_for(p)), p, 300)


def assert_replay_equals_eager_without_sync(experts, prepared, p, tokens: int) -> None:
    """``experts.apply`` on ``tokens`` random rows: no host sync (sync debug mode raises), and a CUDA graph
    of it, replayed on new inputs in the same buffers, equals an eager call bit for bit."""
    x = torch.randn(tokens, p.hidden_size, device="cuda", dtype=p.dtype)
    topk = topk_for(p, tokens)
    dispatched = Dispatched(ActivationFormat.STANDARD, QuantizedTensor(data=x, scale=None, fmt="none"), topk)
    ws = WorkspaceManager("cuda").take(experts.workspace_shapes(DispatchShape(ActivationFormat.STANDARD, tokens)))
    experts.apply(dispatched, prepared, ws)  # compile outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host synchronization raises
    try:
        experts.apply(dispatched, prepared, ws)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = experts.apply(dispatched, prepared, ws).out
    for _ in range(2):  # new inputs in the same buffers
        x.copy_(torch.randn_like(x))
        fresh = topk_for(p, tokens)
        topk.ids.copy_(fresh.ids)
        topk.weights.copy_(fresh.weights)
        graph.replay()
        want = run(experts, dispatched, prepared).clone()
        assert torch.equal(out, want)  # deterministic: replay == eager, bit for bit


@pytest.mark.parametrize("tokens, experts, top_k, local", [
    (4096, 32, 8, None), (16384, 128, 8, None), (16384, 8, 2, None),  # DeepSeek-V3-like, Qwen3, Mixtral
    (3000, 256, 8, 32),  # the DeepSeek-V3 EP8 slice: 32 of 256 experts here
])
def test_alignment_at_model_sizes(tokens, experts, top_k, local):
    ids = torch.rand(tokens, experts, device="cuda").argsort(1)[:, :top_k].int()
    expert_map, num_local = None, experts
    if local is not None:
        expert_map = torch.full((experts,), -1, dtype=torch.int32, device="cuda")
        expert_map[torch.randperm(experts, device="cuda")[:local]] = torch.arange(local, dtype=torch.int32,
                                                                                  device="cuda")
        num_local = local
    for block_m in (16, 64, 128):
        ws = WorkspaceManager("cuda").take(WorkspaceShapes.of(**align_buffers(ids.numel(), num_local, (block_m,))))
        got = align_block_size(ids, expert_map, num_local, block_m, ws)
        assert_same_block_layout(got, align_block_size_reference(ids, expert_map, num_local, block_m))
