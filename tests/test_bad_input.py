"""Bad input through the Python API, as a new user would hand it in (issue 12).

Every case raises a typed `moe` error whose message holds each listed fragment: the argument that is
wrong, its shape or value, the constraint, and where it applies the layer's own sizes. Most cases were
unclear, misleading, an ``AttributeError``/``TypeError``/``RuntimeError`` from deep inside, or silent
before (the comment on each group says which); a few that were already clear (int logits, int or
non-finite weights) stay in the walk so that it covers every argument of the call.
"""

from __future__ import annotations

import functools

import pytest
import torch

from moe import (
    ExpertWeights,
    FusedMoE,
    LocalPrepareFinalize,
    MoEConfigError,
    MoEProblem,
    ModularKernel,
    ParallelConfig,
    ReferenceExperts,
    Router,
    TopK,
    TorchGroupedExperts,
)
from moe.activation import Activation
from moe.experts.base import Experts
from moe.experts.reference import DenseWeights
from moe.experts.triton import TritonExperts
from moe.formats import ActivationFormat, Dispatched
from moe.loaders import load_experts
from moe.quant import (
    QuantFormat,
    QuantizedTensor,
    dequantize_mxfp4,
    dequantize_nvfp4,
    quantize_fp8_blockwise,
    quantize_fp8_groupwise,
)
from moe.weights import check_dense_for
from moe.workspace import WorkspaceManager
from tests.helpers import make_problem, random_inputs, random_weights

# H != 2I, so a transposed w13 [E, H, 2I] cannot pass for [E, 2I, H]
E, K, H, I = 4, 2, 128, 32


def build(**kwargs) -> FusedMoE:
    args = dict(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, dtype=torch.float32, quant="fp32")
    return FusedMoE(**{**args, **kwargs})


@functools.cache
def loaded(**kwargs) -> FusedMoE:
    layer = build(max_tokens=16, **kwargs)
    layer.load_weights(w13=torch.randn(E, 2 * I, H) / 8, w2=torch.randn(E, H, I) / 8)
    return layer


def dense(experts=E, rows=2 * I, hidden=H, inter=I) -> dict[str, torch.Tensor]:
    return {"w13": torch.randn(experts, rows, hidden), "w2": torch.randn(experts, hidden, inter)}


def qwen3_checkpoint(prefix: str = "", transpose_gate_up: bool = False) -> dict[str, torch.Tensor]:
    tensors = {}
    for e in range(E):
        for name, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            flip = transpose_gate_up and name != "down_proj"
            tensors[f"{prefix}experts.{e}.{name}.weight"] = torch.randn(shape[::-1] if flip else shape)
    return tensors


@functools.cache
def reference_kernel():
    """A kernel (E=6, H=40, I=24) with canonical weights loaded, those weights, and inputs of M=5."""
    p = make_problem(max_tokens=16)
    hidden, topk = random_inputs(p, 5)
    kernel, weights = ModularKernel(LocalPrepareFinalize(p), ReferenceExperts(p)), random_weights(p)
    kernel.load(weights)
    return kernel, weights, hidden, topk


def kernel_forward(hidden=None, topk=None, **kwargs):
    kernel, _, default_hidden, default_topk = reference_kernel()
    hidden = default_hidden if hidden is None else hidden
    return kernel.forward(hidden, default_topk if topk is None else topk, **kwargs)


def grouped_kernel() -> ModularKernel:
    kernel = reference_kernel()[0]
    return ModularKernel(LocalPrepareFinalize(kernel.problem), TorchGroupedExperts(kernel.problem))


def experts_apply(experts, weights):
    """``experts.apply`` on the reference kernel's inputs with ``weights``: where prepared weights are
    handed in (a kernel prepares its own at ``load``)."""
    _, _, hidden, topk = reference_kernel()
    dispatched = Dispatched(ActivationFormat.STANDARD, QuantizedTensor(data=hidden, scale=None, fmt=QuantFormat.NONE), topk)
    workspace = WorkspaceManager("cpu").take(experts.workspace_shapes(LocalPrepareFinalize(experts.problem).dispatch_shape(5)))
    return experts.apply(dispatched, weights, workspace)


def prepared_for_other_sizes():
    p = make_problem(max_tokens=16, hidden_size=80)
    return ReferenceExperts(p).prepare_weights(random_weights(p))


def triton_apply_unprepared():
    """``TritonExperts(p).apply(dispatched, ExpertWeights.from_dense(...), workspace)``: never prepared."""
    p = make_problem(max_tokens=16, quant="fp32", dtype=torch.float32)
    experts = TritonExperts(p)
    hidden, topk = random_inputs(p, 3)
    dispatched = Dispatched(ActivationFormat.STANDARD, QuantizedTensor(data=hidden, scale=None, fmt=QuantFormat.NONE), topk)
    workspace = WorkspaceManager("cpu").take(experts.workspace_shapes(LocalPrepareFinalize(p).dispatch_shape(3)))
    return experts.apply(dispatched, random_weights(p), workspace)


def x(m: int = 3, hidden: int = H) -> torch.Tensor:
    return torch.randn(m, hidden)


def logits(m: int = 3, experts: int = E) -> torch.Tensor:
    return torch.randn(m, experts)


def ids(m: int = 3) -> torch.Tensor:
    """int64 expert ids [m, K] in range, as model code that routes itself hands them in."""
    return torch.stack([torch.randperm(E)[:K] for _ in range(m)])


CASES = [
    # --- FusedMoE.forward: router_logits was blamed on M, hidden_states of the wrong rank was reported
    #     as a router_logits problem, and lists/arrays/meta tensors raised AttributeError/RuntimeError
    ("logits [1, E] for x [64, H]", lambda: loaded()(x(16), logits(1)),
     ["router_logits", "[16, 4]", "got shape [1, 4]", "E=4, k=2, H=128, I=32"]),
    ("logits [M, E+1]", lambda: loaded()(x(), logits(3, E + 1)), ["router_logits", "[3, 4]", "got shape [3, 5]"]),
    ("logits a list", lambda: loaded()(x(), [[0.0] * E] * 3), ["router_logits", "torch.Tensor", "got list"]),
    ("logits int", lambda: loaded()(x(), torch.ones(3, E, dtype=torch.int64)),
     ["router_logits", "floating point", "torch.int64"]),
    ("logits on meta", lambda: loaded()(x(), logits().to("meta")), ["router_logits is on meta", "hidden_states is on cpu"]),
    ("hidden 1-D", lambda: loaded()(torch.randn(H), logits(1)), ["hidden_states", "[M, 128]", "got shape [128]", "H=128"]),
    ("hidden 3-D", lambda: loaded()(torch.randn(1, 3, H), logits()), ["hidden_states", "got shape [1, 3, 128]"]),
    ("hidden wrong H", lambda: loaded()(x(hidden=H + 1), logits()), ["hidden_states", "[M, 128]", "[3, 129]", "I=32"]),
    ("hidden bf16", lambda: loaded()(x().bfloat16(), logits()), ["hidden_states", "torch.float32", "got torch.bfloat16"]),
    ("hidden ndarray", lambda: loaded()(x().numpy(), logits()), ["hidden_states", "torch.Tensor", "ndarray"]),
    ("hidden on meta", lambda: loaded()(x().to("meta"), logits()), ["hidden_states is on meta", "layer was built for cpu"]),
    ("M > max_tokens", lambda: loaded()(x(17), logits(17)), ["hidden_states", "M=17", "max_tokens=16"]),
    ("shared_output [2, H]", lambda: loaded()(x(), logits(), x(2)), ["shared_output", "[3, 128]", "[2, 128]"]),
    ("shared_output a list", lambda: loaded()(x(), logits(), [0.0]), ["shared_output", "got list"]),
    ("shared_output on meta", lambda: loaded()(x(), logits(), x().to("meta")), ["shared_output", "on meta"]),
    # --- FusedMoE.forward with precomputed routing (issue 13's top-k entry point)
    ("no routing at all", lambda: loaded()(x()), ["routing one way", "router_logits [M, E]", "got none of them"]),
    ("logits and topk", lambda: loaded()(x(), logits(), topk=Router("softmax", E, K)(logits())),
     ["routing one way", "got router_logits and topk"]),
    ("topk_ids without weights", lambda: loaded()(x(), topk_ids=ids()), ["topk_ids and topk_weights go together",
                                                                         "topk_weights is missing"]),
    ("topk_ids float", lambda: loaded()(x(), topk_ids=ids().float(), topk_weights=torch.rand(3, K)),
     ["topk_ids must be an integer torch.Tensor", "torch.float32"]),
    ("topk_weights int", lambda: loaded()(x(), topk_ids=ids(), topk_weights=torch.ones(3, K, dtype=torch.int64)),
     ["topk_weights must be a floating-point", "torch.int64"]),
    ("topk_weights a list", lambda: loaded()(x(), topk_ids=ids(), topk_weights=[[0.5, 0.5]] * 3),
     ["topk_weights must be a floating-point", "got list"]),
    ("topk_ids out of range", lambda: loaded()(x(), topk_ids=ids() + E, topk_weights=torch.rand(3, K)),
     ["topk_ids must lie in [0, num_experts=4)", "[4, 7]"]),
    ("topk_ids negative", lambda: loaded()(x(), topk_ids=-ids() - 1, topk_weights=torch.rand(3, K)),
     ["topk_ids must lie in [0, num_experts=4)"]),
    ("topk_ids [M, k+1]", lambda: loaded()(x(), topk_ids=torch.zeros(3, K + 1, dtype=torch.int64),
                                           topk_weights=torch.rand(3, K + 1)),
     ["topk_ids must be [M, top_k] = [3, 2]", "got [3, 3]"]),
    ("topk_ids for another M", lambda: loaded()(x(5), topk_ids=ids(), topk_weights=torch.rand(3, K)),
     ["topk_ids must be [M, top_k] = [5, 2]", "got [3, 2]"]),
    ("topk_ids and weights differ", lambda: loaded()(x(), topk_ids=ids(), topk_weights=torch.rand(3, K + 1)),
     ["TopK ids and weights must both be [M, k]", "(3, 2)", "(3, 3)"]),
    ("topk a tuple", lambda: loaded()(x(), topk=(ids(), torch.rand(3, K))), ["topk must be a moe.TopK", "got tuple"]),
    # --- FusedMoE.load_weights: a transposed w13 was reported as a w2 problem with the wrong H; None and
    #     meta tensors raised AttributeError/RuntimeError
    ("w13 transposed [E, H, 2I]", lambda: build().load_weights(w13=torch.randn(E, H, 2 * I), w2=torch.randn(E, H, I)),
     ["w13: expected shape [E, 2I, H] rows [gate; up] = [4, 64, 128]", "got [4, 128, 64]", "E=4", "H=128, I=32",
      "w13.transpose(1, 2)"]),
    ("w2 transposed [E, I, H]", lambda: build().load_weights(w13=torch.randn(E, 2 * I, H), w2=torch.randn(E, I, H)),
     ["w2: expected shape [E, H, I] = [4, 128, 32]", "got [4, 32, 128]", "w2.transpose(1, 2)"]),
    ("relu2 w13 transposed", lambda: build(activation="relu2").load_weights(w13=torch.randn(E, H, I), w2=torch.randn(E, H, I)),
     ["w13: expected shape [E, I, H]", "relu2 is not gated", "[4, 32, 128]", "got [4, 128, 32]"]),
    ("mxfp4 w13 transposed", lambda: build(quant="mxfp4", dtype=torch.bfloat16).load_weights(
        w13=torch.randn(E, H, 2 * I), w2=torch.randn(E, H, I)), ["w13: expected shape", "[4, 64, 128]", "got [4, 128, 64]"]),
    ("w13 wrong expert count", lambda: build().load_weights(**dense(experts=E + 1)), ["w13", "[4, 64, 128]", "got [5, 64, 128]"]),
    ("w13 int", lambda: build().load_weights(w13=torch.ones(E, 2 * I, H, dtype=torch.int64), w2=torch.randn(E, H, I)),
     ["w13", "dtype", "torch.int64"]),
    ("w13 None", lambda: build().load_weights(w13=None, w2=torch.randn(E, H, I)), ["w13: missing", "[E, 2I, H]"]),
    ("w13 on meta", lambda: build().load_weights(**{**dense(), "w13": torch.randn(E, 2 * I, H, device="meta")}),
     ["w13", "meta tensor", "no values"]),
    ("w2 NaN", lambda: build().load_weights(**{**dense(), "w2": torch.full((E, H, I), float("nan"))}), ["w2 contains NaN"]),
    ("biases for a layer without", lambda: build().load_weights(**dense(), b13=torch.randn(E, 2 * I), b2=torch.randn(E, H)),
     ["b13", "has_bias=False", "has_bias=True"]),
    ("b13 wrong shape", lambda: build(has_bias=True).load_weights(**dense(), b13=torch.randn(E, I), b2=torch.randn(E, H)),
     ["b13: expected shape [E, 2I] = [4, 64]", "got [4, 32]"]),
    ("b2 missing", lambda: build(has_bias=True).load_weights(**dense(), b13=torch.randn(E, 2 * I)),
     ["b2: missing", "has_bias=True", "[E, H]"]),
    ("b2 int", lambda: build(has_bias=True).load_weights(**dense(), b13=torch.randn(E, 2 * I), b2=torch.ones(E, H, dtype=torch.int32)),
     ["b2", "torch.int32"]),
    ("b13 inf", lambda: build(has_bias=True).load_weights(**dense(), b13=torch.full((E, 2 * I), float("inf")), b2=torch.randn(E, H)),
     ["b13 contains inf"]),
    # --- ExpertWeights.from_dense, without a layer to compare with: same transposition findings
    ("from_dense w13 transposed", lambda: ExpertWeights.from_dense(torch.randn(E, H, 2 * I), torch.randn(E, H, I)),
     ["w13: transposed", "got w13 [4, 128, 64]", "expected w13 [4, 64, 128]", "w13.transpose(1, 2)"]),
    ("from_dense w2 transposed", lambda: ExpertWeights.from_dense(torch.randn(E, 2 * I, H), torch.randn(E, I, H)),
     ["w2: transposed", "w2 [4, 32, 128]", "w2 [4, 128, 32]"]),
    ("from_dense both transposed", lambda: ExpertWeights.from_dense(torch.randn(E, H, 2 * I), torch.randn(E, I, H)),
     ["w13 and w2: transposed", "w13.transpose(1, 2), w2.transpose(1, 2)"]),
    ("from_dense I = 0", lambda: ExpertWeights.from_dense(torch.randn(E, 0, H), torch.randn(E, H, 0)), ["I must be >= 1", "I=0"]),
    ("from_dense on meta", lambda: ExpertWeights.from_dense(torch.randn(E, 2 * I, H, device="meta"), torch.randn(E, H, I)),
     ["w13", "meta"]),
    ("validate other H", lambda: ExpertWeights.from_dense(**dense(hidden=64)).validate(build().problem),
     ["w13: the weights are [4, 64, 64]", "[E, 2I, H] rows [gate; up] = [4, 64, 128]", "E=4, k=2, H=128, I=32"]),
    # --- load_checkpoint / load_experts: transposed gate/up was blamed on down_proj; a list or a None
    #     prefix raised AttributeError/TypeError
    ("checkpoint gate/up transposed", lambda: build().load_checkpoint(qwen3_checkpoint(transpose_gate_up=True), "qwen3"),
     ["'experts.0.gate_proj.weight'", "[I, H] = (32, 128)", "H=128, I=32", "got (128, 32)"]),
    ("checkpoint of another H", lambda: build(hidden_size=64).load_checkpoint(qwen3_checkpoint(), "qwen3"),
     ["'experts.0.gate_proj.weight'", "(32, 64)", "got (32, 128)"]),
    ("gpt_oss gate_up stored [E, 2I, H]", lambda: build(has_bias=True, activation="swiglu_oai").load_checkpoint(
        {"experts.gate_up_proj": torch.randn(E, 2 * I, H), "experts.down_proj": torch.randn(E, I, H),
         "experts.gate_up_proj_bias": torch.randn(E, 2 * I), "experts.down_proj_bias": torch.randn(E, H)}, "gpt_oss"),
     ["'experts.gate_up_proj'", "[E, H, 2I] = (4, 128, 64)", "got (4, 64, 128)"]),
    ("checkpoint a list", lambda: build().load_checkpoint([1, 2], "qwen3"), ["tensors", "mapping", "got list"]),
    ("checkpoint prefix None", lambda: build().load_checkpoint(qwen3_checkpoint(), "qwen3", prefix=None), ["prefix", "got None"]),
    ("checkpoint prefix without its dot", lambda: build().load_checkpoint(qwen3_checkpoint("mlp."), "qwen3", prefix="mlp"),
     ["missing key 'mlpexperts.0.gate_proj.weight'", "did you mean prefix='mlp.'"]),
    ("checkpoint of another layout", lambda: load_experts(
        {k.replace("gate_proj", "w1").replace("up_proj", "w3").replace("down_proj", "w2"): v for k, v in qwen3_checkpoint().items()},
        "qwen3", num_experts=E), ["'experts.0.gate_proj.weight'", "the keys look like the 'mixtral' layout"]),
    # --- ModularKernel.load / Experts.apply: unprepared or foreign weights gave AttributeError, weights
    #     of other sizes a matmul RuntimeError; a tuple for topk or a list for hidden an AttributeError
    ("kernel's experts given unprepared ExpertWeights", lambda: experts_apply(reference_kernel()[0].experts,
                                                                              reference_kernel()[1]),
     ["weights", "reference", "DenseWeights", "unprepared ExpertWeights", "experts.prepare_weights(weights)"]),
    ("kernel weights None", lambda: reference_kernel()[0].load(None), ["weights", "DenseWeights", "got None"]),
    ("torch_grouped unprepared", lambda: experts_apply(grouped_kernel().experts, reference_kernel()[1]),
     ["torch_grouped", "GroupedWeights", "unprepared ExpertWeights"]),
    ("torch_grouped given DenseWeights", lambda: grouped_kernel().load(ReferenceExperts(reference_kernel()[0].problem).prepare_weights(
        reference_kernel()[1])), ["GroupedWeights", "got DenseWeights"]),
    ("kernel given its own prepared weights", lambda: reference_kernel()[0].load(
        reference_kernel()[0].experts.prepare_weights(reference_kernel()[1])),
     ["kernel.load takes the canonical ExpertWeights", "got DenseWeights (prepared already"]),
    ("kernel forward before load", lambda: grouped_kernel().forward(*reference_kernel()[2:]),
     ["ModularKernel(local + torch_grouped) has no weights", "kernel.load(weights)"]),
    ("kernel buckets out of range", lambda: grouped_kernel().load(reference_kernel()[1], buckets=(0, 4, 17)),
     ["buckets must be token counts in [1, max_tokens=16]", "got [0, 17]"]),
    ("kernel workspace a str", lambda: ModularKernel(LocalPrepareFinalize(reference_kernel()[0].problem),
                                                     ReferenceExperts(reference_kernel()[0].problem), workspace="cpu"),
     ["workspace must be a moe.WorkspaceManager", "got str"]),
    ("kernel workspace on another device", lambda: ModularKernel(LocalPrepareFinalize(reference_kernel()[0].problem),
                                                                 ReferenceExperts(reference_kernel()[0].problem),
                                                                 workspace=WorkspaceManager("meta")),
     ["workspace is on meta but the kernel is built for cpu"]),
    ("triton apply unprepared", triton_apply_unprepared, ["triton", "TritonWeights", "unprepared ExpertWeights", "prepare_weights"]),
    ("reference apply unprepared", lambda: ReferenceExperts(reference_kernel()[0].problem).apply(None, reference_kernel()[1], None),
     ["reference", "DenseWeights", "unprepared ExpertWeights"]),
    ("kernel's experts given weights of other sizes", lambda: experts_apply(reference_kernel()[0].experts,
                                                                            prepared_for_other_sizes()),
     ["weights: prepared for E=6, H=80, I=24", "built for E=6, k=2, H=40, I=24", "prepare_weights"]),
    ("kernel topk a tuple", lambda: kernel_forward(topk=(reference_kernel()[3].ids, reference_kernel()[3].weights)),
     ["topk must be a moe.TopK", "got tuple"]),
    ("kernel hidden a list", lambda: kernel_forward(hidden=[[0.0] * 40]), ["hidden must be a torch.Tensor [M, 40]", "got list"]),
    ("kernel shared_output on meta", lambda: kernel_forward(shared_output=torch.zeros(5, 40, dtype=torch.bfloat16, device="meta")),
     ["shared_output must match hidden", "on meta"]),
    # --- FusedMoE(...): AssertionError/RuntimeError for devices, TypeError naming Router for an unknown
    #     keyword, AttributeError for wrong types, a dtype blamed on the default quant, silent has_bias,
    #     an H that no weights can ever be stored for
    ("device tpu", lambda: build(device="tpu"), ["device", "'tpu'", "'cpu' or 'cuda'"]),
    ("device an int", lambda: build(device=3), ["device", "3"]),
    ("unknown keyword", lambda: build(num_groups=2), ["FusedMoE", "num_groups", "renormalize, n_group"]),
    ("has_bias a str", lambda: build(has_bias="no"), ["has_bias must be a bool", "'no'"]),
    ("parallel a str", lambda: build(parallel="ep2"), ["parallel must be a ParallelConfig", "'ep2'"]),
    ("policy a str", lambda: build(policy="triton"), ["policy must be a Policy", "'triton'"]),
    ("platform a str", lambda: build(platform="h100"), ["platform must be a Platform", "'h100'", "Platform.preset"]),
    ("dtype float64 (default quant)", lambda: FusedMoE(E, K, H, I, dtype=torch.float64),
     ["dtype must be one of", "torch.float64"]),
    ("dtype a str (default quant)", lambda: FusedMoE(E, K, H, I, dtype="bf16"), ["dtype must be one of", "'bf16'", "torch.bfloat16"]),
    ("H not a multiple of the mxfp4 block", lambda: build(hidden_size=100, quant="mxfp4", dtype=torch.bfloat16),
     ["hidden_size must be a multiple of 32", "mxfp4", "got 100"]),
    ("I not a multiple of the nvfp4 block", lambda: MoEProblem.create(num_experts=E, top_k=K, hidden_size=H,
                                                                      intermediate_size=24, quant="nvfp4"),
     ["intermediate_size must be a multiple of 16", "nvfp4", "got 24"]),
    ("MoEProblem given names directly", lambda: MoEProblem(E, K, H, I, "silu", "bf16", torch.bfloat16),
     ["activation must be an Activation", "'silu'", "MoEProblem.create"]),
    # --- TopK of lists: AttributeError before
    ("TopK of lists", lambda: TopK([[0, 1]], [[0.5, 0.5]]), ["TopK ids must be a torch.Tensor", "got list"]),
    # --- ParallelConfig, Router: accepted silently before
    ("ep_rank a bool", lambda: ParallelConfig(ep_size=2, ep_rank=True), ["ep_rank", "True"]),
    ("expert_map of floats", lambda: ParallelConfig(expert_map=(0.0, 1)), ["expert_map", "ints", "0.0"]),
    ("correction_bias NaN", lambda: Router("deepseek_v3", 8, 2, correction_bias=torch.full((8,), float("nan"))),
     ["correction_bias", "NaN"]),
    # --- moe.quant: TypeError from torch for a bare int / a float block; "must have shape (3, 1) ... (got
    #     (3, 1))" when the real fault was K
    ("fp8 block an int", lambda: quantize_fp8_blockwise(torch.randn(3, 40), 128), ["block", "2 positive integer", "128"]),
    ("fp8 group a float", lambda: quantize_fp8_groupwise(torch.randn(3, 40), 2.5), ["group_size", "2.5"]),
    ("mxfp4 K not a multiple of 32", lambda: dequantize_mxfp4(torch.zeros(3, 20, dtype=torch.uint8), torch.zeros(3, 1, dtype=torch.uint8)),
     ["K=40", "multiple of 32"]),
    ("nvfp4 K not a multiple of 16", lambda: dequantize_nvfp4(
        torch.zeros(3, 20, dtype=torch.uint8), torch.zeros(3, 2, dtype=torch.float8_e4m3fn), torch.ones(())),
     ["K=40", "multiple of 16"]),
]


@pytest.mark.parametrize("call, fragments", [pytest.param(c, f, id=i) for i, c, f in CASES])
def test_bad_input_gets_a_clear_error(call, fragments):
    with pytest.raises(MoEConfigError) as error:
        call()
    message = str(error.value)
    missing = [f for f in fragments if f not in message]
    assert not missing, f"message lacks {missing}: {message}"


def test_cuda_device_without_cuda_is_refused_naming_it():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(MoEConfigError, match=r"device: 'cuda' but torch\.cuda\.is_available\(\) is False.*device='cpu'"):
        build(device="cuda")


def test_the_transposed_w13_is_not_blamed_on_w2():
    with pytest.raises(MoEConfigError) as at_load:
        build().load_weights(w13=torch.randn(E, H, 2 * I), w2=torch.randn(E, H, I))
    with pytest.raises(MoEConfigError) as from_dense:
        ExpertWeights.from_dense(torch.randn(E, H, 2 * I), torch.randn(E, H, I))
    assert str(at_load.value).startswith("w13:") and str(from_dense.value).startswith("w13:")


# --- what the fixes must not refuse ------------------------------------------------------------------


def test_dtype_alone_picks_unquantized_weights_in_that_dtype():
    """quant now defaults to "unquantized in dtype": dtype=torch.float32 alone was refused as quant='bf16'."""
    layer = build(quant=None)
    assert layer.problem.dtype == torch.float32 and not layer.problem.quant.is_quantized
    assert MoEProblem.create(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I).dtype == torch.bfloat16


def test_expert_map_given_as_a_list_is_stored_as_a_tuple():
    config = ParallelConfig(expert_map=[1, -1, 0])
    assert config.expert_map == (1, -1, 0) and hash(config) == hash(ParallelConfig(expert_map=(1, -1, 0)))


def test_dense_weights_may_hold_this_ranks_experts_or_all_of_them():
    """Under expert parallelism the layer shards a full checkpoint at load, so both counts pass the
    shape check; any other count does not."""
    p = MoEProblem.create(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I,
                          parallel=ParallelConfig(ep_size=2, ep_rank=1))
    for experts in (E, E // 2):
        check_dense_for(p, **dense(experts=experts))
    with pytest.raises(MoEConfigError, match=r"w13: .*E may also be this rank's 2 \(got \[3, 64, 128\]\)"):
        check_dense_for(p, **dense(experts=3))


def _scheme_problem(quant: str) -> MoEProblem:
    fmt, dtype = (QuantFormat.MXFP4, torch.bfloat16) if quant == "mxfp4" else (QuantFormat.NONE, torch.float32)
    return make_problem(fmt, quant=quant, dtype=dtype)


@pytest.mark.parametrize("experts_cls, quant", [
    (cls, quant) for cls in (ReferenceExperts, TorchGroupedExperts, TritonExperts) for quant in ("fp32", "mxfp4")
    if not cls.check(_scheme_problem(quant), None)
])
def test_prepared_type_and_sizes_are_what_prepare_weights_returns(experts_cls, quant):
    """The apply-side checks never refuse weights that prepare_weights made for the same problem."""
    p = _scheme_problem(quant)
    experts = experts_cls(p)
    prepared = experts.prepare_weights(random_weights(p))
    assert isinstance(prepared, experts_cls.prepared_type)
    assert experts.prepared_sizes(prepared) == (p.local_num_experts, p.hidden_size, p.intermediate_size)
    experts.check_prepared(prepared, sizes=True)


def test_a_class_that_converts_weights_without_declaring_prepared_type():
    """A plugin written before prepared_type: its prepare_weights' return annotation is used; without
    one nothing is checked, rather than refusing the weights it prepared."""

    class Annotated(ReferenceExperts):
        name = "test_annotated"

        def prepare_weights(self, weights: ExpertWeights) -> DenseWeights:
            return super().prepare_weights(weights)

    class Unannotated(ReferenceExperts):
        name = "test_unannotated"

        def prepare_weights(self, weights):
            return ("prepared", super().prepare_weights(weights))

        def apply(self, dispatched, weights, workspace):
            return super().apply(dispatched, weights[1], workspace)

    assert Annotated.prepared_type is DenseWeights and Unannotated.prepared_type is object
    assert Unannotated.prepared_sizes is Experts.prepared_sizes  # ReferenceExperts' reads DenseWeights
    kernel, raw, hidden, topk = reference_kernel()
    unannotated = ModularKernel(LocalPrepareFinalize(kernel.problem), Unannotated(kernel.problem))
    unannotated.load(raw)
    out = unannotated.forward(hidden, topk)
    torch.testing.assert_close(out, kernel_forward())


@pytest.mark.parametrize("build,fragments", [
    (lambda: __import__("moe").ReferenceExperts("x"), ["ReferenceExperts(problem)", "must be a MoEProblem", "'x'"]),
    (lambda: __import__("moe").LocalPrepareFinalize("x"), ["LocalPrepareFinalize(problem)", "MoEProblem", "'x'"]),
    (lambda: __import__("moe").plan("x"), ["plan: problem must be", "'x'"]),
    (lambda: __import__("moe").plan(_small_problem(), "h100"), ["plan: platform must be", "Platform.preset", "'h100'"]),
    (lambda: __import__("moe").plan(_small_problem(), None, "triton"), ["plan: policy must be", "'triton'"]),
    (lambda: Activation.parse("swiglu_oai", limit="x"), ["swiglu_oai limit must be a number", "'x'"]),
    (lambda: Activation.parse("swiglu_oai", alpha=float("nan")), ["swiglu_oai alpha must be finite", "nan"]),
])
def test_constructors_refuse_the_wrong_type_naming_it(build, fragments):
    with pytest.raises(MoEConfigError) as error:
        build()
    for fragment in fragments:
        assert fragment in str(error.value), (fragment, str(error.value))


def _small_problem():
    from moe import MoEProblem

    return MoEProblem.create(num_experts=4, top_k=2, hidden_size=32, intermediate_size=16)
