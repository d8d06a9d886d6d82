"""No silent slow path on a GPU: when only the reference experts serve a bucket there, the layer warns
once when it is built and `moe plan` marks the buckets, naming why each kernel refused and what would
serve. Simulated platforms: mxfp8 on an H100 or an A100 has no kernel (nvfp4 on an H100 and fp8 on an A100
did, until the Triton experts ran them weight-only)."""

import json
import warnings

import pytest
import torch

from moe import FusedMoE, MoEProblem, Platform, SlowPathWarning, plan
from moe.tools.cli import main
from moe.oracle import Policy
from moe.oracle.slow_path import slow_buckets, slow_path


def _problem(quant: str, **kw) -> MoEProblem:
    sizes = dict(num_experts=8, top_k=2, hidden_size=256, intermediate_size=128, max_tokens=64)
    return MoEProblem.create(**{**sizes, **kw}, quant=quant)


def test_mxfp8_on_h100_is_a_slow_path_with_every_reason_and_the_way_out():
    result = plan(_problem("mxfp8"), Platform.preset("h100"), Policy())
    found = slow_path(result)
    assert found is not None and found.scheme == "mxfp8" and found.device == "h100"
    assert found.buckets == tuple((b.low, b.high) for b in result.buckets)
    refused = dict(found.refusals)
    assert "needs SM100" in "; ".join(refused["flashinfer_trtllm"])
    assert "mxfp8×mxfp8" in "; ".join(refused["triton"])
    assert "b200" in found.other_platforms and "h200" not in found.other_platforms
    assert {"bf16", "fp8_block", "nvfp4"} <= set(found.other_schemes)  # nvfp4: Triton weight-only
    text = found.message()
    assert "no kernel serves mxfp8 on h100" in text and "flashinfer_cutlass:" in text
    assert "quant=bf16 or" in text and "mxfp8 on b200" in text


def test_mxfp8_on_a100_offers_the_weight_only_schemes():
    found = slow_path(plan(_problem("mxfp8"), Platform.preset("a100"), Policy()))
    assert found is not None and "h100" not in found.other_platforms  # no kernel serves mxfp8 on SM90 either
    assert {"fp8", "fp8_block", "nvfp4", "mxfp4"} <= set(found.other_schemes)


@pytest.mark.parametrize("quant,platform", [("nvfp4", "h100"), ("nvfp4", "h200"), ("nvfp4", "a100"),
                                            ("fp8", "a100"), ("fp8_token", "a100"), ("fp8_block", "a100")])
def test_weight_only_triton_serves_where_the_reference_did(quant, platform):
    """Issue 14: no Python reference on any GPU for these: Triton's weight-only modes serve every bucket."""
    result = plan(_problem(quant), Platform.preset(platform), Policy())
    assert slow_path(result) is None
    assert {b.chosen.pair.experts for b in result.buckets} == {"triton"}


@pytest.mark.parametrize("quant,platform", [("bf16", "h100"), ("nvfp4", "b200"), ("nvfp4", "cpu")])
def test_no_slow_path_where_a_kernel_serves_or_on_a_cpu(quant, platform):
    result = plan(_problem(quant), Platform.preset(platform), Policy())
    assert slow_path(result) is None and slow_buckets(result) == ()


def test_the_layer_warns_once_for_many_equal_layers():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):  # one model, three equal layers: one warning
            FusedMoE(8, 2, 256, 128, quant="mxfp8", max_tokens=64, platform=Platform.preset("h100"))
    slow = [w for w in caught if issubclass(w.category, SlowPathWarning)]
    assert len(slow) == 1
    assert "no kernel serves mxfp8 on h100" in str(slow[0].message)


def test_a_layer_that_forces_the_reference_is_not_warned():
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowPathWarning)
        layer = FusedMoE(8, 2, 256, 128, quant="mxfp8", max_tokens=64, platform=Platform.preset("h100"),
                         experts="reference")
    assert layer.kernel.experts.name == "reference"


def test_a_layer_on_a_gpu_with_a_kernel_is_not_warned():
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowPathWarning)
        FusedMoE(8, 2, 256, 128, quant="bf16", dtype=torch.bfloat16, max_tokens=64, platform=Platform.preset("h100"))


def test_plan_cli_marks_slow_buckets(capsys):
    main(["plan", "--platform", "a100", "--preset", "deepseek-v3-ep8-slice", "--quant", "mxfp8",
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
    main(["plan", "--platform", "h100", "--preset", "gpt-oss-120b", "--quant", "mxfp8", "--tokens", "1", "64",
          "--json"])
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
