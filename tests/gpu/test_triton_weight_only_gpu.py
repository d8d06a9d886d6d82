"""Weight-only Triton paths on a CUDA GPU, in bfloat16: NVFP4, MXFP8 and W4A8 MXFP4 weights, and fp8 weights decoded in registers
(what an A100 runs; on newer GPUs the same path is forced through ``prepare_triton_weights(weight_only=True)``),
against the weight-only reference; the dequantization bit for bit; CUDA-graph replay equal to eager with no
host synchronization."""

from __future__ import annotations

import pytest
import torch

from moe.experts._triton.config import ConfigTable, TileConfig
from moe.experts._triton.gemm import BatchedRows, grouped_gemm
from moe.experts._triton.support import config_key
from moe.experts._triton.weights import prepare_triton_weights, to_operand
from moe.experts.reference import WeightOnlyReferenceExperts
from moe.experts.triton import TritonExperts
from moe.formats import ActivationFormat, Dispatched, DispatchShape
from moe.platform import Platform
from moe.problem import MoEProblem, ParallelConfig
from moe.quant import QuantizedTensor, dequantize
from moe.testing.tolerance import assert_close_moe
from tests.gpu.test_triton_gpu import assert_replay_equals_eager_without_sync, topk_for
from tests.gpu.test_triton_gpu import weights_for as triton_weights_for
from moe.workspace import WorkspaceManager

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

SCHEMES = ("nvfp4", "fp8", "fp8_token", "fp8_block", "mxfp8", "mxfp4_a_mxfp8")


def problem(quant, activation="silu", *, E=16, k=4, H=512, I=384, bias=False, expert_map=None, max_tokens=512):
    parallel = ParallelConfig(expert_map=expert_map) if expert_map else ParallelConfig()
    return MoEProblem.create(num_experts=E, top_k=k, hidden_size=H, intermediate_size=I, activation=activation,
                             quant=quant, dtype=torch.bfloat16, has_bias=bias, max_tokens=max_tokens,
                             parallel=parallel)


def weights_for(p):
    return triton_weights_for(p, spread=(0.5, 4.0))


def weight_only(p, weights):
    """Triton's weights prepared weight-only, as an A100 prepares fp8 (and every GPU NVFP4)."""
    table = ConfigTable.load(config_key(p, "standard", weights.device))
    expert_map = p.parallel.global_to_local(p.num_experts) if p.parallel.enabled else None
    return prepare_triton_weights(weights, expert_map, table, weight_only=True)


def run(experts, prepared, x, topk):
    dispatched = Dispatched(ActivationFormat.STANDARD, QuantizedTensor(data=x, scale=None, fmt="none"), topk)
    shapes = experts.workspace_shapes(DispatchShape(ActivationFormat.STANDARD, x.shape[0]))
    return experts.apply(dispatched, prepared, WorkspaceManager("cuda").take(shapes)).out


def check(p, tokens):
    weights = weights_for(p)
    x = torch.randn(tokens, p.hidden_size, device="cuda", dtype=p.dtype)
    topk = topk_for(p, tokens)
    experts = TritonExperts(p)
    assert experts.check(p, Platform.detect()) == []
    out = run(experts, weight_only(p, weights), x, topk)
    truth = WeightOnlyReferenceExperts(p)
    ref = run(truth, truth.prepare_weights(weights), x, topk)
    ref = (ref * topk.weights.unsqueeze(-1)).sum(1)
    assert ref.abs().max() > 0
    # the weights are exact in bfloat16: only the activations' bfloat16 rounding remains
    assert_close_moe(out.float(), ref, "bf16", context=f"{p.quant_name} {p.activation} M={tokens}")


# fp8: 1..4 direct rows (one program per slot), then sorted; NVFP4: the decode kernels up to M * k = 256
@pytest.mark.parametrize("tokens", [1, 3, 16, 33, 512])
@pytest.mark.parametrize("quant", SCHEMES)
def test_schemes(quant, tokens):
    check(problem(quant), tokens)


@pytest.mark.parametrize("tokens", [1, 3, 33])
def test_nvfp4_grouped_gemm_at_decode_sizes(tokens, monkeypatch):
    """The grouped GEMM's NVFP4 path where the decode kernels would serve (forced), as before them."""
    monkeypatch.setattr("moe.experts.triton.uses_decode", lambda *a: False)
    check(problem("nvfp4"), tokens)


def test_nvfp4_decode_kernels_serve_a_few_tokens(monkeypatch):
    from moe.experts._triton import decode

    called = []
    monkeypatch.setattr("moe.experts.triton.decode_experts", lambda *a: called.append(1) or decode.decode_experts(*a))
    check(problem("nvfp4", "swiglu_oai", bias=True), 16)
    assert called == [1]


@pytest.mark.parametrize("activation", ["swiglu_oai", "relu2"])
@pytest.mark.parametrize("quant", ["nvfp4", "fp8_block", "mxfp8"])
def test_activations_with_bias_and_expert_map(activation, quant):
    expert_map = tuple(i // 2 if i % 2 == 0 else -1 for i in range(16))
    check(problem(quant, activation, bias=True, expert_map=expert_map), 100)


@pytest.mark.parametrize("quant", ["nvfp4", "mxfp8"])
def test_gpt_oss_sizes(quant):
    """H = I = 2880: K tails for 128-wide K tiles (2880 = 22.5 * 128)."""
    check(problem(quant, "swiglu_oai", E=8, k=4, H=2880, I=2880, bias=True), 65)


def test_prepare_runs_fp8_weight_only_exactly_where_the_gpu_lacks_fp8_tensor_cores():
    p = problem("fp8_block")
    prepared = TritonExperts(p).prepare_weights(weights_for(p))
    major, minor = torch.cuda.get_device_capability()
    assert prepared.weight_only == (major * 10 + minor in (80, 86, 87))
    for quant in ("nvfp4", "mxfp8", "mxfp4_a_mxfp8"):  # weight-only on every GPU
        assert TritonExperts(problem(quant)).prepare_weights(weights_for(problem(quant))).weight_only


@pytest.mark.parametrize("block_m,block_k", [(16, 64), (64, 128)])
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_tensor", "fp8_block", "mxfp8"])
def test_dequantizes_exactly(fmt, block_m, block_k):
    """One-hot bf16 rows of A read the kernel's dequantized weights back (K = 2880: a K tail; N = 72):
    bit for bit the reference dequantization rounded to bf16 (mma v2 and wgmma tiles)."""
    e, n, k = 2, 72, 2880
    if fmt == "nvfp4":
        scale = torch.randint(16, 100, (e, n, k // 16), dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
        q = QuantizedTensor(data=torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device="cuda"),
                            scale=scale, global_scale=torch.tensor([0.5, 2.0], device="cuda"), fmt=fmt, role="weight")
    else:
        codes = torch.randint(0, 126, (e, n, k), dtype=torch.uint8, device="cuda")  # finite, both signs below
        codes |= torch.randint(0, 2, codes.shape, dtype=torch.uint8, device="cuda") << 7
        if fmt == "mxfp8":  # e8m0 bytes: 2**-20 .. 2**10
            scale = torch.randint(107, 138, (e, n, k // 32), dtype=torch.uint8, device="cuda")
        else:
            scale = torch.full((e,) if fmt == "fp8_tensor" else (e, 1, 23), 0.25, device="cuda")
        q = QuantizedTensor(data=codes.view(torch.float8_e4m3fn), scale=scale, fmt=fmt, role="weight")
    a = torch.eye(k, device="cuda", dtype=torch.bfloat16).repeat(e, 1)
    out = torch.empty(e * k, n, device="cuda", dtype=torch.bfloat16)
    rows = BatchedRows(torch.full((e,), k, dtype=torch.int32, device="cuda"), k)
    grouped_gemm(a, None, to_operand(q, None, weight_only=True), out, rows, None, block_m, TileConfig(64, block_k))
    want = dequantize(q, torch.float32).transpose(1, 2).to(torch.bfloat16)
    assert torch.equal(out.view(e, k, n), want)


@pytest.mark.parametrize("tokens", [4, 300])  # direct rows, sorted rows
@pytest.mark.parametrize("quant", ["nvfp4", "fp8", "fp8_block", "mxfp8"])
def test_cuda_graph_replay_equals_eager_without_host_sync(quant, tokens):
    p = problem(quant, E=32, k=8, H=1024, I=512, max_tokens=300)
    assert_replay_equals_eager_without_sync(TritonExperts(p), weight_only(p, weights_for(p)), p, tokens)
