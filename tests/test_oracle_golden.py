"""Golden decisions of the oracle on simulated platforms.

Each row names a platform, a layer, a scheme and the token buckets, and states:
- ``viable``: backends that must be able to serve (capability facts: FlashInfer 0.7.2, Triton, CPU);
- ``rejected``: backends that must be rejected, each with a regex one of its reasons must match;
- ``chosen``: either a name (where capabilities leave one candidate, or the profile makes the order
  plain), a prefix every bucket's choice must start with, or ``FASTEST``: the experts with the least
  estimated time, derived here from the profile data (``overhead_us + roofline_us / efficiency``,
  efficiency interpolated in log2 M). Near ties (within ``TIE``) accept either, so changing one
  profile number moves only the rows whose order it decides.

Backends are imported from the module expected to declare them; a row whose module is not in this
tree yet is skipped with "backend module not present".
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field

import pytest
import yaml

from moe.oracle import Policy, plan
from moe.oracle.cost import roofline, transport_us
from moe.oracle.profile import DEFAULT_EFFICIENCY, DEFAULT_OVERHEAD_US, ProfileShape, builtin_profile
from moe.platform import Platform
from moe.presets import load_preset
from moe.problem import MoEProblem, ParallelConfig
from moe.quant import QuantFormat
from moe.registry import experts_classes, prepare_finalize_classes

# backend name -> the module that declares it
MODULES = {
    "reference": "moe.experts.reference",
    "torch_grouped": "moe.experts.torch_grouped",
    "triton": "moe.experts.triton",
    "triton_batched": "moe.experts.triton_batched",
    "flashinfer_cutlass": "moe.experts.flashinfer_cutlass",
    "flashinfer_trtllm": "moe.experts.flashinfer_trtllm",
    "flashinfer_cutedsl": "moe.experts.flashinfer_cutedsl",
    "flashinfer_cutedsl_batched": "moe.experts.flashinfer_cutedsl",
    "local": "moe.prepare_finalize.local",
    "batched": "moe.prepare_finalize.batched",
    "all_to_all": "moe.prepare_finalize.all_to_all",
    "all_to_all_batched": "moe.prepare_finalize.all_to_all",
    "flashinfer_a2a": "moe.prepare_finalize.flashinfer_a2a",
}
FASTEST = "<fastest by the profile>"
TIE = 0.05  # estimates closer than this (relative) are an order the profile does not make plain
TOKENS = (1, 64, 4096)


@dataclass(frozen=True)
class Case:
    id: str
    platform: str
    layer: str | dict  # a preset name, or E/k/H/I sizes
    quant: str
    activation: str | None = None  # default: the preset's
    ep: int = 1
    remove: tuple[str, ...] = ()  # libraries taken off the platform
    viable: frozenset[str] = frozenset()
    rejected: dict[str, str] = field(default_factory=dict)
    chosen: str = FASTEST  # a name, FASTEST, or "prefix*"
    prepare_finalize: frozenset[str] = frozenset({"local", "batched"})


def _v(*names: str) -> frozenset[str]:
    return frozenset(names)


# Triton serves nvfp4 weight-only (activations unquantized) on SM80+; its batched twin does not
NVFP4_NOT_SERVED = {"triton_batched": "quant nvfp4", "torch_grouped": "quant nvfp4"}
CASES = [
    # --- NVFP4: trtllm-gen and CuteDSL need SM100/SM103; CUTLASS needs SM100+; Triton weight-only ------
    Case("b200-deepseek-nvfp4", "b200", "deepseek-v3", "nvfp4", "silu",
         viable=_v("flashinfer_trtllm", "flashinfer_cutlass", "flashinfer_cutedsl", "triton", "reference"),
         rejected=NVFP4_NOT_SERVED, chosen="flashinfer_*"),
    Case("gb200-deepseek-nvfp4", "gb200", "deepseek-v3", "nvfp4", "silu",
         viable=_v("flashinfer_trtllm", "flashinfer_cutlass", "flashinfer_cutedsl"), chosen="flashinfer_*"),
    Case("h100-deepseek-nvfp4", "h100", "deepseek-v3", "nvfp4", "silu", viable=_v("triton", "reference"),
         rejected={"flashinfer_trtllm": "SM100", "flashinfer_cutedsl": "SM100", "flashinfer_cutlass": "SM100",
                   "flashinfer_cutedsl_batched": "SM100", **NVFP4_NOT_SERVED},
         chosen="triton"),
    Case("rtx6000-deepseek-nvfp4", "rtx-pro-6000", "deepseek-v3", "nvfp4", "silu",
         viable=_v("flashinfer_cutlass", "reference"),
         rejected={"flashinfer_trtllm": "SM10[03]", "flashinfer_cutedsl": "SM10[03]"}, chosen="flashinfer_cutlass"),
    Case("b200-nemotron-nvfp4-relu2", "b200", "nemotron-h", "nvfp4",
         viable=_v("flashinfer_trtllm", "flashinfer_cutlass"), chosen="flashinfer_*"),
    # --- FP8 128-block: CUTLASS exactly SM90 with H, I multiples of 128 (not padded) --------------
    Case("h100-deepseek-fp8block", "h100", "deepseek-v3", "fp8_block", "silu",
         viable=_v("triton", "flashinfer_cutlass", "reference"),
         rejected={"flashinfer_trtllm": "SM100", "torch_grouped": "quant fp8_block"}),
    Case("b200-deepseek-fp8block", "b200", "deepseek-v3", "fp8_block", "silu",
         viable=_v("triton", "flashinfer_trtllm"), rejected={"flashinfer_cutlass": "SM90"}),
    Case("h100-unaligned-fp8block", "h100", dict(num_experts=128, top_k=4, hidden_size=2880, intermediate_size=2880),
         "fp8_block", "silu", viable=_v("triton"),
         rejected={"flashinfer_cutlass": "hidden_size must be a multiple of 128"}),
    Case("a100-deepseek-fp8block", "a100", "deepseek-v3", "fp8_block", "silu", viable=_v("triton", "reference"),
         rejected={"triton_batched": "SM89", "flashinfer_cutlass": "SM90"}, chosen="triton"),  # weight-only
    # --- MXFP4 W4A16: CUTLASS exactly SM90, H and I padded to 128 ---------------------------------
    Case("h100-gptoss-mxfp4", "h100", "gpt-oss-120b", "mxfp4",
         viable=_v("flashinfer_cutlass", "triton", "reference"), rejected={"flashinfer_trtllm": "SM100"}),
    Case("b200-gptoss-mxfp4", "b200", "gpt-oss-120b", "mxfp4", viable=_v("triton"),
         rejected={"flashinfer_cutlass": "SM90"}),
    # --- BF16: CUTLASS SM89-SM121; CuteDSL BF16 SM90 only; Triton SM80+ ----------------------------
    Case("h200-qwen3-bf16", "h200", "qwen3-30b-a3b", "bf16", "silu",
         viable=_v("triton", "flashinfer_cutlass", "flashinfer_cutedsl", "torch_grouped", "reference"),
         rejected={"flashinfer_trtllm": "SM100"}),
    Case("b200-qwen3-bf16", "b200", "qwen3-30b-a3b", "bf16", "silu",
         viable=_v("triton", "flashinfer_cutlass", "flashinfer_trtllm"), rejected={"flashinfer_cutedsl": "SM90"}),
    Case("rtx6000-qwen3-bf16", "rtx-pro-6000", "qwen3-30b-a3b", "bf16", "silu",
         viable=_v("triton", "flashinfer_cutlass"), rejected={"flashinfer_trtllm": "SM10[03]"}),
    Case("a100-qwen3-bf16", "a100", "qwen3-30b-a3b", "bf16", "silu", viable=_v("triton", "torch_grouped"),
         rejected={"flashinfer_cutlass": "SM89", "flashinfer_cutedsl": "SM90", "flashinfer_trtllm": "SM100"},
         chosen="triton"),
    # --- libraries removed ---------------------------------------------------------------------------
    Case("b200-nofi-deepseek-nvfp4", "b200", "deepseek-v3", "nvfp4", "silu", remove=("flashinfer",),
         viable=_v("triton", "reference"), chosen="triton",
         rejected={"flashinfer_trtllm": "needs library 'flashinfer'", "flashinfer_cutlass": "needs library 'flashinfer'",
                   "flashinfer_cutedsl": "needs library 'flashinfer'"}),
    Case("h100-notriton-qwen3-bf16", "h100", "qwen3-30b-a3b", "bf16", "silu", remove=("triton",),
         viable=_v("flashinfer_cutlass", "torch_grouped"),
         rejected={"triton": "needs library 'triton'", "triton_batched": "needs library 'triton'"}),
    # --- CPU: only reference and torch_grouped run ---------------------------------------------------
    Case("cpu-qwen3-bf16", "cpu", "qwen3-30b-a3b", "bf16", "silu", viable=_v("reference", "torch_grouped"),
         rejected={"triton": "triton|cuda", "flashinfer_cutlass": "cuda", "flashinfer_trtllm": "cuda"},
         chosen="torch_grouped"),
    Case("cpu-deepseek-fp8block", "cpu", "deepseek-v3", "fp8_block", "silu", viable=_v("reference"),
         rejected={"torch_grouped": "quant fp8_block", "triton": "triton|cuda"}, chosen="reference"),
    # --- expert parallelism: rank 0 of 8 --------------------------------------------------------------
    Case("b200-deepseek-nvfp4-ep8", "b200", "deepseek-v3", "nvfp4", "silu", ep=8,
         viable=_v("flashinfer_trtllm", "all_to_all"), rejected={"local": "ep_size=8", "batched": "ep_size=8"},
         chosen="flashinfer_*", prepare_finalize=_v("all_to_all", "all_to_all_batched", "flashinfer_a2a")),
    Case("b200-deepseek-nvfp4-ep8-flashinfer-a2a", "b200", "deepseek-v3", "nvfp4", "silu", ep=8,
         viable=_v("flashinfer_a2a"), rejected={"local": "ep_size=8"}, chosen="flashinfer_*",
         prepare_finalize=_v("all_to_all", "all_to_all_batched", "flashinfer_a2a")),
]


# --- helpers ---------------------------------------------------------------------------------------
def _named(case: Case) -> set[str]:
    return set(case.viable) | set(case.rejected) | ({case.chosen} if case.chosen in MODULES else set())


def _require_modules(case: Case) -> None:
    missing = sorted(n for n in _named(case) if importlib.util.find_spec(MODULES[n]) is None)
    if missing:
        pytest.skip(f"backend module not present: {', '.join(missing)}")
    for name in _named(case):
        importlib.import_module(MODULES[name])  # registers it even before moe.experts imports it


def _problem(case: Case, max_tokens: int) -> MoEProblem:
    if isinstance(case.layer, str):
        preset = load_preset(case.layer)
        sizes = dict(num_experts=preset.num_experts, top_k=preset.top_k, hidden_size=preset.hidden_size,
                     intermediate_size=preset.intermediate_size, has_bias=preset.has_bias)
        activation = case.activation or preset.activation
    else:
        sizes, activation = dict(case.layer), case.activation
    return MoEProblem.create(**sizes, activation=activation, quant=case.quant, max_tokens=max_tokens,
                             parallel=ParallelConfig(ep_size=case.ep))


def _platform(case: Case) -> Platform:
    return Platform.preset(case.platform).with_libraries(remove=case.remove)


def _plan(case: Case, policy: Policy | None = None):
    policy = policy or Policy()
    policy = dataclasses.replace(policy, buckets=TOKENS)
    return plan(_problem(case, TOKENS[-1]), _platform(case), policy, allow_empty=True)


def _from_profile(name: str, problem: MoEProblem, platform: Platform, tokens: int, roofline_us: float,
                  profile, activation=None) -> float:
    """``overhead + roofline / efficiency`` from the profile's points, interpolated in log2 M here.

    A measured point (the shipped H200 measurements) counts as the efficiency it reached on its own
    shape: its shape's roofline, on the preset it was measured on (an H100 plan reads the H200's
    points against the H200's ceilings), over the measured time, with no overhead. An experts
    backend competes with the other experts backends (a measured peer rules out estimates), and the points
    are those whose M reach ``tokens`` (`Profile.points`).
    """
    peers = experts_classes() if name in experts_classes() else ()
    points, _ = profile.points(name, platform, problem.quant_name, ProfileShape.of(problem), peers, tokens=tokens)
    if not points:
        return DEFAULT_OVERHEAD_US + roofline_us / DEFAULT_EFFICIENCY

    def measured_on(point) -> Platform:
        return platform if point.platform == platform.kind else Platform.preset(point.platform)

    at_tokens = defaultdict(list)  # several shapes measured at one M count as their mean
    for p in points:
        at_tokens[p.tokens].append((roofline(p.shape.problem(p.quant, max(p.tokens, 1)), measured_on(p), p.tokens,
                                             activation=activation).us / p.measured_us, 0.0)
                                   if p.measured else (p.efficiency, p.overhead_us))
    effs = [tuple(sum(v) / len(v) for v in zip(*at_tokens[t])) for t in sorted(at_tokens)]
    xs = [math.log2(t) for t in sorted(at_tokens)]
    x = min(max(math.log2(tokens), xs[0]), xs[-1])
    i = max(j for j in range(len(xs)) if xs[j] <= x)
    j = min(i + 1, len(xs) - 1)
    w = 0.0 if i == j else (x - xs[i]) / (xs[j] - xs[i])
    eff = effs[i][0] + w * (effs[j][0] - effs[i][0])
    overhead = effs[i][1] + w * (effs[j][1] - effs[i][1])
    return overhead + roofline_us / eff


def expected_pair_us(pair, problem: MoEProblem, platform: Platform, tokens: int, profile) -> float:
    """The experts' estimate plus the prepare/finalize's (bytes it moves, cost.transport_us)."""
    experts_cls = experts_classes()[pair.experts]
    pf_cls = prepare_finalize_classes()[pair.prepare_finalize]
    quantizes = problem.quant.activation is not QuantFormat.NONE and not experts_cls.capabilities.quantizes_input
    # a weight-only mode reads unquantized activations: its roofline counts them at the dtype's width and rate
    computes = experts_cls.capabilities.modes[problem.quant].activation_format(problem.quant, platform)
    experts = _from_profile(pair.experts, problem, platform, tokens,
                            roofline(problem, platform, tokens, activation=computes).us, profile, computes)
    moved = transport_us(pf_cls.format, quantizes, problem, platform, tokens)
    return experts + _from_profile(pair.prepare_finalize, problem, platform, tokens, moved, profile)


# --- the golden table ------------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_golden_decision(case: Case):
    _require_modules(case)
    result = _plan(case)
    reasons = {c.name: c.reasons for c in result.candidates}
    for name in case.viable:
        assert reasons[name] == (), f"{name} should serve {case.id}, rejected: {reasons[name]}"
    for name, pattern in case.rejected.items():
        assert reasons[name], f"{name} should be rejected for {case.id}"
        assert any(re.search(pattern, r) for r in reasons[name]), (name, pattern, reasons[name])
    assert [b.high for b in result.buckets] == list(TOKENS)
    for bucket in result.buckets:
        chosen = bucket.chosen.pair
        assert chosen.prepare_finalize in case.prepare_finalize
        assert reasons[chosen.experts] == () and reasons[chosen.prepare_finalize] == ()
        _assert_chosen(case, result, bucket)


def _assert_chosen(case: Case, result, bucket) -> None:
    name = bucket.chosen.pair.experts
    if case.chosen.endswith("*"):
        assert name.startswith(case.chosen[:-1]), (case.id, bucket.high, name)
    elif case.chosen != FASTEST:
        assert name == case.chosen, (case.id, bucket.high, name)
    # in every case the choice must be (within TIE) the fastest viable pair by the profile data
    profile = builtin_profile()
    times = {s.pair: expected_pair_us(s.pair, result.problem, result.platform, bucket.high, profile)
             for s in bucket.ranking}
    best = min(times.values())
    assert times[bucket.chosen.pair] <= best * (1 + TIE), (case.id, bucket.high, bucket.chosen.pair,
                                                           sorted(times.items(), key=lambda t: t[1])[:3])


# --- a profile number moves only the rows whose order it decides -------------------------------------
def test_raising_one_profile_number_moves_only_its_rows(tmp_path):
    """flashinfer_cutlass estimated at 100% of the roofline with no overhead: it wins wherever it can
    serve and its estimates are used; rows where capabilities reject it, where it was measured (the
    shipped H200 profile, which an H100 reads too), or where another experts backend was measured for
    the scheme on that architecture (then no estimate stands in), keep their choice."""
    rows = [c for c in CASES if c.ep == 1 and not c.remove]
    profile = tmp_path / "cutlass-perfect.yaml"
    points: dict[str, list] = {}
    for c in rows:
        points.setdefault(c.platform, []).append({"tokens": 1, "quant": c.quant, "efficiency": 1.0})
    profile.write_text(yaml.safe_dump({"version": 1, "backends": {"flashinfer_cutlass": points}}))
    boosted = Policy(profiles=(str(profile),))
    for case in rows:
        try:
            _require_modules(case)
        except pytest.skip.Exception:
            continue
        before, after = _plan(case), _plan(case, boosted)
        cutlass_viable = not dict((c.name, c.reasons) for c in before.candidates)["flashinfer_cutlass"]
        problem, platform = _problem(case, TOKENS[-1]), _platform(case)
        _, basis = builtin_profile().points("flashinfer_cutlass", platform, problem.quant_name,
                                            ProfileShape.of(problem), experts_classes())
        estimated = not basis.startswith(("measured", "not measured"))  # what the boost replaces
        for b0, b1 in zip(before.buckets, after.buckets):
            if cutlass_viable and estimated:
                assert b1.chosen.pair.experts == "flashinfer_cutlass", (case.id, b1.high)
            else:
                assert b1.chosen.pair == b0.chosen.pair, (case.id, b1.high)


def test_every_registered_experts_backend_is_in_some_golden_row():
    for name in MODULES:
        if importlib.util.find_spec(MODULES[name]) is not None:
            importlib.import_module(MODULES[name])
    covered = set().union(*(_named(c) for c in CASES))
    builtin = {n for n, cls in experts_classes().items() if cls.__module__.startswith("moe.")}
    assert builtin <= covered, builtin - covered
