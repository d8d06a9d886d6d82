"""Model presets: every file builds a valid problem and router; the schema is strict;
scaled copies stay valid."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from moe.errors import MoEConfigError
from moe.presets import (
    PRESET_DIR,
    ROUTER_OPTION_KEYS,
    Preset,
    load_preset,
    load_preset_file,
    preset_names,
)
from moe.problem import MoEProblem, ParallelConfig
from moe.router import Router

# name: (E, k, H, I, activation, routing, quant, has_bias) — the numbers cited in each YAML file.
EXPECTED = {
    "mixtral-8x7b": (8, 2, 4096, 14336, "silu", "softmax", "bf16", False),
    "qwen3-30b-a3b": (128, 8, 2048, 768, "silu", "softmax", "bf16", False),
    "deepseek-v3": (256, 8, 7168, 2048, "silu", "deepseek_v3", "fp8_block", False),
    "deepseek-v3-ep8-slice": (32, 8, 7168, 2048, "silu", "softmax", "bf16", False),
    "gpt-oss-20b": (32, 4, 2880, 2880, "swiglu_oai", "gpt_oss", "mxfp4", True),
    "gpt-oss-120b": (128, 4, 2880, 2880, "swiglu_oai", "gpt_oss", "mxfp4", True),
    "nemotron-h": (128, 6, 2688, 1856, "relu2", "deepseek_v3", "bf16", False),
}

SCALES = [(256, 128, 16), (64, 32, 8), (32, 32, 2), (100, 70, 5), (10**6, 10**6, 10**6)]


def _router(preset: Preset) -> Router:
    bias = torch.zeros(preset.num_experts) if preset.has_correction_bias else None
    return preset.router(correction_bias=bias)


def _write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "preset.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _mixtral_data() -> dict:
    return yaml.safe_load((PRESET_DIR / "mixtral-8x7b.yaml").read_text())


def test_preset_names_are_the_yaml_files():
    assert preset_names() == tuple(sorted(EXPECTED))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_preset_loads_and_builds(name):
    preset = load_preset(name)
    E, k, H, I, activation, routing, quant, has_bias = EXPECTED[name]
    assert (preset.name, preset.num_experts, preset.top_k, preset.hidden_size, preset.intermediate_size) == (
        name,
        E,
        k,
        H,
        I,
    )
    assert (preset.activation, preset.routing, preset.quant, preset.has_bias) == (
        activation,
        routing,
        quant,
        has_bias,
    )
    assert preset.source and preset.notes
    problem = preset.problem(max_tokens=64)
    assert isinstance(problem, MoEProblem)
    assert (problem.num_experts, problem.top_k, problem.hidden_size, problem.intermediate_size) == (
        E,
        k,
        H,
        I,
    )
    assert problem.activation.name == activation and problem.has_bias == has_bias and problem.max_tokens == 64
    assert problem.quant_name == ("bf16" if quant == "bf16" else quant)
    topk = _router(preset)(torch.randn(3, E))
    assert topk.ids.shape == (3, k)


def test_deepseek_routing_options():
    preset = load_preset("deepseek-v3")
    assert preset.router_options() == dict(
        renormalize=True, n_group=8, topk_group=4, routed_scaling_factor=2.5
    )
    assert preset.has_correction_bias
    nemotron = load_preset("nemotron-h")
    assert nemotron.router_options() == dict(
        renormalize=True, n_group=1, topk_group=1, routed_scaling_factor=2.5
    )
    assert not load_preset("mixtral-8x7b").has_correction_bias


def test_router_options_are_router_keywords():
    for name in preset_names():
        options = load_preset(name).router_options()
        assert set(options) <= set(ROUTER_OPTION_KEYS) and "correction_bias" not in options


def test_problem_passes_options_through():
    preset = load_preset("mixtral-8x7b")
    problem = preset.problem(
        quant="fp8_block", dtype=torch.float16, max_tokens=128, parallel=ParallelConfig(ep_size=2)
    )
    assert problem.quant_name == "fp8_block" and problem.dtype == torch.float16
    assert problem.local_num_experts == 4 and problem.max_tokens == 128
    assert load_preset("deepseek-v3").problem().quant_name == "fp8_block"
    assert load_preset("gpt-oss-20b").problem(has_bias=False).has_bias is False


def test_preset_is_frozen_hashable_and_repr_round_trips():
    preset = load_preset("deepseek-v3")
    with pytest.raises(AttributeError):
        preset.top_k = 4
    assert hash(preset) == hash(load_preset("deepseek-v3"))
    assert eval(repr(preset), {"Preset": Preset}) == preset
    options = preset.options
    options["n_group"] = 2
    assert preset.router_options()["n_group"] == 8  # a copy


def test_unknown_preset_lists_available():
    with pytest.raises(MoEConfigError, match="unknown preset 'llama'.*mixtral-8x7b"):
        load_preset("llama")


# ----------------------------------------------------------------------------------------------
# Schema


def test_schema_rejects_unknown_key(tmp_path):
    data = _mixtral_data() | {"num_shared_experts": 1}
    with pytest.raises(MoEConfigError, match=r"unknown key\(s\) \['num_shared_experts'\]"):
        load_preset_file(_write(tmp_path, data))


def test_schema_rejects_missing_key(tmp_path):
    data = _mixtral_data()
    del data["top_k"]
    with pytest.raises(MoEConfigError, match=r"missing key\(s\) \['top_k'\]"):
        load_preset_file(_write(tmp_path, data))


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("top_k", "2", "top_k must be int"),
        ("num_experts", True, "num_experts must be int"),
        ("has_bias", "no", "has_bias must be bool"),
        ("routing_options", [1], "routing_options must be dict"),
    ],
)
def test_schema_rejects_wrong_types(tmp_path, key, value, message):
    data = _mixtral_data() | {key: value}
    with pytest.raises(MoEConfigError, match=message):
        load_preset_file(_write(tmp_path, data))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"routing_options": {"renormalise": True}}, r"routing_options: unknown key\(s\) \['renormalise'\]"),
        ({"routing_options": {"n_group": 2, "topk_group": 1}}, "n_group is a deepseek_v3 option"),
        (
            {"routing_options": {"has_correction_bias": True}},
            "has_correction_bias=true needs routing='deepseek_v3'",
        ),
        ({"routing_options": {"has_correction_bias": "yes"}}, "has_correction_bias must be a bool"),
        ({"routing": "sigmoid"}, "routing must be one of"),
        ({"activation": "swish"}, "activation must be one of"),
        ({"quant": "int4"}, "quant must be one of"),
        ({"top_k": 9}, "top_k must be <= num_experts"),
    ],
)
def test_schema_rejects_bad_values(tmp_path, change, message):
    with pytest.raises(MoEConfigError, match=message):
        load_preset_file(_write(tmp_path, _mixtral_data() | change))


def test_file_must_hold_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(MoEConfigError, match="must hold a mapping"):
        load_preset_file(path)


def test_load_preset_file_reads_a_tmp_preset(tmp_path):
    preset = load_preset_file(_write(tmp_path, _mixtral_data() | {"name": "my-mixtral"}))
    assert preset.name == "my-mixtral" and preset.num_experts == 8


# ----------------------------------------------------------------------------------------------
# Scaled copies


@pytest.mark.parametrize("name", sorted(EXPECTED))
@pytest.mark.parametrize("max_hidden, max_intermediate, max_experts", SCALES)
def test_scaled_presets_stay_valid(name, max_hidden, max_intermediate, max_experts):
    original = load_preset(name)
    preset = original.scaled(max_hidden, max_intermediate, max_experts)
    assert preset.name == name + "-scaled" and preset.is_scaled and not original.is_scaled
    assert preset.hidden_size % 32 == 0 and preset.intermediate_size % 32 == 0
    assert preset.hidden_size <= max(max_hidden, 32) and preset.intermediate_size <= max(max_intermediate, 32)
    assert 1 <= preset.top_k <= preset.num_experts <= max_experts
    assert preset.hidden_size <= original.hidden_size and preset.num_experts <= original.num_experts
    for key in ("activation", "routing", "quant", "has_bias", "source"):
        assert getattr(preset, key) == getattr(original, key)
    preset.problem(max_tokens=16)  # the original quant scheme still fits the scaled shapes
    topk = _router(preset)(torch.randn(5, preset.num_experts))
    assert topk.ids.shape == (5, preset.top_k)
    assert preset.scaled(max_hidden, max_intermediate, max_experts) == preset  # idempotent


def test_scaled_deepseek_keeps_groups_valid():
    preset = load_preset("deepseek-v3").scaled(256, 128, 8)
    assert (preset.num_experts, preset.top_k) == (8, 8)
    assert preset.router_options() == dict(
        renormalize=True, n_group=4, topk_group=4, routed_scaling_factor=2.5
    )
    preset = load_preset("deepseek-v3").scaled(256, 128, 16)
    assert (preset.num_experts, preset.top_k, preset.options["n_group"], preset.options["topk_group"]) == (
        16,
        8,
        8,
        4,
    )
    preset = load_preset("deepseek-v3").scaled(256, 128, 6)
    assert (preset.num_experts, preset.top_k, preset.options["n_group"], preset.options["topk_group"]) == (
        6,
        6,
        3,
        3,
    )
    assert (preset.hidden_size, preset.intermediate_size) == (256, 128)
    assert "Scaled for demos from E=256" in preset.notes


@pytest.mark.parametrize(
    "args, message",
    [
        ((16, 128, 8), "max_hidden must be an int >= 32"),
        ((256, 31, 8), "max_intermediate must be an int >= 32"),
        ((256, 128, 0), "max_experts must be an int >= 1"),
    ],
)
def test_scaled_rejects_bad_limits(args, message):
    with pytest.raises(MoEConfigError, match=message):
        load_preset("mixtral-8x7b").scaled(*args)


def test_scaled_grouped_routing_needs_two_experts():
    with pytest.raises(MoEConfigError, match="max_experts must be >= 2 for a grouped routing"):
        load_preset("deepseek-v3").scaled(256, 128, 1)
    assert load_preset("mixtral-8x7b").scaled(256, 128, 1).top_k == 1
