"""Weight-only Triton paths on CPU, in Triton's interpreter: NVFP4 and MXFP8 weights and W4A8 MXFP4 (all
everywhere) and fp8 weights (as prepared for a GPU without fp8 tensor cores) with unquantized float16/float32
activations, against the weight-only reference (the scheme's weights dequantized, activations never rounded).

The bounds are the activations' dtype's, not the scheme's: the weights are dequantized exactly in the
kernel, so only the products' rounding and order differ (fp4/fp8 bounds would let a wrong scale pass).
"""

import os
import shutil

if not shutil.which("nvidia-smi"):  # a CPU machine: the interpreter, before triton decorates any kernel
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("CPU-interpreter tests (TRITON_INTERPRET=1); on a GPU, tests/gpu/test_triton_weight_only_gpu.py runs",
                allow_module_level=True)

from moe.experts._triton import config as cfg  # noqa: E402
from moe.experts._triton.config import ConfigTable  # noqa: E402
from moe.experts._triton.gemm import BatchedRows, grouped_gemm  # noqa: E402
from moe.experts._triton.support import config_key  # noqa: E402
from moe.experts._triton.weights import prepare_triton_weights, to_operand  # noqa: E402
from moe.experts.reference import ReferenceExperts, WeightOnlyReferenceExperts, reference_for  # noqa: E402
from moe.experts.triton import TritonExperts  # noqa: E402
from moe.formats import ActivationFormat, Dispatched, DispatchShape, OutputKind  # noqa: E402
from moe.platform import Platform  # noqa: E402
from moe.problem import MoEProblem, ParallelConfig  # noqa: E402
from moe.quant import QuantFormat, QuantizedTensor, dequantize, dequantize_nvfp4, quantize  # noqa: E402
from moe.router import TopK  # noqa: E402
from moe.testing.tolerance import assert_close_moe  # noqa: E402
from moe.weights import ExpertWeights  # noqa: E402
from moe.workspace import WorkspaceManager  # noqa: E402

REGIME = {torch.float16: "fp16", torch.float32: "fp32"}
# the bench presets (moe/presets), H and I divided by 16 or 32 (NVFP4 needs multiples of 32), fewer experts
BENCH_SHAPES = {
    "qwen3-30b-a3b": dict(E=32, k=8, H=128, I=96, activation="silu"),
    "gpt-oss-120b": dict(E=16, k=4, H=96, I=96, activation="swiglu_oai", bias=True),
    "deepseek-v3-ep8-slice": dict(E=64, k=8, H=224, I=64, activation="silu",
                                  expert_map=tuple(i // 2 if i % 2 == 0 else -1 for i in range(64))),
    "mixtral-8x7b": dict(E=8, k=2, H=128, I=448, activation="silu"),
}
DIRECT = cfg.LaunchConfig(16, cfg.TileConfig(64, 64), cfg.TileConfig(64, 64), direct=True)
SORTED = cfg.LaunchConfig(16, cfg.TileConfig(64, 64), cfg.TileConfig(64, 64), direct=False)


def make_problem(quant, *, E=8, k=2, H=64, I=96, activation="silu", bias=False, expert_map=None,
                 dtype=torch.float16) -> MoEProblem:
    parallel = ParallelConfig(expert_map=expert_map) if expert_map else ParallelConfig()
    return MoEProblem.create(num_experts=E, top_k=k, hidden_size=H, intermediate_size=I, activation=activation,
                             quant=quant, dtype=dtype, has_bias=bias, max_tokens=64, parallel=parallel)


def make_weights(p: MoEProblem, gen: torch.Generator) -> ExpertWeights:
    e, rows, h, i = p.local_num_experts, p.w13_rows, p.hidden_size, p.intermediate_size
    w13 = torch.randn(e, rows, h, generator=gen) / h**0.5
    w2 = torch.randn(e, h, i, generator=gen) / i**0.5
    # experts of different magnitudes: the global (or per-tensor) scale differs per expert
    w13 = w13 * torch.linspace(0.5, 4.0, e).view(e, 1, 1)
    b13 = 0.1 * torch.randn(e, rows, generator=gen) if p.has_bias else None
    b2 = 0.1 * torch.randn(e, h, generator=gen) if p.has_bias else None
    return ExpertWeights.from_dense(w13, w2, b13, b2, quant=p.quant, dtype=p.dtype)


def sparse_topk(p: MoEProblem, num_tokens: int, gen: torch.Generator) -> TopK:
    """Distinct experts per token, drawn from a small pool at small M: most experts are hit 0 or 1 times."""
    rows = [torch.randperm(p.num_experts, generator=gen)[: p.top_k] for _ in range(num_tokens)]
    ids = torch.stack(rows).int() if rows else torch.empty(0, p.top_k, dtype=torch.int32)
    return TopK(ids, torch.rand(num_tokens, p.top_k, generator=gen))


def run(experts, prepared, x: torch.Tensor | QuantizedTensor, topk: TopK) -> torch.Tensor:
    x = x if isinstance(x, QuantizedTensor) else QuantizedTensor(data=x, scale=None, fmt="none")
    dispatched = Dispatched(ActivationFormat.STANDARD, x, topk)
    shapes = experts.workspace_shapes(DispatchShape(ActivationFormat.STANDARD, topk.ids.shape[0]))
    return experts.apply(dispatched, prepared, WorkspaceManager().take(shapes, experts.name))


def weight_only_reference(p: MoEProblem, weights: ExpertWeights, x: torch.Tensor, topk: TopK) -> torch.Tensor:
    truth = WeightOnlyReferenceExperts(p)
    out = run(truth, truth.prepare_weights(weights), x, topk).out
    return (out * topk.weights.unsqueeze(-1)).sum(1)


def check(p: MoEProblem, num_tokens: int, config: cfg.LaunchConfig | None, monkeypatch, *, seed: int = 0) -> None:
    """Triton (weight-only: NVFP4 always, fp8 prepared as for an A100) against the weight-only reference,
    through the grouped GEMM (NVFP4's decode kernels are tests/test_triton_decode.py's)."""
    if config is not None:
        monkeypatch.setattr(cfg.ConfigTable, "lookup", lambda self, m: config)
    monkeypatch.setattr("moe.experts.triton.uses_decode", lambda *args: False)
    gen = torch.Generator().manual_seed(seed)
    weights = make_weights(p, gen)
    x = torch.randn(num_tokens, p.hidden_size, generator=gen).to(p.dtype)
    topk = sparse_topk(p, num_tokens, gen)
    experts = TritonExperts(p)
    table = ConfigTable.load(config_key(p, "standard", torch.device("cpu")))
    expert_map = p.parallel.global_to_local(p.num_experts) if p.parallel.enabled else None
    prepared = prepare_triton_weights(weights, expert_map, table, weight_only=True)
    result = run(experts, prepared, x, topk)
    assert result.kind is OutputKind.REDUCED and result.out.shape == (num_tokens, p.hidden_size)
    want = weight_only_reference(p, weights, x, topk)
    if num_tokens:
        assert want.abs().max() > 0
    assert_close_moe(result.out.float(), want, REGIME[p.dtype], context=f"{p.quant_name} M={num_tokens}")


# --- the experts against the weight-only reference -----------------------------------------------


@pytest.mark.parametrize("quant", ["nvfp4", "fp8", "fp8_token", "fp8_block", "mxfp8", "mxfp4_a_mxfp8"])
@pytest.mark.parametrize("num_tokens,config,dtype", [(1, DIRECT, torch.float16), (3, DIRECT, torch.float32),
                                                     (3, SORTED, torch.float16), (33, SORTED, torch.float32),
                                                     (0, None, torch.float16)])
def test_ragged_small_shapes(quant, dtype, num_tokens, config, monkeypatch):
    """M = 1, 3, 33 with 8 experts and k = 2: most experts hit 0 or 1 times; both row sources."""
    check(make_problem(quant, dtype=dtype), num_tokens, config, monkeypatch)


@pytest.mark.parametrize("shape", list(BENCH_SHAPES))
@pytest.mark.parametrize("quant,config", [("nvfp4", DIRECT), ("nvfp4", SORTED), ("fp8_block", SORTED),
                                          ("mxfp8", SORTED)],
                         ids=["nvfp4-direct", "nvfp4-sorted", "fp8_block-sorted", "mxfp8-sorted"])
def test_bench_shapes_scaled_down(shape, quant, config, monkeypatch):
    """Each preset's layer at 1/16 to 1/32 of its H and I; M = 3 (decode), both row sources for NVFP4."""
    check(make_problem(quant, **BENCH_SHAPES[shape]), 3, config, monkeypatch)


@pytest.mark.parametrize("quant", ["nvfp4", "fp8_block", "mxfp8"])
def test_non_gated_and_the_default_configs(quant, monkeypatch):
    check(make_problem(quant, activation="relu2", dtype=torch.float32), 33, None, monkeypatch)


def test_the_nvfp4_weight_only_path_is_far_from_the_w4a4_reference_but_close_to_its_own():
    """Why the kit needs `reference_for`: NVFP4 activations round far more than the weight-only path does."""
    p = make_problem("nvfp4", dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    weights, topk = make_weights(p, gen), sparse_topk(p, 33, gen)
    x = torch.randn(33, p.hidden_size, generator=gen)
    experts = TritonExperts(p)
    out = run(experts, experts.prepare_weights(weights), x, topk).out.float()
    reference = ReferenceExperts(p)
    w4a4 = run(reference, reference.prepare_weights(weights), quantize(x, p.quant.activation, "activation"), topk).out
    w4a4 = (w4a4 * topk.weights.unsqueeze(-1)).sum(1)
    assert ((out - w4a4).norm() / w4a4.norm()).item() > 1e-2
    assert_close_moe(out, weight_only_reference(p, weights, x, topk), "fp32")
    assert reference_for(TritonExperts, p, Platform.cpu()) is WeightOnlyReferenceExperts


def test_prepare_picks_weight_only_by_scheme_on_the_cpu():
    """Off CUDA no arch is known: NVFP4 runs weight-only (everywhere), fp8 as W8A8 (fp8 payload kept)."""
    gen = torch.Generator().manual_seed(2)
    nvfp4, fp8 = make_problem("nvfp4"), make_problem("fp8")
    assert TritonExperts(nvfp4).prepare_weights(make_weights(nvfp4, gen)).weight_only
    prepared = TritonExperts(fp8).prepare_weights(make_weights(fp8, gen))
    assert not prepared.weight_only and prepared.w13.data.dtype == torch.float8_e4m3fn
    table = ConfigTable.load(config_key(fp8, "standard", torch.device("cpu")))
    as_on_a100 = prepare_triton_weights(make_weights(fp8, gen), None, table, weight_only=True)
    assert as_on_a100.w13.data.dtype == torch.uint8 and as_on_a100.w2.data.dtype == torch.uint8
    mxfp8 = make_problem("mxfp8")  # weight-only everywhere: the e4m3 bits, the e8m0 bytes as scale words
    prepared = TritonExperts(mxfp8).prepare_weights(make_weights(mxfp8, gen))
    assert prepared.weight_only and prepared.w13.data.dtype == torch.uint8
    assert prepared.w13.scale.dtype == torch.int32 and prepared.w13.scale.shape == (8, 2 * 96, 1)  # K = 64: 1 word


def test_w4a8_mxfp4_reads_the_w4a16_config_tables():
    """Same kernels, same tuned tables (e.g. GPT-OSS-120B's H200 mxfp4 table); the batched experts, which
    have no weight-only path, and schemes whose weights take no unquantized activations keep their own."""
    cpu = torch.device("cpu")
    w4a8, w4a16, nvfp4 = (make_problem(q) for q in ("mxfp4_a_mxfp8", "mxfp4", "nvfp4"))
    assert config_key(w4a8, "standard", cpu) == config_key(w4a16, "standard", cpu)
    assert config_key(w4a8, "standard", cpu).scheme == "mxfp4"
    assert config_key(w4a8, "batched", cpu).scheme == "mxfp4_a_mxfp8"
    assert config_key(nvfp4, "standard", cpu).scheme == "nvfp4"


def test_w4a8_mxfp4_runs_as_w4a16():
    """mxfp4_a_mxfp8 on a GPU without mxfp8 MMA: the MXFP4 kernels with unquantized activations, bit for bit
    the W4A16 layer on the same weights, its decode kernels included (M = 2: 4 slots; M = 33: grouped)."""
    gen = torch.Generator().manual_seed(3)
    w4a8, w4a16 = make_problem("mxfp4_a_mxfp8", dtype=torch.float32), make_problem("mxfp4", dtype=torch.float32)
    weights = make_weights(w4a16, gen)
    assert weights.w13.fmt is QuantFormat.MXFP4
    for num_tokens in (2, 33):
        x, topk = torch.randn(num_tokens, w4a16.hidden_size, generator=gen), sparse_topk(w4a16, num_tokens, gen)
        outs = [run(experts, experts.prepare_weights(weights), x, topk).out
                for experts in (TritonExperts(w4a8), TritonExperts(w4a16))]
        assert outs[0].abs().max() > 0 and torch.equal(outs[0], outs[1])


# --- the in-register dequantization, bit for bit ---------------------------------------------------


def _read_back(q: QuantizedTensor, weight_only: bool, block_k: int) -> torch.Tensor:
    """One-hot float32 rows of A read the kernel's dequantized weights back: ``[E, N, K]``."""
    e, n, k = q.data.shape[0], q.data.shape[1], q.data.shape[2] * (2 if q.fmt.is_packed_fp4 else 1)
    a = torch.eye(k).repeat(e, 1)
    out = torch.empty(e * k, n)
    rows = BatchedRows(torch.full((e,), k, dtype=torch.int32), k)
    grouped_gemm(a, None, to_operand(q, None, weight_only), out, rows, None, 16, cfg.TileConfig(32, block_k))
    return out.view(e, k, n).transpose(1, 2)


@pytest.mark.parametrize("k,block_k", [(96, 64), (160, 128), (256, 256)])
def test_nvfp4_gemm_dequantizes_exactly(k, block_k):
    """Every e2m1 code, e4m3 scale bytes across the range (subnormals included), a global scale per
    expert, K and N tails: bit for bit `dequantize_nvfp4`."""
    e, n = 2, 40
    scale_bits = torch.randint(1, 127, (e, n, k // 16), dtype=torch.uint8)  # 0x01..0x7E: positive, no NaN
    q = QuantizedTensor(data=torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8),
                        scale=scale_bits.view(torch.float8_e4m3fn), global_scale=torch.tensor([0.37, 1.9e-3]),
                        fmt="nvfp4", role="weight")
    want = dequantize_nvfp4(q.data, q.scale, q.global_scale)
    assert torch.equal(_read_back(q, True, block_k), want)


@pytest.mark.parametrize("fmt", ["fp8_tensor", "fp8_row", "fp8_block"])
def test_fp8_weight_only_gemm_dequantizes_exactly(fmt):
    """Every finite e4m3 byte (both signs, subnormals) decoded from its uint8 bits: bit for bit `dequantize`."""
    e, n, k = 2, 136, 254  # 2 * 136 * 254 bytes cover each of the 254 finite codes many times; N and K tails
    codes = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)
    payload = codes[torch.arange(e * n * k) % codes.numel()].view(e, n, k).view(torch.float8_e4m3fn)
    scale_shape = {"fp8_tensor": (e,), "fp8_row": (e, n, 1), "fp8_block": (e, 2, 2)}[fmt]
    q = QuantizedTensor(data=payload, scale=torch.rand(scale_shape) + 0.01, fmt=fmt, role="weight")
    assert torch.equal(_read_back(q, True, 64), dequantize(q, torch.float32))


@pytest.mark.parametrize("k,block_k", [(96, 64), (160, 128), (256, 256)])
def test_mxfp8_gemm_dequantizes_exactly(k, block_k):
    """Every finite e4m3 byte (both signs, subnormals) times e8m0 scales from 2**-100 to 2**100, K tails
    (whole groups of 32 past the last full tile) and an N tail: bit for bit `dequantize`."""
    e, n = 2, 40
    codes = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)
    payload = codes[torch.randperm(e * n * k) % codes.numel()].view(e, n, k).view(torch.float8_e4m3fn)
    scale = torch.randint(27, 228, (e, n, k // 32), dtype=torch.uint8)
    q = QuantizedTensor(data=payload, scale=scale, fmt="mxfp8", role="weight")
    assert torch.equal(_read_back(q, True, block_k), dequantize(q, torch.float32))
