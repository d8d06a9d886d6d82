"""QuantScheme / QuantFormat: names, round trips, reprs and errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe.errors import MoEConfigError
from moe.quant import SCHEME_NAMES, SCHEME_PAIRS, UNQUANTIZED, QuantFormat, QuantScheme

F = QuantFormat

# name -> (weight, activation, canonical name), written out by hand from the design
EXPECTED = {
    "bf16": (F.NONE, F.NONE, "unquantized"),
    "fp16": (F.NONE, F.NONE, "unquantized"),
    "fp32": (F.NONE, F.NONE, "unquantized"),
    "unquantized": (F.NONE, F.NONE, "unquantized"),
    "fp8": (F.FP8_TENSOR, F.FP8_TENSOR, "fp8"),
    "fp8_token": (F.FP8_ROW, F.FP8_ROW, "fp8_token"),
    "fp8_block": (F.FP8_BLOCK, F.FP8_BLOCK, "fp8_block"),
    "mxfp8": (F.MXFP8, F.MXFP8, "mxfp8"),
    "mxfp4": (F.MXFP4, F.NONE, "mxfp4"),
    "mxfp4_a_mxfp8": (F.MXFP4, F.MXFP8, "mxfp4_a_mxfp8"),
    "nvfp4": (F.NVFP4, F.NVFP4, "nvfp4"),
}


def test_scheme_names_are_exactly_the_table():
    assert set(SCHEME_NAMES) == set(EXPECTED)
    assert len(SCHEME_NAMES) == len(EXPECTED)


def test_scheme_pairs_are_the_distinct_pairs_of_the_table():
    assert {(w, a) for w, a, _ in EXPECTED.values()} == SCHEME_PAIRS
    assert len(SCHEME_PAIRS) == 8


@pytest.mark.parametrize("name", list(EXPECTED))
def test_from_name_formats_and_canonical_name(name):
    weight, activation, canonical = EXPECTED[name]
    scheme = QuantScheme.from_name(name)
    assert (scheme.weight, scheme.activation) == (weight, activation)
    assert scheme.name == canonical and str(scheme) == canonical
    assert QuantScheme.from_name(scheme.name) == scheme


@pytest.mark.parametrize("name", list(EXPECTED))
def test_repr_evaluates_back(name):
    scheme = QuantScheme.from_name(name)
    namespace = {"QuantScheme": QuantScheme, "QuantFormat": QuantFormat}
    assert eval(repr(scheme), namespace) == scheme


def test_repr_text():
    assert repr(QuantScheme.from_name("fp8")) == (
        "QuantScheme(weight=QuantFormat.FP8_TENSOR, activation=QuantFormat.FP8_TENSOR)"
    )
    assert repr(F.MXFP4) == "QuantFormat.MXFP4" and str(F.MXFP4) == "mxfp4"


def test_mxfp4_act_quant():
    w4a8 = QuantScheme.from_name("mxfp4", act_quant="mxfp8")
    assert (w4a8.weight, w4a8.activation) == (F.MXFP4, F.MXFP8)
    assert w4a8.name == "mxfp4_a_mxfp8"
    assert QuantScheme.from_name("mxfp4", act_quant=None).activation is F.NONE


def test_act_quant_rejected_elsewhere():
    with pytest.raises(
        MoEConfigError, match=r"act_quant: 'mxfp8' is not available for scheme 'fp8'"
    ):
        QuantScheme.from_name("fp8", act_quant="mxfp8")
    with pytest.raises(
        MoEConfigError, match=r"act_quant: 'fp8' is not available for scheme 'mxfp4'"
    ):
        QuantScheme.from_name("mxfp4", act_quant="fp8")


def test_unknown_name_lists_allowed_names():
    with pytest.raises(MoEConfigError, match="quant: unknown quantization scheme 'int4'") as info:
        QuantScheme.from_name("int4")
    for name in EXPECTED:
        assert name in str(info.value)
    with pytest.raises(MoEConfigError, match=r"scheme: unknown quantization scheme \['bf16'\]"):
        QuantScheme.from_name(["bf16"], argument="scheme")  # unhashable: the same error, not a TypeError


def test_a_layer_built_with_an_unknown_scheme_names_its_quant_argument():
    from moe import FusedMoE

    with pytest.raises(MoEConfigError, match="^quant: unknown quantization scheme 'int4'"):
        FusedMoE(num_experts=8, top_k=2, hidden_size=64, intermediate_size=128, quant="int4")


def test_is_quantized():
    assert not QuantScheme.from_name("bf16").is_quantized
    assert QuantScheme.from_name("mxfp4").is_quantized
    assert QuantScheme.from_name("fp8").is_quantized


def test_unquantized_dtypes():
    assert dict(UNQUANTIZED) == {
        "bf16": torch.bfloat16,
        "fp16": torch.float16,
        "fp32": torch.float32,
    }
    assert QuantScheme.unquantized_dtype("fp16") is torch.float16
    with pytest.raises(MoEConfigError, match="name: 'fp8' is not an unquantized dtype name"):
        QuantScheme.unquantized_dtype("fp8")


def test_constructor_converts_strings_and_rejects_unsupported_pairs():
    assert QuantScheme("mxfp4", "none") == QuantScheme.from_name("mxfp4")
    with pytest.raises(
        MoEConfigError, match=r"\(weight, activation\): \(nvfp4, fp8_row\) is not a supported"
    ):
        QuantScheme(F.NVFP4, F.FP8_ROW)
    with pytest.raises(MoEConfigError, match="weight: 'int8' is not a QuantFormat"):
        QuantScheme("int8", "none")


def test_frozen_and_replace():
    scheme = QuantScheme.from_name("mxfp4")
    with pytest.raises(dataclasses.FrozenInstanceError):
        scheme.weight = F.NVFP4  # type: ignore[misc]
    assert dataclasses.replace(scheme, activation=F.MXFP8).name == "mxfp4_a_mxfp8"


def test_format_k_multiples():
    expected = {
        F.NONE: 1,
        F.FP8_TENSOR: 1,
        F.FP8_ROW: 1,
        F.FP8_BLOCK: 1,
        F.MXFP8: 32,
        F.MXFP4: 32,
        F.NVFP4: 16,
    }
    assert {f: f.k_multiple for f in QuantFormat} == expected
    assert [f for f in QuantFormat if f.is_packed_fp4] == [F.MXFP4, F.NVFP4]


@pytest.mark.parametrize("name,want", [("mxfp4_a_mxfp8", "mxfp4"), ("mxfp4", None), ("nvfp4", None), ("mxfp8", None),
                                       ("fp8_block", None), ("unquantized", None)])
def test_the_scheme_a_weight_only_kernel_runs(name, want):
    """W4A8 mxfp4 run weight-only is W4A16 mxfp4; no other scheme's weights come with unquantized activations."""
    same = QuantScheme.from_name(name).with_unquantized_activations()
    assert (same.name if same else None) == want
