"""`row_layout` against real quantization: for every format, several H and dtypes, the columns and dtypes
it computes are those `quantize_activations` stores; where quantize refuses a row size, so does it."""

from __future__ import annotations

import pytest
import torch

from moe.errors import MoEConfigError
from moe.quant import QuantFormat, RowLayout, quantize_activations, row_layout

HIDDEN_SIZES = (16, 32, 100, 128, 200, 2880, 4096, 7168)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _layout_of(q) -> RowLayout:
    """What a real quantization stores per row, read off its tensors."""
    per_row = q.scale is not None and q.scale.dim() > 0
    batch_scale = q.global_scale is not None or (q.scale is not None and q.scale.dim() == 0)
    return RowLayout(q.data.shape[-1], q.data.dtype, q.scale.shape[-1] if per_row else 0,
                     q.scale.dtype if per_row else None, batch_scale)


@pytest.mark.parametrize("fmt", list(QuantFormat), ids=str)
@pytest.mark.parametrize("hidden_size", HIDDEN_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_layout_is_what_quantization_stores(fmt, hidden_size, dtype):
    hidden = torch.randn(3, hidden_size).to(dtype)
    if hidden_size % fmt.k_multiple:
        with pytest.raises(MoEConfigError, match=f"multiple of {fmt.k_multiple}"):
            quantize_activations(hidden, fmt)
        with pytest.raises(MoEConfigError, match=f"hidden_size: {fmt.value} .* multiple of {fmt.k_multiple} .*got "
                                                 f"{hidden_size}"):
            row_layout(fmt, hidden_size, dtype)
        return
    assert row_layout(fmt, hidden_size, dtype) == _layout_of(quantize_activations(hidden, fmt))


@pytest.mark.parametrize("fmt,row_scaled", [
    (QuantFormat.NONE, False), (QuantFormat.FP8_TENSOR, False), (QuantFormat.NVFP4, False),
    (QuantFormat.FP8_ROW, True), (QuantFormat.FP8_BLOCK, True), (QuantFormat.MXFP8, True), (QuantFormat.MXFP4, True),
])
def test_row_scaled_means_a_row_quantizes_alone(fmt, row_scaled):
    layout = row_layout(fmt, 256, torch.bfloat16)
    assert layout.row_scaled is row_scaled
    if row_scaled:  # quantizing one row alone gives its bytes within the batch
        batch = torch.randn(4, 256).to(torch.bfloat16)
        whole, alone = quantize_activations(batch, fmt), quantize_activations(batch[2:3], fmt)
        assert torch.equal(whole.data[2:3].view(torch.uint8), alone.data.view(torch.uint8))
        assert torch.equal(whole.scale[2:3].view(torch.uint8), alone.scale.view(torch.uint8))


def test_the_docstring_examples():
    assert row_layout(QuantFormat.FP8_BLOCK, 4096, torch.bfloat16) == RowLayout(
        4096, torch.float8_e4m3fn, 32, torch.float32, False)
    assert row_layout(QuantFormat.NVFP4, 4096, torch.bfloat16) == RowLayout(
        2048, torch.uint8, 256, torch.float8_e4m3fn, True)
    assert row_layout("fp8_tensor", 4096, torch.bfloat16).scale_columns == 0


@pytest.mark.parametrize("args,match", [
    ((QuantFormat.FP8_ROW, 0, torch.bfloat16), "hidden_size must be a positive int \\(got 0\\)"),
    ((QuantFormat.FP8_ROW, True, torch.bfloat16), "hidden_size must be a positive int \\(got True\\)"),
    ((QuantFormat.FP8_ROW, 128, torch.int32), "floating-point torch.dtype \\(got torch.int32\\)"),
    (("fp9", 128, torch.bfloat16), "'fp9' is not a QuantFormat"),
])
def test_row_layout_refuses_bad_input_naming_it(args, match):
    with pytest.raises(MoEConfigError, match=match):
        row_layout(*args)
