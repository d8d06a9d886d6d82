"""Quantization formats and schemes, and quantize/dequantize in plain torch (CPU and GPU).

- scheme.py   `QuantFormat` (one tensor), `QuantScheme` (weight x activation pair), scheme names
- tensor.py   `QuantizedTensor`, `quantize(x, fmt, role)`, `dequantize(q, dtype)`,
              `quantize_activations(hidden, fmt)`, `row_layout(fmt, H, dtype)` -> `RowLayout`
- fp8.py      e4m3 with fp32 scales: per tensor / row / 128x128 block / 1x128 group
- fp4.py      e2m1 encode/decode and two-per-byte packing
- mx.py       e8m0 scale bytes, MXFP8, MXFP4 (32 elements per scale)
- nvfp4.py    NVFP4 (16 elements per e4m3 scale, fp32 global scale)

Each module's docstring states its rounding and scale conventions.
"""

from moe.quant.fp4 import decode_e2m1, encode_e2m1, pack_e2m1, unpack_e2m1
from moe.quant.fp8 import (
    dequantize_fp8_blockwise,
    dequantize_fp8_groupwise,
    dequantize_fp8_per_tensor,
    dequantize_fp8_rowwise,
    quantize_fp8_blockwise,
    quantize_fp8_groupwise,
    quantize_fp8_per_tensor,
    quantize_fp8_rowwise,
)
from moe.quant.mx import (
    dequantize_mxfp4,
    dequantize_mxfp8,
    e8m0_from_exponent,
    e8m0_to_float,
    mx_scale_bytes,
    quantize_mxfp4,
    quantize_mxfp8,
)
from moe.quant.nvfp4 import dequantize_nvfp4, nvfp4_global_scale, quantize_nvfp4
from moe.quant.scheme import SCHEME_NAMES, SCHEME_PAIRS, UNQUANTIZED, QuantFormat, QuantScheme
from moe.quant.tensor import QuantizedTensor, RowLayout, dequantize, quantize, quantize_activations, row_layout

__all__ = [
    "SCHEME_NAMES",
    "SCHEME_PAIRS",
    "UNQUANTIZED",
    "QuantFormat",
    "QuantScheme",
    "QuantizedTensor",
    "RowLayout",
    "decode_e2m1",
    "dequantize",
    "dequantize_fp8_blockwise",
    "dequantize_fp8_groupwise",
    "dequantize_fp8_per_tensor",
    "dequantize_fp8_rowwise",
    "dequantize_mxfp4",
    "dequantize_mxfp8",
    "dequantize_nvfp4",
    "e8m0_from_exponent",
    "e8m0_to_float",
    "encode_e2m1",
    "mx_scale_bytes",
    "nvfp4_global_scale",
    "pack_e2m1",
    "quantize",
    "quantize_activations",
    "quantize_fp8_blockwise",
    "quantize_fp8_groupwise",
    "quantize_fp8_per_tensor",
    "quantize_fp8_rowwise",
    "quantize_mxfp4",
    "quantize_mxfp8",
    "quantize_nvfp4",
    "row_layout",
    "unpack_e2m1",
]
