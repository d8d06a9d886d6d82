"""Modes are the capability: ``Capabilities.modes`` declares, per quantization scheme, what a class needs;
``check``, the union the table shows, the conformance kit's cases and exclusions all derive from it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from moe import MoEConfigError, MoEProblem, ParallelConfig, Platform, QuantScheme
from moe.activation import ActivationKind
from moe.experts import FlashInferCutlassExperts, FlashInferTrtllmExperts, TritonExperts
from moe.experts.base import Archs, Capabilities, ExpertLayout, Mode
from moe.formats import ActivationFormat, OutputKind
from moe.quant import QuantFormat
from moe.registry import experts_classes
from moe.testing import check_experts, exclusion_cases, experts_cases
from moe.testing.conformance import run_exclusion_case
from tests.test_testing_kit import NONE_PAIR, EinsumExperts

A = ActivationKind
FP8 = QuantScheme.from_name("fp8")


def problem(quant: str = "bf16", **kw) -> MoEProblem:
    kw.setdefault("hidden_size", 256)
    kw.setdefault("intermediate_size", 128)
    return MoEProblem.create(num_experts=8, top_k=2, quant=quant, **kw)


class TwoModes(EinsumExperts):
    """Unnamed modes: bf16 with any activation, fp8 with silu only and no biases."""

    name = "toy_two_modes"
    capabilities = Capabilities(
        formats=frozenset({ActivationFormat.STANDARD}),
        modes={**Mode(activations=frozenset({A.SILU, A.GELU})).serving("bf16"),
               **Mode(activations=frozenset({A.SILU}), bias=False, h_align=64).serving(FP8)},
        output=OutputKind.PER_SLOT,
    )


# --- the declaration and what derives from it --------------------------------------------------------
def test_the_union_is_derived_from_the_modes():
    cap = TwoModes.capabilities
    assert cap.quant == {NONE_PAIR, (FP8.weight, FP8.activation)}
    assert cap.activations == {A.SILU, A.GELU} and cap.bias and (cap.min_capability, cap.max_capability) == (None, None)
    trtllm = FlashInferTrtllmExperts.capabilities
    assert (trtllm.min_capability, trtllm.max_capability) == ((10, 0), (10, 3)) and trtllm.bias
    assert trtllm.dtypes == {torch.bfloat16} and not trtllm.modes[QuantScheme.from_name("bf16")].bias


def test_modes_are_keyed_by_scheme_and_must_be_a_mapping():
    assert list(Mode().serving("bf16", ("fp8_tensor", "fp8_tensor"))) == [QuantScheme.from_name("bf16"), FP8]
    with pytest.raises(MoEConfigError, match="a mapping QuantScheme -> Mode"):
        Capabilities(formats=frozenset({ActivationFormat.STANDARD}), modes=[Mode()], output=OutputKind.PER_SLOT)
    with pytest.raises(MoEConfigError, match="unknown quantization scheme 'fp9'"):
        Mode().serving("fp9")


def test_archs_are_exact_sets_or_open_ranges():
    assert 90 in Archs.exactly(90) and 100 not in Archs.exactly(90) and 120 in Archs.from_sm(89)
    assert 80 not in Archs.from_sm(89) and 75 in Archs()
    assert (str(Archs.exactly(103, 100)), str(Archs.from_sm(89))) == ("SM100/SM103", "SM89 or newer")


def test_an_unnamed_mode_reports_only_what_the_union_does_not():
    gelu_fp8 = TwoModes.check(problem("fp8", activation="gelu", has_bias=True, hidden_size=96), None)
    assert gelu_fp8 == ["toy_two_modes (fp8) does not fuse activation gelu; it fuses silu",
                        "toy_two_modes (fp8) takes no expert biases for this quantization",
                        "hidden_size must be a multiple of 64 for toy_two_modes (fp8) (got 96); "
                        "pad the weights or use another backend"]
    # relu2 is outside the union: the class-level reason alone, not repeated by the mode
    assert TwoModes.check(problem("fp8", activation="relu2"), None) == [
        "activation relu2 not supported; supports gelu, silu"]
    assert TwoModes.check(problem("bf16", activation="gelu", has_bias=True, hidden_size=96), None) == []


def test_triton_fp8_runs_weight_only_below_sm89_as_mode_data():
    from moe.experts import TritonBatchedExperts

    mode = TritonExperts.capabilities.modes[FP8]
    assert mode.archs == Archs.from_sm(80) and mode.weight_only == Archs.exactly(80, 86, 87)
    assert TritonBatchedExperts.capabilities.modes[FP8].archs == Archs.from_sm(89)  # no weight-only path
    a100, h100 = (Platform(name=n, device="cuda", capability=c) for n, c in (("a100", (8, 0)), ("h100", (9, 0))))
    assert mode.activation_format(FP8, a100) is QuantFormat.NONE
    assert mode.activation_format(FP8, h100) is FP8.activation and mode.activation_format(FP8, None) is FP8.activation
    nvfp4 = QuantScheme.from_name("nvfp4")
    assert TritonExperts.capabilities.modes[nvfp4].activation_format(nvfp4, None) is QuantFormat.NONE
    a100, h100 = Platform.preset("a100"), Platform.preset("h100")
    assert TritonBatchedExperts.check(problem("fp8_token"), a100) == [
        "fp8 (fp8_token) needs SM89 or newer for e4m3 tensor cores (got SM80); use bf16 or mxfp4 weights"]
    assert TritonExperts.check(problem("fp8_token"), a100) == [] == TritonExperts.check(problem("fp8_token"), h100)
    assert TritonExperts.check(problem("bf16"), a100) == []


def test_expert_layouts_are_declared():
    assert FlashInferCutlassExperts.capabilities.expert_layout is ExpertLayout.EVEN_SHARDS
    block = problem(parallel=ParallelConfig(expert_map=(-1, -1, 0, 1, 2, 3, -1, -1)))
    assert FlashInferTrtllmExperts.check(block, None) == []
    assert FlashInferCutlassExperts.check(block, None) == [
        "flashinfer_cutlass shards experts as ep_rank * E/ep_size .. + E/ep_size; this rank holds experts 2..5"]


# --- the conformance kit generates cases and exclusions per mode -------------------------------------
@pytest.mark.parametrize("name", list(experts_classes()))
def test_every_generated_case_is_served_and_every_exclusion_refused(name):
    """What a GPU run would otherwise find: the cases of each mode pass ``check`` without a platform,
    and every exclusion is refused (construction included), for every registered class."""
    cls = experts_classes()[name]
    for case in experts_cases(cls.capabilities, "full"):
        assert cls.check(case.problem, None) == [], case.label
    for case in exclusion_cases(cls.capabilities, "full"):
        result = run_exclusion_case(cls, case)
        assert not result.failures, [f.message for f in result.failures]


def test_cases_follow_each_modes_alignment_and_the_expert_layout():
    cases = experts_cases(FlashInferTrtllmExperts.capabilities, "full")
    block = [c.problem for c in cases if c.problem.quant.name == "fp8_block"]  # not padded: aligned sizes
    assert block and all(p.hidden_size % 128 == 0 and p.intermediate_size % 128 == 0 for p in block)
    padded = [c.problem for c in cases if c.problem.quant.name == "nvfp4"]  # padded: left unaligned
    assert padded and all(p.hidden_size % 128 for p in padded)
    cutlass_maps = {c.problem.parallel for c in experts_cases(FlashInferCutlassExperts.capabilities, "full")}
    assert {(p.ep_size, p.ep_rank, p.expert_map) for p in cutlass_maps} == {(1, 0, None), (2, 1, None)}


def test_exclusions_are_generated_per_mode():
    excluded = {c.excluded for c in exclusion_cases(FlashInferTrtllmExperts.capabilities, "quick")}
    assert {"biases with unquantized", "activation gelu with fp8", "scattered expert maps"} <= excluded
    assert "hidden_size=130 (not a multiple of 128) with fp8_block" in excluded
    from moe.experts import TritonBatchedExperts

    batched = {c.excluded: c for c in exclusion_cases(TritonBatchedExperts.capabilities, "quick")}
    arch = batched["a100 (SM80) with fp8"]  # the standard-format triton serves it weight-only instead
    assert arch.platform.name == "a100" and not run_exclusion_case(TritonBatchedExperts, arch).failures
    triton = {c.excluded: c for c in exclusion_cases(TritonExperts.capabilities, "quick")}
    misaligned = triton["hidden_size=48 (not a multiple of 32) with nvfp4"]  # storable (16s), not split in 32s
    assert not run_exclusion_case(TritonExperts, misaligned).failures


# --- a wrong mode declaration is a failure, not a skip --------------------------------------------------
class HiddenRuleExperts(EinsumExperts):
    """Declares any hidden size, but its code refuses those not a multiple of 64."""

    name = "toy_hidden_rule"

    @classmethod
    def extra_checks(cls, problem, platform):
        return [] if problem.hidden_size % 64 == 0 else [f"hidden_size {problem.hidden_size} is not a multiple of 64"]


class DeclaredRuleExperts(HiddenRuleExperts):
    """The same rule, declared in the mode."""

    name = "toy_declared_rule"
    capabilities = replace(EinsumExperts.capabilities, modes=Mode(h_align=64).serving(NONE_PAIR))


def test_a_wrong_mode_declaration_is_a_failure_not_a_skip():
    report = check_experts(HiddenRuleExperts)
    failures = report.by_check("mode")
    assert failures and not report.passed and not report.skipped
    assert ("check() refuses a problem the capabilities' modes declare served: hidden_size 40 is not a multiple "
            "of 64") in failures[0].message
    declared = check_experts(DeclaredRuleExperts)
    assert declared.passed, str(declared)

