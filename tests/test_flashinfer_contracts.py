"""Contracts with the installed FlashInfer (CPU): every FlashInfer function the backends call accepts the
arguments they pass, and the enum values they hard-code are FlashInfer's.

Each backend runs on CPU tensors up to the kernel call, with ``flashinfer_module`` swapped for a recorder
that binds every call to the real function's signature (``inspect.signature``). CuTe-DSL entry points
cannot be imported without nvidia-cutlass-dsl; their signatures are read from the installed sources
(``ast``) instead. SM100-only paths are verified this far and no further.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
from pathlib import Path

import pytest
import torch

from moe import MoEProblem, ParallelConfig, Router
from moe.experts import flashinfer_cutedsl, flashinfer_cutlass, flashinfer_trtllm
from moe.experts._flashinfer import library, trtllm_modes
from moe.formats import ActivationFormat, Dispatched, DispatchShape
from moe.platform import Platform
from moe.quant import QuantFormat, quantize
from moe.router import TopK
from moe.workspace import WorkspaceManager
from tests.helpers import random_weights

needs_flashinfer = pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="flashinfer is not installed")


def source_signature(module: str, qualname: str) -> inspect.Signature:
    """A function's signature read from the installed source (for modules that need cutlass-dsl)."""
    path = Path(importlib.util.find_spec("flashinfer").origin).parent.joinpath(*module.split(".")[1:])
    tree = ast.parse(path.with_suffix(".py").read_text())
    node: ast.AST = tree
    for name in qualname.split("."):
        node = next(n for n in ast.iter_child_nodes(node) if getattr(n, "name", None) == name)
    a, P = node.args, inspect.Parameter
    positional = [p for p in a.posonlyargs + a.args if p.arg != "self"]
    defaults = [P.empty] * (len(positional) - len(a.defaults)) + [None] * len(a.defaults)
    params = [P(p.arg, P.POSITIONAL_OR_KEYWORD, default=d) for p, d in zip(positional, defaults)]
    params += [P(a.vararg.arg, P.VAR_POSITIONAL)] if a.vararg else []
    params += [P(p.arg, P.KEYWORD_ONLY, default=P.empty if d is None else None) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    params += [P(a.kwarg.arg, P.VAR_KEYWORD)] if a.kwarg else []
    return inspect.Signature(params)


class Recorder:
    """Stands in for a flashinfer module: calls to ``checked`` names are bound to their real signature
    and recorded; every other attribute comes from the real module."""

    def __init__(self, name: str, checked: dict, calls: list):
        self._name, self._checked, self._calls = name, checked, calls

    def __getattr__(self, attr):
        if attr in self._checked:
            signature, result = self._checked[attr]
            return lambda *args, **kwargs: self._call(attr, signature, result, args, kwargs)
        return getattr(importlib.import_module(self._name), attr)

    def _call(self, attr, signature, result, args, kwargs):
        bound = signature.bind(*args, **kwargs)  # TypeError on an argument the function does not take
        self._calls.append((f"{self._name}.{attr}", bound.arguments))
        return result(bound.arguments) if callable(result) else result


def real(module: str, attr: str) -> inspect.Signature:
    return inspect.signature(getattr(importlib.import_module(module), attr))


@pytest.fixture
def calls(monkeypatch):
    if importlib.util.find_spec("flashinfer") is None:
        pytest.skip("flashinfer is not installed")
    recorded: list = []
    fused = "flashinfer.fused_moe"
    checked = {
        fused: {name: (real(fused, name), 0) for name in (
            "cutlass_fused_moe", "cutlass_fused_moe_workspace_size",
            *(f"{entry}_{kind}" for entry in ("trtllm_bf16", "trtllm_fp8_per_tensor_scale", "trtllm_fp8_block_scale",
                                              "trtllm_fp4_block_scale") for kind in ("moe", "routed_moe")))},
        "flashinfer": {
            "scaled_fp4_grouped_quantize": (real("flashinfer", "scaled_fp4_grouped_quantize"), (None, None)),
            "silu_and_mul_scaled_nvfp4_experts_quantize": (
                real("flashinfer", "silu_and_mul_scaled_nvfp4_experts_quantize"), (None, None)),
        },
        "flashinfer.gemm": {"grouped_gemm_nt_masked": (
            source_signature("flashinfer.gemm.kernels.grouped_gemm_masked_wrapper", "grouped_gemm_nt_masked"), None)},
        "flashinfer.fused_moe.cute_dsl": {
            "CuteDslMoEWrapper": (source_signature("flashinfer.fused_moe.cute_dsl.fused_moe", "CuteDslMoEWrapper.__init__"),
                                  lambda args: wrapper("fused_moe", "CuteDslMoEWrapper", args, recorded)),
            "CuteDslBf16MoEWrapper": (source_signature("flashinfer.fused_moe.cute_dsl.sm90_fused_moe", "CuteDslBf16MoEWrapper.__init__"),
                                      lambda args: wrapper("sm90_fused_moe", "CuteDslBf16MoEWrapper", args, recorded)),
        },
    }

    def fake(name: str = fused):
        return Recorder(name, checked.get(name, {}), recorded)

    for module in (flashinfer_cutlass, flashinfer_trtllm, flashinfer_cutedsl):
        monkeypatch.setattr(module, "flashinfer_module", fake)
    return recorded


def wrapper(module: str, cls: str, init_args: dict, recorded: list):
    run = source_signature(f"flashinfer.fused_moe.cute_dsl.{module}", f"{cls}.run")
    hidden = init_args["hidden_size"]

    def call(*args, **kwargs):
        bound = run.bind(*args, **kwargs)
        recorded.append((f"{cls}.run", bound.arguments))
        rows = bound.arguments["token_selected_experts"].shape[0]
        return torch.zeros(rows, hidden, dtype=torch.bfloat16)

    return type("FakeWrapper", (), {"run": staticmethod(call)})()


def problem(quant, activation="silu", **kw):
    sizes = {"fp8_block": (256, 128)}.get(quant, (192, 96))
    kw.setdefault("hidden_size", sizes[0])
    kw.setdefault("intermediate_size", sizes[1])
    return MoEProblem.create(num_experts=8, top_k=2, quant=quant, activation=activation, max_tokens=16, **kw)


def standard_dispatch(p: MoEProblem, fmt: QuantFormat, rows: int = 5) -> Dispatched:
    x = torch.randn(rows, p.hidden_size).to(p.dtype)
    ids = torch.stack([torch.randperm(p.num_experts)[: p.top_k] for _ in range(rows)] or [torch.zeros(0, p.top_k)])
    ids = ids.view(rows, p.top_k).to(torch.int32)
    topk = TopK(ids, torch.softmax(torch.randn(rows, p.top_k), -1))
    return Dispatched(ActivationFormat.STANDARD, quantize(x, fmt, "activation"), topk)


def run(experts, p: MoEProblem, dispatched: Dispatched, weights=None):
    weights = experts.prepare_weights(weights or random_weights(p))
    shape = DispatchShape(dispatched.format, dispatched.num_rows)
    workspace = WorkspaceManager("cpu").take(experts.workspace_shapes(shape))
    return weights, experts.apply(dispatched, weights, workspace)


def only(calls, name):
    found = [args for called, args in calls if called.endswith(name)]
    assert len(found) == 1, f"expected one call of {name}, got {[c for c, _ in calls]}"
    return found[0]


# --- CUTLASS --------------------------------------------------------------------------------------

CUTLASS_CASES = [
    ("bf16", "silu", False), ("bf16", "relu2", False), ("mxfp4", "swiglu_oai", True), ("mxfp4", "gelu", False),
    ("fp8", "silu", True), ("fp8_block", "silu", False), ("nvfp4", "swiglu_oai", True), ("mxfp4_a_mxfp8", "relu2", False),
]


@pytest.mark.parametrize("quant,activation,bias", CUTLASS_CASES)
def test_cutlass_fused_moe_accepts_what_we_pass(calls, quant, activation, bias):
    p = problem(quant, activation, has_bias=bias)
    experts = flashinfer_cutlass.FlashInferCutlassExperts(p)
    weights, out = run(experts, p, standard_dispatch(p, QuantFormat.NONE))
    args = only(calls, "cutlass_fused_moe")
    g = experts.geometry
    assert out.out.shape == (5, p.hidden_size)
    assert args["input"].shape[1] == g.hidden_padded and args["output"].shape == (5, g.hidden_padded)
    assert args["fc2_expert_weights"].shape[1] == g.hidden_padded
    assert int(args["activation_type"]) == library.ACTIVATION_TYPES[p.activation.kind]
    assert ("swiglu_alpha" in args) == (activation == "swiglu_oai")
    assert (args.get("fc1_expert_biases") is not None) == bias
    expected_scales = {"bf16": 0, "mxfp4": 2, "fp8": 4, "fp8_block": 2, "nvfp4": 6, "mxfp4_a_mxfp8": 4}[quant]
    assert len(args["quant_scales"]) == expected_scales
    experts._ask_library(16)
    assert only(calls, "cutlass_fused_moe_workspace_size")


def test_cutlass_w4a16_layout_is_what_the_binding_checks(calls):
    # flashinfer's CutlassW4A16Runner: w [E, R, H/2] uint8, scales [E, R/64, H/128, 16, 16] bytes as int32.
    # GPT-OSS's H = 2880 pads to 2944; I = 320 to 384 (GPT-OSS's I = 2880 would take seconds on CPU)
    p = MoEProblem.create(num_experts=2, top_k=1, hidden_size=2880, intermediate_size=320, quant="mxfp4",
                          activation="swiglu_oai", has_bias=True, max_tokens=4)
    experts = flashinfer_cutlass.FlashInferCutlassExperts(p)
    run(experts, p, standard_dispatch(p, QuantFormat.NONE, rows=3))
    args = only(calls, "cutlass_fused_moe")
    assert args["use_w4_group_scaling"] is True
    assert args["fc1_expert_weights"].shape == (2, 2 * 384, 2944 // 2)
    assert args["fc2_expert_weights"].shape == (2, 2944, 384 // 2)
    s1, s2 = args["quant_scales"]
    assert s1.dtype == torch.int32 and s1.shape == (2, 2 * 384 // 64, 2944 // 128, 16, 4)
    assert s2.shape == (2, 2944 // 64, 384 // 128, 16, 4)
    assert args["fc1_expert_biases"].dtype == torch.bfloat16 and args["swiglu_limit"].dtype == torch.float32


def test_cutlass_zero_tokens_calls_nothing(calls):
    p = problem("bf16")
    experts = flashinfer_cutlass.FlashInferCutlassExperts(p)
    _, out = run(experts, p, standard_dispatch(p, QuantFormat.NONE, rows=0))
    assert out.out.shape == (0, p.hidden_size) and not [c for c, _ in calls if c.endswith("cutlass_fused_moe")]


# --- trtllm-gen ----------------------------------------------------------------------------------

TRTLLM_CASES = [
    ("bf16", "swiglu_oai", False), ("bf16", "relu2", False), ("fp8", "silu", False), ("fp8", "relu2", False),
    ("fp8_block", "swiglu_oai", False), ("mxfp8", "relu2", False), ("nvfp4", "silu", True), ("nvfp4", "relu2", False),
    ("mxfp4", "swiglu_oai", True), ("mxfp4_a_mxfp8", "gelu", True),
]


@pytest.mark.parametrize("quant,activation,bias", TRTLLM_CASES)
def test_trtllm_routed_and_logits_entry_points_accept_what_we_pass(calls, quant, activation, bias):
    p = problem(quant, activation, has_bias=bias)
    assert flashinfer_trtllm.FlashInferTrtllmExperts.check(p, Platform.preset("b200")) == []
    experts = flashinfer_trtllm.FlashInferTrtllmExperts(p)
    dispatched = standard_dispatch(p, p.quant.activation)
    weights, out = run(experts, p, dispatched)
    routed = only(calls, f"{experts.entry}_routed_moe")
    assert out.out.shape == (5, p.hidden_size) and routed["topk_ids"].dtype == torch.int32
    assert routed["intermediate_size"] == experts.geometry.inter_padded
    assert routed["activation_type"] == library.ACTIVATION_TYPES[p.activation.kind]
    workspace = WorkspaceManager("cpu").take(experts.workspace_shapes(DispatchShape(ActivationFormat.STANDARD, 5)))
    hidden = torch.randn(5, p.hidden_size).to(p.dtype)
    deepseek = Router("deepseek_v3", 8, 2, n_group=4, topk_group=2, correction_bias=torch.zeros(8))
    for router in (Router("softmax", 8, 2), deepseek):
        experts.apply_router_logits(hidden, torch.randn(5, 8), router, weights, workspace)
    assert len([c for c, _ in calls if c.endswith(f"{experts.entry}_moe")]) == 2


def test_trtllm_deepseek_fp8_takes_transposed_group_scales(calls):
    p = problem("fp8_block")
    experts = flashinfer_trtllm.FlashInferTrtllmExperts(p)
    run(experts, p, standard_dispatch(p, QuantFormat.FP8_BLOCK))
    args = only(calls, "trtllm_fp8_block_scale_routed_moe")
    assert args["hidden_states_scale"].shape == (256 // 128, 5)
    assert args["use_shuffled_weight"] is False and int(args["fp8_quantization_type"]) == 1


# --- CuTe-DSL ------------------------------------------------------------------------------------


@pytest.mark.parametrize("quant,activation", [("nvfp4", "swiglu_oai"), ("nvfp4", "relu2"), ("bf16", "silu")])
def test_cute_dsl_wrappers_accept_what_we_pass(calls, quant, activation):
    p = problem(quant, activation, hidden_size=256, intermediate_size=128)
    experts = flashinfer_cutedsl.FlashInferCuteDslExperts(p)
    weights = experts.prepare_weights(random_weights(p))
    weights = dataclasses.replace(weights, wrapper=experts._wrapper(torch.device("cpu")))
    dispatched = standard_dispatch(p, p.quant.activation)
    workspace = WorkspaceManager("cpu").take(experts.workspace_shapes(DispatchShape(ActivationFormat.STANDARD, 5)))
    out = experts.apply(dispatched, weights, workspace)
    assert out.out.shape == (5, p.hidden_size)
    assert any(c.endswith(".run") for c, _ in calls)


def test_cute_dsl_batched_pipeline_accepts_what_we_pass(calls):
    p = problem("nvfp4", hidden_size=256, intermediate_size=128)
    experts = flashinfer_cutedsl.FlashInferCuteDslBatchedExperts(p)
    weights = experts.prepare_weights(random_weights(p))
    rows = 4
    x = torch.randn(8, rows, 256).to(torch.bfloat16)
    topk = TopK(torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, 2))
    counts = torch.full((8,), 2, dtype=torch.int32)
    dispatched = Dispatched(ActivationFormat.BATCHED, quantize(x.view(-1, 256), QuantFormat.NONE, "activation"), topk,
                            tokens_per_expert=counts)
    dispatched = dataclasses.replace(dispatched, x=dataclasses.replace(dispatched.x, data=x))
    workspace = WorkspaceManager("cpu").take(experts.workspace_shapes(DispatchShape(ActivationFormat.BATCHED, rows)))
    out = experts.apply(dispatched, weights, workspace)
    gemms = [args for c, args in calls if c.endswith("grouped_gemm_nt_masked")]
    assert len(gemms) == 2 and out.out.shape == (8, rows, 256)
    assert gemms[0]["out"].permute(2, 0, 1).is_contiguous()  # (m, n, l) view of an [E, T, N] buffer
    assert gemms[0]["kwargs"]["alpha"].shape == (1, 1, 8)


# --- enums and features --------------------------------------------------------------------------


@needs_flashinfer
def test_hard_coded_enum_values_are_flashinfers():
    enums = importlib.import_module("flashinfer.tllm_enums")
    assert library.ACTIVATION_TYPES == {k: int(getattr(enums.ActivationType, n)) for k, n in
                                        zip(library.ACTIVATION_TYPES, ("Swiglu", "Geglu", "Swiglu", "Relu2"))}
    methods = enums.RoutingMethodType
    assert flashinfer_trtllm.ROUTES_FROM_LOGITS == {
        "softmax": (int(methods.RenormalizeNaive), int(methods.Default)),
        "gpt_oss": (int(methods.Renormalize), int(methods.Renormalize)),
        "deepseek_v3": (int(methods.DeepSeekV3), int(methods.DeepSeekV3)),
    }
    layouts = enums.WeightLayout.BlockMajorK, enums.WeightLayout.MajorK
    assert (trtllm_modes.BLOCK_MAJOR_K, trtllm_modes.MAJOR_K) == layouts
    assert (trtllm_modes.DEEPSEEK_FP8, trtllm_modes.MX_FP8) == (
        enums.Fp8QuantizationType.DeepSeekFp8, enums.Fp8QuantizationType.MxFp8)


@needs_flashinfer
def test_feature_probe_finds_the_entry_points_without_a_gpu():
    found = library.flashinfer_moe_features()
    assert {"cutlass_fused_moe", "trtllm_fp4_block_scale_routed_moe", "sm90_mixed_gemm_interleave"} <= found
    every_mode_feature = {f for modes in (flashinfer_cutlass.CUTLASS_MODES, flashinfer_trtllm.TRTLLM_MODES,
                                          flashinfer_cutedsl.CUTEDSL_MODES, flashinfer_cutedsl.BATCHED_MODES)
                          for spec in modes.values() for f in spec.features}
    assert every_mode_feature <= set(library.FEATURE_SOURCES)


# --- capability declarations on simulated platforms (no flashinfer needed) ---------------------------

CUTLASS, TRTLLM = flashinfer_cutlass.FlashInferCutlassExperts, flashinfer_trtllm.FlashInferTrtllmExperts
CUTEDSL, BATCHED = flashinfer_cutedsl.FlashInferCuteDslExperts, flashinfer_cutedsl.FlashInferCuteDslBatchedExperts
GPT_OSS = dict(hidden_size=2880, intermediate_size=2880, activation="swiglu_oai", has_bias=True)


def serves(cls, platform: str, quant: str, **kw) -> bool:
    return cls.check(problem(quant, **kw), Platform.preset(platform)) == []


@pytest.mark.parametrize("platform,expected", [("a100", False), ("h100", True), ("h200", True), ("b200", False)])
def test_cutlass_w4a16_is_sm90_only_and_pads_gpt_oss_shapes(platform, expected):
    assert serves(CUTLASS, platform, "mxfp4", **GPT_OSS) is expected


@pytest.mark.parametrize("platform,expected", [("a100", False), ("h100", True), ("b200", True), ("rtx-pro-6000", True)])
def test_cutlass_bf16_runs_sm89_to_sm121(platform, expected):
    assert serves(CUTLASS, platform, "bf16", **GPT_OSS) is expected


def test_a_mode_whose_entry_point_the_installed_flashinfer_lacks_is_refused_naming_it_and_the_version():
    h200 = Platform.preset("h200")
    without = dataclasses.replace(h200, features=h200.features - {"flashinfer.cutlass_fused_moe"})
    assert CUTLASS.check(problem("bf16"), without) == ["the installed flashinfer 0.7.2.post1 lacks cutlass_fused_moe"]


def test_cutlass_per_pair_architectures():
    assert serves(CUTLASS, "h100", "fp8_block") and not serves(CUTLASS, "b200", "fp8_block")
    assert not serves(CUTLASS, "h100", "fp8_block", hidden_size=2880, intermediate_size=2880)  # no padding
    assert serves(CUTLASS, "b200", "nvfp4") and not serves(CUTLASS, "h100", "nvfp4")
    assert serves(CUTLASS, "rtx-pro-6000", "mxfp4_a_mxfp8") and not serves(CUTLASS, "h200", "mxfp4_a_mxfp8")
    assert serves(CUTLASS, "h100", "fp8") and not serves(CUTLASS, "h100", "fp8_block", has_bias=True)


def test_trtllm_needs_sm100_or_sm103():
    for quant in ("bf16", "fp8", "fp8_block", "mxfp8", "nvfp4", "mxfp4", "mxfp4_a_mxfp8"):
        assert serves(TRTLLM, "b200", quant), quant
        assert not serves(TRTLLM, "h100", quant) and not serves(TRTLLM, "rtx-pro-6000", quant)


def test_trtllm_per_pair_activations_bias_and_alignment():
    assert serves(TRTLLM, "b200", "mxfp4", **GPT_OSS)
    assert not serves(TRTLLM, "b200", "mxfp4", activation="relu2")
    assert serves(TRTLLM, "b200", "nvfp4", activation="relu2", has_bias=True)
    assert not serves(TRTLLM, "b200", "bf16", has_bias=True) and not serves(TRTLLM, "b200", "fp8", activation="gelu")
    assert not serves(TRTLLM, "b200", "fp8_block", hidden_size=2880, intermediate_size=2880)
    p = problem("fp8", activation="relu2", intermediate_size=100)
    assert TRTLLM(p).geometry.inter_padded == 128  # non-gated pads I to 128
    assert TRTLLM(problem("fp8", intermediate_size=100)).geometry.inter_padded == 112  # gated: 16


def test_cute_dsl_architectures_and_library():
    assert serves(CUTEDSL, "b200", "nvfp4", hidden_size=256, intermediate_size=128)
    assert not serves(CUTEDSL, "h100", "nvfp4", hidden_size=256, intermediate_size=128)
    assert serves(CUTEDSL, "h100", "bf16", hidden_size=256, intermediate_size=128)
    assert not serves(CUTEDSL, "b200", "bf16", hidden_size=256, intermediate_size=128)
    no_dsl = Platform.preset("h100").with_libraries(remove=("cutlass",))
    assert any("cutlass" in r for r in CUTEDSL.check(problem("bf16", hidden_size=256, intermediate_size=128), no_dsl))
    assert serves(BATCHED, "b200", "nvfp4", hidden_size=256, intermediate_size=128)
    assert not serves(BATCHED, "b200", "nvfp4", activation="swiglu_oai", hidden_size=256, intermediate_size=128)


def test_missing_flashinfer_and_cpu_are_reasons():
    without = Platform.preset("h100").with_libraries(remove=("flashinfer",))
    assert any("flashinfer" in r for r in CUTLASS.check(problem("bf16"), without))
    assert CUTLASS.check(problem("bf16"), Platform.preset("cpu"))


def test_expert_maps_must_be_contiguous():
    scattered = (0, -1, 1, -1, 2, -1, 3, -1)
    assert any("contiguous" in r for r in CUTLASS.check(problem("bf16", parallel=ParallelConfig(expert_map=scattered)), None))
    sharded = ParallelConfig(ep_size=2, ep_rank=1)
    assert CUTLASS.check(problem("bf16", parallel=sharded), None) == []
    assert TRTLLM.check(problem("bf16", parallel=sharded), None) == []
    odd_block = ParallelConfig(expert_map=(-1, 0, 1, 2, -1, -1, -1, -1))
    assert CUTLASS.check(problem("bf16", parallel=odd_block), None)  # not E/ep_size experts per rank
    assert TRTLLM.check(problem("bf16", parallel=odd_block), None) == []  # an offset + count is enough



@needs_flashinfer
@pytest.mark.parametrize("tune_max", [1, 16, 64, 1024, 8192])
def test_cutlass_warmup_profiles_the_bucket_every_m_is_looked_up_in(tune_max):
    """cutlass_fused_moe looks a call's M up in one bucket (the installed FlashInfer's hybrid mapper, as its
    MoERunner's tuning config has it); a tactic profiled anywhere else is never found. Every M up to the tuned
    bound must land on a bucket `warmup` profiles: by default, and when it is given that M alone (the bench)."""
    from flashinfer.fused_moe.utils import map_to_hybrid_bucket

    every = set(flashinfer_cutlass.tuning_buckets(tune_max))
    for m in range(1, tune_max + 1):
        assert map_to_hybrid_bucket(m, tune_max) in every, m
        assert flashinfer_cutlass.tuning_buckets(tune_max, (m,)) == (map_to_hybrid_bucket(m, tune_max),), m
    if tune_max == 1024:  # the steps of 256 past 256 that powers of two alone missed
        assert {768, 1024} <= every and 700 not in every


def test_cutlass_warmup_buckets_without_flashinfers_helpers_are_powers_of_two(monkeypatch):
    """An older FlashInfer without the hybrid helpers: powers of two up to the bound, M rounded up to one; M above
    the bound are dropped (the bound alone where none is left)."""
    import sys

    monkeypatch.setitem(sys.modules, "flashinfer.fused_moe.utils", None)  # the import then raises ImportError
    assert flashinfer_cutlass.tuning_buckets(16) == (1, 2, 4, 8, 16)
    assert flashinfer_cutlass.tuning_buckets(1024, (9, 700, 4096)) == (16, 1024)
    assert flashinfer_cutlass.tuning_buckets(64, (512,)) == (64,)
