"""The oracle: cost model, profiles, selection properties, explanation, and the layer that uses it."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import itertools
import json
import random
import re
from pathlib import Path

import pytest
import torch
import yaml

from moe import FusedMoE, MoEConfigError, UnsupportedError
from moe.experts.reference import ReferenceExperts
from moe.kernel import ModularKernel
from moe.oracle import Policy, ProfileEntry, ProfileShape, load_profile, plan, save_profile
from moe.oracle.cost import efficiency_at, estimate_experts, expected_experts_hit, gemm_precision, roofline
from moe.oracle.profile import REACH, Profile, builtin_profile, sibling_kinds
from moe.platform import PRESET_NAMES, Platform
from moe.prepare_finalize import LocalPrepareFinalize
from moe.presets import load_preset, preset_names
from moe.problem import MoEProblem, ParallelConfig
from moe.quant import QuantFormat
from moe.registry import experts_classes, prepare_finalize_classes
from moe.testing import assert_close_moe

# backends other engineers are writing: imported where present so the properties cover them too
for _module in ("moe.experts.triton", "moe.experts.triton_batched", "moe.experts.flashinfer_cutlass",
                "moe.experts.flashinfer_trtllm", "moe.experts.flashinfer_cutedsl", "moe.prepare_finalize.all_to_all",
                "moe.prepare_finalize.flashinfer_a2a"):
    if importlib.util.find_spec(_module) is not None:
        importlib.import_module(_module)

SMALL = dict(num_experts=8, top_k=2, hidden_size=128, intermediate_size=64)


# --- cost model ------------------------------------------------------------------------------------
def test_expected_experts_hit():
    assert expected_experts_hit(256, 8, 256, 1) == pytest.approx(8)
    assert expected_experts_hit(256, 8, 32, 8) == pytest.approx(32 * (1 - (1 - 8 / 256) ** 8))
    assert expected_experts_hit(256, 8, 256, 100_000) == pytest.approx(256)
    assert expected_experts_hit(4, 4, 4, 1) == 4


def test_roofline_by_hand():
    problem = MoEProblem.create(**SMALL, quant="bf16")
    h100 = Platform.preset("h100")
    r = roofline(problem, h100, 1)
    assert r.experts_hit == pytest.approx(2)  # 8 * (1 - 6/8)
    assert r.weight_bytes == pytest.approx(2 * (128 * 128 + 128 * 64) * 2)  # w13 [2I, H] + w2 [H, I], bf16
    assert r.activation_bytes == pytest.approx(2 * (128 * 2 + 2 * 64 * 2 + 128 * 2))  # per slot: x, inter, out
    assert r.flops == pytest.approx(2 * 2 * 128 * (128 + 64))
    assert r.memory_us == pytest.approx(1e6 * (98304 + 1536) / 3.0e12)
    assert r.compute_us == pytest.approx(1e6 * 98304 / 768e12)
    assert r.us == r.memory_us and r.bound == "memory"


def test_roofline_precision_and_weight_bits():
    b200, a100 = Platform.preset("b200"), Platform.preset("a100")
    nvfp4 = MoEProblem.create(**SMALL, quant="nvfp4")
    w4a16 = MoEProblem.create(**SMALL, quant="mxfp4")
    assert gemm_precision(nvfp4) == "fp4" and gemm_precision(w4a16) == "bf16"
    assert gemm_precision(MoEProblem.create(**SMALL, quant="fp8_block")) == "fp8"
    bf16 = MoEProblem.create(**SMALL, quant="bf16")
    assert roofline(nvfp4, b200, 1).weight_bytes == pytest.approx(roofline(bf16, b200, 1).weight_bytes * 4.5 / 16)
    assert a100.peak_flops("fp8") == a100.peak_flops("bf16")  # no fp8 tensor cores: falls back


def test_efficiency_interpolates_in_log2_tokens_and_holds_beyond_the_points():
    points = (ProfileEntry("x", "*", 1, "*", efficiency=0.2, overhead_us=10),
              ProfileEntry("x", "*", 16, "*", efficiency=0.6, overhead_us=2))
    h100 = Platform.preset("h100")
    assert efficiency_at(points, h100, 4) == pytest.approx((0.4, 6.0))
    assert efficiency_at(points, h100, 1) == pytest.approx((0.2, 10.0))
    assert efficiency_at(points, h100, 1000) == pytest.approx((0.6, 2.0))


# --- profiles ---------------------------------------------------------------------------------------
def test_builtin_profile_names_only_stable_backend_names():
    stable = {"reference", "torch_grouped", "triton", "triton_batched", "flashinfer_cutlass", "flashinfer_trtllm",
              "flashinfer_cutedsl", "flashinfer_cutedsl_batched", "local", "batched", "all_to_all",
              "all_to_all_batched", "flashinfer_a2a", "shared_experts"}
    assert {e.backend for e in builtin_profile().entries} == stable


def test_measured_profile_round_trips_and_replaces_the_estimate(tmp_path):
    h100 = Platform.preset("h100")
    problem = load_preset("qwen3-30b-a3b").problem(quant="bf16", max_tokens=4096)
    entry = ProfileEntry.measurement("triton", h100, problem, 64, 123.0, preset="qwen3-30b-a3b")
    path = tmp_path / "bench.yaml"
    save_profile(path, [entry])
    loaded = load_profile(path)
    assert loaded.entries[0].shape == ProfileShape.of(problem, "qwen3-30b-a3b")
    assert yaml.safe_load(path.read_text())["backends"]["triton"]["h100"][0]["shape"] == {"preset": "qwen3-30b-a3b"}
    # on top of the shipped profile less its H100 measurements, so this point is H100's only one
    profile = _shipped_without("measured-h100.yaml").merged(loaded)
    at_64 = estimate_experts("triton", problem, h100, 64, profile)
    assert at_64.us == pytest.approx(123.0) and at_64.basis.startswith("measured")
    # the measured efficiency informs other token counts and shapes too: held constant beyond the point within
    # REACH times its M, and beyond that where no other measurement reaches
    assert estimate_experts("triton", problem, h100, 64 * REACH, profile).efficiency == pytest.approx(at_64.efficiency)
    assert estimate_experts("triton", problem, h100, 4096, loaded).efficiency == pytest.approx(at_64.efficiency)
    # further away, the H200's measurements at this shape and M speak instead (against the H200's ceilings)
    far = estimate_experts("triton", problem, h100, 4096, profile)
    assert far.basis.startswith("measured on h200 at this shape") and "M = 64-64 only" in far.basis
    assert far.efficiency != pytest.approx(at_64.efficiency)
    # saving again merges: same key replaced, others kept
    save_profile(path, [dataclasses.replace(entry, measured_us=100.0), dataclasses.replace(entry, tokens=1)])
    assert sorted((e.tokens, e.measured_us) for e in load_profile(path).entries) == [(1, 123.0), (64, 100.0)]


def test_profile_precedence_platform_then_scheme_then_any():
    entries = (ProfileEntry("t", "*", 1, "*", efficiency=0.1), ProfileEntry("t", "*", 1, "nvfp4", efficiency=0.2),
               ProfileEntry("t", "b200", 1, "*", efficiency=0.3), ProfileEntry("t", "b200", 1, "nvfp4", efficiency=0.4))
    b200, h100 = Platform.preset("b200"), Platform.preset("h100")
    for n in range(len(entries), 0, -1):
        profile = Profile(entries[:n])
        points, _ = profile.points("t", b200, "nvfp4")
        assert points[0].efficiency == entries[n - 1].efficiency
    assert Profile(entries).points("t", h100, "bf16")[0][0].efficiency == 0.1
    assert Profile(entries).points("unknown", h100, "bf16") == ((), Profile().points("x", h100, "bf16")[1])


def test_a_measured_level_gives_way_where_its_token_counts_do_not_reach():
    """A backend measured on this shape at decode only (M = 1-16) and on another shape at M = 4096: at M = 4096
    the other shape's efficiency speaks (the decode one held 256x away would not), within REACH x of 16 this
    shape's does, and where no level reaches M the first one is held (the plan's explanation says which)."""
    h200 = Platform.preset("h200")
    qwen3 = load_preset("qwen3-30b-a3b").problem(quant="fp8_block", max_tokens=4096)
    deepseek = load_preset("deepseek-v3-ep8-slice").problem(quant="fp8_block", max_tokens=4096)
    decode = [ProfileEntry.measurement("b", h200, qwen3, m, us, preset="qwen3-30b-a3b") for m, us in ((1, 30.0), (16, 120.0))]
    prefill = [ProfileEntry.measurement("b", h200, deepseek, 4096, 5000.0, preset="deepseek-v3-ep8-slice")]
    profile = Profile(tuple(decode + prefill))
    shape = ProfileShape.of(qwen3, "qwen3-30b-a3b")
    assert [e.tokens for e in profile.points("b", h200, "fp8_block", shape, tokens=16 * REACH)[0]] == [1, 16]
    points, basis = profile.points("b", h200, "fp8_block", shape, tokens=4096)  # every shape's: M = 4096 is DeepSeek's
    assert [e.tokens for e in points] == [1, 16, 4096] and basis.startswith("measured at other shapes")
    assert "M = 1-16 only" in basis
    assert [e.tokens for e in profile.points("b", h200, "fp8_block", shape)[0]] == [1, 16]  # no M asked: as before
    only_decode = Profile(tuple(decode))
    assert [e.tokens for e in only_decode.points("b", h200, "fp8_block", shape, tokens=4096)[0]] == [1, 16]


# --- transports measured (issue 15: plan --ep N from measured communication) ------------------------
def _ep_problem(ep: int, quant: str = "bf16") -> MoEProblem:
    return load_preset("deepseek-v3").problem(quant=quant, max_tokens=1024, parallel=ParallelConfig(ep))


def _transport_times(path: Path, times: dict[str, dict[int, float]], ep: int = 2) -> Profile:
    """A profile of PrepareFinalize measurements {name: {M: us}} at DeepSeek-V3's shape on ``ep`` H200s."""
    h200 = Platform.preset("h200")
    save_profile(path, [ProfileEntry.measurement(name, h200, _ep_problem(ep), m, us, preset="deepseek-v3",
                                                 parallel=True)
                        for name, by_m in times.items() for m, us in by_m.items()])
    return load_profile(path)


def test_a_transport_measurement_round_trips_with_its_ranks_and_is_its_own_estimate(tmp_path):
    from moe.oracle.cost import estimate_transport
    from moe.formats import ActivationFormat

    loaded = _transport_times(tmp_path / "ep.yaml", {"all_to_all": {16: 300.0}})
    saved = yaml.safe_load((tmp_path / "ep.yaml").read_text())["backends"]["all_to_all"]["h200"][0]
    assert saved["shape"] == {"preset": "deepseek-v3", "ep_size": 2}
    assert loaded.entries[0].shape == ProfileShape.of(_ep_problem(2), "deepseek-v3", parallel=True)
    profile = builtin_profile().merged(loaded)
    h200 = Platform.preset("h200")
    # at the measured shape and M the estimate is the measurement: divided into and multiplied by transport_us
    at_16 = estimate_transport("all_to_all", ActivationFormat.STANDARD, False, _ep_problem(2), h200, 16, profile)
    assert at_16.us == pytest.approx(300.0) and at_16.basis.startswith("measured at this shape")
    # at other ranks it informs as an efficiency against that problem's own interconnect roofline (alone here: the
    # shipped profile's other EP2 shapes at M = 16 would be averaged in)
    at_4 = estimate_transport("all_to_all", ActivationFormat.STANDARD, False, _ep_problem(4), h200, 16, loaded)
    assert at_4.basis.startswith("measured at other shapes") and at_4.efficiency == pytest.approx(at_16.efficiency)
    # the experts' shape keeps ep_size 1: the one-GPU bench measures what an EP problem's experts run
    assert ProfileShape.of(_ep_problem(2)).ep_size == 1


def test_plan_picks_the_measured_faster_transport_per_bucket(tmp_path):
    """all_to_all measured faster at decode, flashinfer_a2a at prefill: the plan follows the measurements
    (times invented here to cross; benchmarks/ep_all_to_all.py --save-profile writes real ones)."""
    times = {"all_to_all": {1: 40.0, 64: 80.0, 1024: 900.0}, "flashinfer_a2a": {1: 90.0, 64: 120.0, 1024: 300.0}}
    path = tmp_path / "ep.yaml"
    _transport_times(path, times)
    result = plan(_ep_problem(2), Platform.preset("h200"), Policy(profiles=(str(path),), buckets=(1, 64, 1024)))
    chosen = {b.high: b.chosen.pair.prepare_finalize for b in result.buckets}
    assert chosen == {1: "all_to_all", 64: "all_to_all", 1024: "flashinfer_a2a"}
    # the user's profile first; the shipped measured-h200.yaml also holds this shape (session 11's EP2 run)
    assert "flashinfer_a2a: 300.0 us [measured at this shape (ep.yaml, measured-h200.yaml)]" in result.explain()


def test_a_weight_only_mode_reads_the_measurements_of_the_kernels_it_runs():
    """W4A8 mxfp4 run weight-only (Triton below SM100) is the W4A16 kernels: it is estimated from their
    measurements (measured-h200.yaml), not from a generic guess."""
    h200 = Platform.preset("h200")
    w4a8, w4a16 = (load_preset("gpt-oss-120b").problem(quant=q, max_tokens=64) for q in ("mxfp4_a_mxfp8", "mxfp4"))
    assert w4a8.scheme_run_as(QuantFormat.NONE) == "mxfp4" and w4a8.scheme_run_as(None) == "mxfp4_a_mxfp8"
    assert MoEProblem.create(**SMALL, quant="nvfp4").scheme_run_as(QuantFormat.NONE) == "nvfp4"  # no (nvfp4, none)
    for m in (1, 16, 64):
        weight_only = estimate_experts("triton", w4a8, h200, m, builtin_profile(), experts_classes(), QuantFormat.NONE)
        same = estimate_experts("triton", w4a16, h200, m, builtin_profile(), experts_classes(), QuantFormat.NONE)
        assert weight_only.us == pytest.approx(same.us) and weight_only.basis == same.basis
        assert weight_only.basis.startswith("measured at this shape (measured-h200.yaml")


@pytest.mark.parametrize("ep_size,match", [(0, "must be an int >= 1, the ranks measured"),
                                           (-1, "must be an int >= 1, the ranks measured"),
                                           ("two", "must be an int >= 1, the ranks measured"),
                                           (True, "must be an int >= 1, the ranks measured"),
                                           (3, "must divide num_experts=256, the ranks sharing the experts evenly")])
def test_a_profile_shape_s_ep_size_must_be_a_rank_count(tmp_path, ep_size, match):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"backends": {"all_to_all": {"h200": [
        {"tokens": 1, "quant": "bf16", "measured_us": 3.0, "shape": {"preset": "deepseek-v3", "ep_size": ep_size}}]}}}))
    with pytest.raises(MoEConfigError, match=rf"shape.ep_size {match} \(got {ep_size!r}\)"):
        load_profile(path)


@pytest.mark.parametrize("text,match", [
    ("backends: {triton: {h100: [{tokens: 1, quant: bf16, efficiency: 0.5, speed: 2}]}}",
     r"unknown key\(s\) \['speed'\].*allowed keys: tokens, quant, efficiency, measured_us"),
    ("backends: {triton: {h100: [{tokens: 1, quant: bf16, efficiency: 0.5, measured_us: 3}]}}", "exactly one of"),
    ("backends: {triton: {h100: [{tokens: 1, quant: bf16, efficiency: 1.5}]}}", r"in \(0, 1\]"),
    ("backends: {triton: {h100: [{tokens: 1, quant: bf16, measured_us: 3}]}}", "shape.*required"),
    ("backends: {triton: {h100: [{tokens: 0, quant: bf16, efficiency: 0.5}]}}", "tokens must be an int >= 1"),
    ("version: 2\nbackends: {}", "version must be 1"),
    ("colour: red", r"unknown key\(s\) \['colour'\].*allowed keys: version, description, backends"),
    ("backends: [", "not valid YAML"),
])
def test_invalid_profile_files_name_the_key(tmp_path, text, match):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(MoEConfigError, match=match):
        load_profile(path)


# --- selection properties ---------------------------------------------------------------------------
def _grid():
    """A seeded sample of platform x preset x scheme x activation x EP x libraries."""
    quants = ("bf16", "fp16", "fp8", "fp8_token", "fp8_block", "mxfp8", "mxfp4", "nvfp4")
    combos = list(itertools.product(PRESET_NAMES, preset_names(), quants, (None, "relu2"), (1, 8), ((), ("flashinfer",))))
    return random.Random(0).sample(combos, 160)


def _problem(preset: str, quant: str, activation: str | None, ep: int) -> MoEProblem:
    p = load_preset(preset)
    ep = ep if p.num_experts % ep == 0 else 1
    return MoEProblem.create(num_experts=p.num_experts, top_k=p.top_k, hidden_size=p.hidden_size,
                             intermediate_size=p.intermediate_size, activation=activation or p.activation,
                             quant=quant, has_bias=p.has_bias, max_tokens=2048, parallel=ParallelConfig(ep_size=ep))


@pytest.mark.parametrize("platform_name,preset,quant,activation,ep,remove", _grid())
def test_plan_properties(platform_name, preset, quant, activation, ep, remove):
    problem = _problem(preset, quant, activation, ep)
    platform = Platform.preset(platform_name).with_libraries(remove=remove)
    result = plan(problem, platform, Policy(), allow_empty=True)
    experts, pfs = experts_classes(), prepare_finalize_classes()
    # every registered candidate exactly once, rejected ones with reasons
    assert sorted(c.name for c in result.candidates) == sorted(list(experts) + list(pfs))
    for c in result.candidates:
        cls = experts[c.name] if c.kind == "experts" else pfs[c.name]
        if cls.check(problem, platform):
            assert c.reasons and set(cls.check(problem, platform)) <= set(c.reasons)
    # the plan never picks a candidate whose check fails, nor a declaration without a working apply
    for bucket in result.buckets:
        pair = bucket.chosen.pair
        assert experts[pair.experts].check(problem, platform) == []
        assert pfs[pair.prepare_finalize].check(problem, platform) == []
        assert experts[pair.experts].capabilities.implemented and pfs[pair.prepare_finalize].implemented
        assert [s.us for s in bucket.ranking] == sorted(s.us for s in bucket.ranking)
    # buckets tile 1..max_tokens
    assert [(b.low, b.high) for b in result.buckets] in ([], [(1, 1), (2, 4), (5, 16), (17, 64), (65, 256),
                                                             (257, 1024), (1025, 2048)])
    # the explanation lists every candidate exactly once; the JSON is the documented object
    candidates = result.explain().split("candidates (every registered backend, once):")[1]
    for c in result.candidates:
        assert len(re.findall(rf"^  {c.kind:<17} {re.escape(c.name)} ", candidates, re.M)) == 1, c.name
    data = json.loads(json.dumps(result.to_json()))
    assert set(data) == {"plan", "rejected", "workspace_bytes", "platform", "slow_path"}
    # a slow path is exactly a GPU bucket served by the reference experts, and then it says why
    slow = [row["slow_path"] for row in data["plan"]]
    assert slow == [platform.is_cuda and row["experts"] == "reference" for row in data["plan"]]
    assert (data["slow_path"] is not None) == any(slow)
    assert data["rejected"] == {c.name: list(c.reasons) for c in result.candidates if c.reasons}
    # forcing a rejected experts backend raises with its own reasons
    unusable = next((n for n, cls in experts.items() if cls.check(problem, platform)), None)
    if unusable is not None:
        with pytest.raises(UnsupportedError) as error:
            plan(problem, platform, Policy(force=(unusable,)))
        assert error.value.reasons == tuple(experts[unusable].check(problem, platform))


class _DeclaredOnlyExperts(ReferenceExperts):
    name = "declared_only"
    capabilities = dataclasses.replace(ReferenceExperts.capabilities, implemented=False)


class _DeclaredOnlyPrepareFinalize(LocalPrepareFinalize):
    name = "declared_only_pf"
    implemented = False


def test_a_declaration_without_apply_is_never_selected_even_if_it_looks_fastest(tmp_path):
    profile = tmp_path / "fast.yaml"
    profile.write_text(yaml.safe_dump({"version": 1, "backends": {
        name: {"*": [{"tokens": 1, "quant": "*", "efficiency": 1.0}]} for name in ("declared_only", "declared_only_pf")}}))
    experts = {**experts_classes(), "declared_only": _DeclaredOnlyExperts}
    pfs = {**prepare_finalize_classes(), "declared_only_pf": _DeclaredOnlyPrepareFinalize}
    problem = MoEProblem.create(**SMALL)
    policy = Policy(profiles=(str(profile),))
    result = plan(problem, Platform.preset("cpu"), policy, experts=experts, prepare_finalize=pfs)
    assert "declared only" in " ".join(result.rejected["declared_only"])
    assert "declared only" in " ".join(result.rejected["declared_only_pf"])
    assert all(b.chosen.pair.experts != "declared_only" for b in result.buckets)
    for name in ("declared_only", "declared_only_pf"):
        with pytest.raises(UnsupportedError, match="declared only"):
            plan(problem, Platform.preset("cpu"), dataclasses.replace(policy, force=(name,)),
                 experts=experts, prepare_finalize=pfs)


def test_forcing_an_unusable_backend_raises_with_all_its_reasons():
    problem = load_preset("deepseek-v3").problem(quant="nvfp4")
    with pytest.raises(UnsupportedError, match="forces experts 'torch_grouped'") as error:
        plan(problem, Platform.preset("cpu"), Policy(force=("torch_grouped",)))
    assert any("quant nvfp4" in r for r in error.value.reasons)
    with pytest.raises(UnsupportedError, match="forces prepare_finalize 'batched'"):
        plan(dataclasses.replace(problem, parallel=ParallelConfig(ep_size=8)), Platform.preset("cpu"),
             Policy(force=("batched",)))


def test_nothing_can_serve_raises_with_every_reason_unless_allowed():
    problem = MoEProblem.create(**SMALL, quant="nvfp4")
    policy = Policy(deny=("reference",))
    with pytest.raises(UnsupportedError, match="no \\(prepare/finalize, experts\\) pair") as error:
        plan(problem, Platform.preset("cpu"), policy)
    assert any(r.startswith("experts reference: denied by policy") for r in error.value.reasons)
    empty = plan(problem, Platform.preset("cpu"), policy, allow_empty=True)
    assert empty.buckets == () and empty.to_json()["plan"] == [] and "no (prepare/finalize" in empty.table()


def test_prefer_moves_a_candidate_up_only_within_the_margin():
    problem = MoEProblem.create(**SMALL)
    cpu = Platform.preset("cpu")
    base = plan(problem, cpu, Policy())
    assert base.bucket_for(1).chosen.pair.experts == "torch_grouped"
    far = plan(problem, cpu, Policy(prefer=("reference",)))
    assert far.bucket_for(1).chosen.pair.experts == "torch_grouped"
    near = plan(problem, cpu, Policy(prefer=("reference",), prefer_margin=5.0))
    assert near.bucket_for(1).chosen.pair.experts == "reference" and near.bucket_for(1).preferred
    assert "(preferred by policy)" in near.table()


# --- the layer uses the plan --------------------------------------------------------------------------
@pytest.fixture
def two_backend_policy(tmp_path):
    """On CPU: reference for M <= 4, torch_grouped above (torch_grouped made hopeless at small M)."""
    path = tmp_path / "split.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "backends": {"torch_grouped": {"cpu": [
        {"tokens": 4, "quant": "*", "efficiency": 0.001, "overhead_us": 1e6},
        {"tokens": 64, "quant": "*", "efficiency": 1.0}]}}}))
    return Policy(buckets=(4,), profiles=(str(path),))


def test_layer_dispatches_per_bucket_and_shares_one_workspace(two_backend_policy):
    E, K, H, I = 6, 2, 40, 24
    layer = FusedMoE(E, K, H, I, dtype=torch.float32, quant="fp32", max_tokens=64, policy=two_backend_policy,
                     platform=Platform.preset("cpu"))
    assert [b.chosen.pair.experts for b in layer.plan.buckets] == ["reference", "torch_grouped"]
    assert layer.kernel_for(0).experts.name == layer.kernel_for(4).experts.name == "reference"
    assert layer.kernel_for(5).experts.name == layer.kernel.experts.name == "torch_grouped"
    assert "plan=[1-4: local + reference, 5-64: local + torch_grouped]" in repr(layer)
    assert layer.plan.workspace_bytes == max(k.workspace_bytes() for k in layer.kernels.values())
    w13, w2 = torch.randn(E, 2 * I, H) / 8, torch.randn(E, H, I) / 6
    layer.load_weights(w13=w13, w2=w2)
    truth = ModularKernel(LocalPrepareFinalize(layer.problem), ReferenceExperts(layer.problem))
    truth.load(layer.weights)
    for m in (0, 3, 40):
        x, logits = torch.randn(m, H), torch.randn(m, E)
        out = layer(x, logits)
        assert out.shape == (m, H)
        assert_close_moe(out, truth(x, layer.router(logits)), "fp32")
    managers = {id(k.workspace) for k in layer.kernels.values()}
    assert len(managers) == 1
    assert layer.kernel.workspace.reserved_bytes <= layer.plan.workspace_bytes


def test_layer_force_and_env(monkeypatch):
    assert FusedMoE(4, 2, 64, 32, experts="reference").kernel.experts.name == "reference"
    monkeypatch.setenv("MOE_EXPERTS", "reference")
    layer = FusedMoE(4, 2, 64, 32)
    assert layer.kernel.experts.name == "reference" and layer.plan.policy.source == "MOE_EXPERTS"
    monkeypatch.setenv("MOE_EXPERTS", "torch_grouped")
    with pytest.raises(UnsupportedError, match="MOE_EXPERTS"):
        FusedMoE(4, 2, 64, 32, quant="fp8")
    # the argument wins over the environment
    assert FusedMoE(4, 2, 64, 32, quant="fp8", experts="reference").kernel.experts.name == "reference"
    with pytest.raises(MoEConfigError, match="unknown experts backend 'nope'"):
        FusedMoE(4, 2, 64, 32, experts="nope")


def test_shipped_h200_measurements_set_the_gpt_oss_crossover():
    """benchmarks/results -> moe/oracle/profiles/measured-h200.yaml: on the GPT-OSS-20B shape in bf16,
    Triton measured faster up to M=64 and FlashInfer CUTLASS from M=256 (1.27x there); the plan follows."""
    problem = load_preset("gpt-oss-20b").problem(quant="bf16", max_tokens=4096)
    result = plan(problem, Platform.preset("h200"), Policy(buckets=(1, 16, 64, 256, 1024, 4096)))
    chosen = {b.high: b.chosen.pair.experts for b in result.buckets}
    assert chosen == {1: "triton", 16: "triton", 64: "triton", 256: "flashinfer_cutlass",
                      1024: "flashinfer_cutlass", 4096: "flashinfer_cutlass"}
    assert all(b.chosen.experts.basis.startswith("measured at this shape") for b in result.buckets)


def _shipped_without(name: str) -> Profile:
    """The shipped profiles less the file ``name``: what the oracle reads where that file is not shipped."""
    kept = tuple(e for e in builtin_profile().entries if Path(e.source).name != name)
    assert len(kept) < len(builtin_profile().entries), f"{name} is not among the shipped profiles"
    return Profile(kept)


def test_h100_reads_the_h200_measurements_against_the_h200_ceilings():
    """Issue 14: an H100 with no measurement of its own (here: the shipped measured-h100.yaml left out)
    uses the H200's measured profile (same SM90 architecture), each point's efficiency taken against
    the H200's roofline, so time scales with the H100's own ceilings: a memory-bound decode point costs
    4.2/3.0 as long; a compute-bound one the same."""
    problem = load_preset("qwen3-30b-a3b").problem(quant="bf16", max_tokens=8192)
    h100, h200 = Platform.preset("h100"), Platform.preset("h200")
    profile = _shipped_without("measured-h100.yaml")
    at = {name: estimate_experts("triton", problem, platform, 1, profile) for name, platform in
          (("h100", h100), ("h200", h200))}
    assert at["h200"].basis.startswith("measured at this shape")
    assert at["h100"].basis.startswith("measured on h200 at this shape, against its ceilings")
    assert at["h100"].efficiency == pytest.approx(at["h200"].efficiency)
    memory_ratio = h200.memory_bandwidth / h100.memory_bandwidth
    assert roofline(problem, h100, 1).bound == "memory"
    assert at["h100"].us == pytest.approx(at["h200"].us * memory_ratio)


def test_a_guess_never_displaces_a_measurement_on_its_architecture():
    """Issue 14: `plan --platform h100` picked flashinfer_cutedsl for M = 2-256 from a generic estimate
    (0.45-0.72 of the roofline) over backends measured on the same architecture; now a backend with no
    measurement there ranks with the default efficiency, and says why. Elsewhere (b200, nothing
    measured) estimates still rank every backend."""
    problem = load_preset("qwen3-30b-a3b").problem(quant="bf16", max_tokens=8192)
    for name in ("h100", "h200"):
        result = plan(problem, Platform.preset(name), Policy(buckets=(1, 4, 16, 64, 256, 1024, 4096, 8192)))
        assert {b.chosen.pair.experts for b in result.buckets} <= {"triton", "flashinfer_cutlass"}, name
        guessed = estimate_experts("flashinfer_cutedsl", problem, Platform.preset(name), 64, builtin_profile(),
                                   experts_classes())
        assert guessed.basis.startswith(f"not measured on {name}") and "a guess never displaces" in guessed.basis
    # without peers (a prepare/finalize, or a caller that names none) the estimates stand
    assert not estimate_experts("flashinfer_cutedsl", problem, h100 := Platform.preset("h100"), 64,
                                builtin_profile()).basis.startswith("not measured")
    b200 = estimate_experts("flashinfer_cutedsl", problem, Platform.preset("b200"), 64, builtin_profile(),
                            experts_classes())
    assert not b200.basis.startswith(("measured", "not measured")) and b200.efficiency > 0.1
    assert sibling_kinds(h100) == ("h200",) and sibling_kinds(Platform.preset("cpu")) == ()
