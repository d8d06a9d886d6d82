"""No silent slow path on a GPU: when only the reference experts serve a bucket there, the layer warns
once when it is built and `moe plan` marks the buckets, naming why each kernel refused and what would
serve. Every scheme has a kernel on every GPU preset now (nvfp4 on an H100, fp8 on an A100, mxfp8 and W4A8
mxfp4 below SM100 were slow paths until the Triton experts ran them weight-only), so the slow paths here
are the ones left: a shape no kernel takes (nvfp4 with H = I = 48, Triton's weight-only groups are 32
wide) and a GPU without Triton installed (simulated: ``with_libraries(remove=("triton",))``)."""

import json
import warnings

import pytest
import torch

from moe import FusedMoE, MoEProblem, Platform, SlowPathWarning, plan
from moe.tools.cli import main
from moe.oracle import Policy
from moe.oracle.slow_path import slow_buckets, slow_path
from moe.platform import PRESET_NAMES


def _problem(quant: str, **kw) -> MoEProblem:
    sizes = dict(num_experts=8, top_k=2, hidden_size=256, intermediate_size=128, max_tokens=64)
    return MoEProblem.create(**{**sizes, **kw}, quant=quant)


def _no_triton(name: str) -> Platform:
    return Platform.preset(name).with_libraries(remove=("triton",))


def test_a_shape_no_kernel_takes_is_a_slow_path_with_every_reason_and_the_way_out():
    result = plan(_problem("nvfp4", hidden_size=48, intermediate_size=48), Platform.preset("h100"), Policy())
    found = slow_path(result)
    assert found is not None and found.scheme == "nvfp4" and found.device == "h100"
    assert found.buckets == tuple((b.low, b.high) for b in result.buckets)
    refused = dict(found.refusals)
    assert "needs SM100" in "; ".join(refused["flashinfer_trtllm"])
    assert "hidden_size must be a multiple of 32 for triton (nvfp4 weight-only) (got 48)" in "; ".join(refused["triton"])
    assert "b200" in found.other_platforms and "h200" not in found.other_platforms
    assert {"bf16", "fp8_block"} <= set(found.other_schemes)
    text = found.message()
    assert "no kernel serves nvfp4 on h100" in text and "flashinfer_cutlass:" in text
    assert "quant=bf16 or" in text and "nvfp4 on b200" in text


def test_mxfp8_without_triton_is_a_slow_path_that_names_the_install():
    found = slow_path(plan(_problem("mxfp8"), _no_triton("h100"), Policy()))
    assert found is not None and found.scheme == "mxfp8"
    assert "needs library 'triton', which is not installed: pip install 'moe[triton]'" in dict(found.refusals)["triton"]
    assert {"a100", "h200", "b200"} <= set(found.other_platforms)  # presets assume Triton installed


def test_a_shape_no_kernel_takes_on_a100_offers_the_weight_only_schemes():
    found = slow_path(plan(_problem("nvfp4", hidden_size=48, intermediate_size=48), Platform.preset("a100"), Policy()))
    assert found is not None and "h100" not in found.other_platforms  # no kernel takes H = 48 nvfp4 on SM90 either
    assert {"fp8", "fp8_block"} <= set(found.other_schemes)  # weight-only on an A100


@pytest.mark.parametrize("quant,platform", [("nvfp4", "h100"), ("nvfp4", "h200"), ("nvfp4", "a100"),
                                            ("fp8", "a100"), ("fp8_token", "a100"), ("fp8_block", "a100"),
                                            ("mxfp8", "h100"), ("mxfp8", "h200"), ("mxfp8", "a100"),
                                            ("mxfp4_a_mxfp8", "h100"), ("mxfp4_a_mxfp8", "a100")])
def test_weight_only_triton_serves_where_the_reference_did(quant, platform):
    """Issue 14: no Python reference on any GPU for these: Triton's weight-only modes serve every bucket."""
    result = plan(_problem(quant), Platform.preset(platform), Policy())
    assert slow_path(result) is None
    assert {b.chosen.pair.experts for b in result.buckets} == {"triton"}


@pytest.mark.parametrize("quant", ["bf16", "fp8", "fp8_token", "fp8_block", "mxfp8", "mxfp4", "mxfp4_a_mxfp8",
                                   "nvfp4"])
def test_every_scheme_has_a_kernel_on_every_gpu_preset(quant):
    """The issue-14 goal as a sweep: at a shape every kernel's alignment allows, no GPU preset runs the
    reference for any scheme."""
    problem = _problem(quant, dtype=torch.bfloat16)
    for name in PRESET_NAMES:
        platform = Platform.preset(name)
        if platform.is_cuda:
            assert slow_buckets(plan(problem, platform, Policy())) == (), f"{quant} on {name}"


@pytest.mark.parametrize("quant,platform", [("bf16", "h100"), ("nvfp4", "b200"), ("nvfp4", "cpu")])
def test_no_slow_path_where_a_kernel_serves_or_on_a_cpu(quant, platform):
    result = plan(_problem(quant), Platform.preset(platform), Policy())
    assert slow_path(result) is None and slow_buckets(result) == ()


def test_the_layer_warns_once_for_many_equal_layers():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):  # one model, three equal layers: one warning
            FusedMoE(8, 2, 256, 128, quant="mxfp8", max_tokens=64, platform=_no_triton("h100"))
    slow = [w for w in caught if issubclass(w.category, SlowPathWarning)]
    assert len(slow) == 1
    assert "no kernel serves mxfp8 on h100" in str(slow[0].message)


def test_a_layer_that_forces_the_reference_is_not_warned():
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowPathWarning)
        layer = FusedMoE(8, 2, 256, 128, quant="mxfp8", max_tokens=64, platform=_no_triton("h100"),
                         experts="reference")
    assert layer.kernel.experts.name == "reference"


def test_a_layer_on_a_gpu_with_a_kernel_is_not_warned():
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowPathWarning)
        FusedMoE(8, 2, 256, 128, quant="bf16", dtype=torch.bfloat16, max_tokens=64, platform=Platform.preset("h100"))
        FusedMoE(8, 2, 256, 128, quant="mxfp8", dtype=torch.bfloat16, max_tokens=64, platform=Platform.preset("h100"))


def test_plan_cli_marks_slow_buckets(capsys):
    main(["plan", "--platform", "a100", "--no-triton", "--preset", "deepseek-v3-ep8-slice", "--quant", "mxfp8",
          "--tokens", "1", "64"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if "local + reference" in line]
    assert len(rows) == 2 and all(line.endswith("SLOW PATH") for line in rows)
    assert "no kernel serves mxfp8 on a100" in out and "What would serve with a kernel" in out
    main(["plan", "--platform", "a100", "--preset", "deepseek-v3-ep8-slice", "--quant", "fp8_block",
          "--tokens", "1", "64"])
    out = capsys.readouterr().out
    assert "SLOW PATH" not in out and len([line for line in out.splitlines() if "local + triton" in line]) == 2


def test_plan_cli_json_marks_slow_buckets(capsys):
    main(["plan", "--platform", "h100", "--no-triton", "--preset", "gpt-oss-120b", "--quant", "mxfp8", "--tokens",
          "1", "64", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert [b["slow_path"] for b in result["plan"]] == [True, True]
    assert "no kernel serves mxfp8 on h100" in result["slow_path"]
    main(["plan", "--platform", "h100", "--preset", "gpt-oss-120b", "--quant", "mxfp4", "--tokens", "1", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["slow_path"] is None and result["plan"][0]["slow_path"] is False


def test_alternatives_skip_schemes_whose_scale_blocks_do_not_divide_the_sizes():
    """H = I = 48: nvfp4 (blocks of 16) stores it, mxfp8/mxfp4 (blocks of 32) cannot; the search for what
    would serve must skip them, not fail the layer's construction."""
    with pytest.warns(SlowPathWarning, match="no kernel serves nvfp4 on h100"):
        layer = FusedMoE(8, 2, 48, 48, quant="nvfp4", max_tokens=16, platform=Platform.preset("h100"))
    found = slow_path(layer.plan)
    assert "bf16" in found.other_schemes
    assert not {"mxfp8", "mxfp4"} & set(found.other_schemes)
