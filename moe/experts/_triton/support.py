"""What the two Triton experts share: capability data, checks, config keys, activation quantization."""

from __future__ import annotations

import torch

from moe.activation import ActivationKind
from moe.errors import MoEConfigError
from moe.experts._triton.config import ConfigKey
from moe.experts.base import ALL_DTYPES
from moe.experts._triton.rows import RowValidity, fp8_scale_shape, quantize_fp8_rows
from moe.platform import TRITON_INTERPRETER, Platform
from moe.problem import MoEProblem
from moe.quant import QuantFormat, QuantizedTensor

_F = QuantFormat
QUANT_PAIRS = frozenset(
    {
        (_F.NONE, _F.NONE),
        (_F.FP8_TENSOR, _F.FP8_TENSOR),
        (_F.FP8_ROW, _F.FP8_ROW),
        (_F.FP8_BLOCK, _F.FP8_BLOCK),
        (_F.MXFP4, _F.NONE),
    }
)
ACTIVATIONS = frozenset(ActivationKind)
# CUDA; the CPU only in Triton's interpreter, which the platform reports (extra_reasons says so)
DEVICES = frozenset({"cuda", "cpu"})
DTYPES = ALL_DTYPES
# what both Triton backends declare alike; each adds its format, output kind and who quantizes
COMMON_CAPABILITIES = dict(
    quant=QUANT_PAIRS,
    activations=ACTIVATIONS,
    dtypes=DTYPES,
    devices=DEVICES,
    min_capability=(8, 0),
    libraries=("triton",),
    cuda_graph_safe=True,
    deterministic=True,  # atomics only order rows inside a tile; each row's sums are fixed
)
FP8_MIN_CAPABILITY = (8, 9)  # e4m3 tensor-core instructions (Ada, Hopper and newer)


def platform_reasons(platform: Platform) -> list[str]:
    """The platform half the capability data cannot say: a CPU runs Triton only in its interpreter."""
    if platform.device == "cpu" and not platform.has_feature(TRITON_INTERPRETER):
        return ["runs on a CPU only in Triton's interpreter (TRITON_INTERPRET=1), which is for tests"]
    return []


def extra_reasons(problem: MoEProblem, platform: Platform | None) -> list[str]:
    """What the capability data cannot say about a problem: fp8 needs SM89+; the interpreter's dtypes."""
    reasons = []
    if platform is not None and platform.device == "cpu" and platform.has_feature(TRITON_INTERPRETER):
        if problem.dtype == torch.bfloat16:
            # triton 3.9's interpreter: errors of 1e11 on a plain bfloat16 matmul
            reasons.append("Triton's CPU interpreter computes bfloat16 wrongly; use float16 or float32 on a CPU")
    fp8 = problem.quant.weight in (_F.FP8_TENSOR, _F.FP8_ROW, _F.FP8_BLOCK)
    if fp8 and platform is not None and platform.is_cuda and platform.capability is not None:
        if not platform.capability_at_least(*FP8_MIN_CAPABILITY):
            major, minor = platform.capability
            reasons.append(
                f"fp8 ({problem.quant.name}) needs SM89 or newer for e4m3 tensor cores "
                f"(got SM{major}{minor}); use bf16 or mxfp4 weights"
            )
    return reasons


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def config_key(problem: MoEProblem, fmt: str, device: torch.device) -> ConfigKey:
    return ConfigKey(
        num_experts=problem.local_num_experts,
        top_k=problem.top_k,
        hidden_size=problem.hidden_size,
        intermediate_size=problem.intermediate_size,
        activation=problem.activation.name,
        scheme=problem.quant_name,
        format=fmt,
        device=device_name(device),
    )


def quant_buffers(fmt: QuantFormat, prefix: str, rows: int, k: int) -> dict:
    """Workspace for quantizing ``[rows, k]`` activations to ``fmt`` (none for NONE)."""
    if fmt is QuantFormat.NONE:
        return {}
    return {
        f"{prefix}_q": ((rows, k), torch.float8_e4m3fn),
        f"{prefix}_scale": (fp8_scale_shape(fmt, rows, k), torch.float32),
        f"{prefix}_amax": ((1,), torch.float32),
    }


def quantize_activation(
    x: torch.Tensor, fmt: QuantFormat, prefix: str, workspace, validity: RowValidity
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x [rows, K]`` as the GEMM's A operand in ``fmt``: ``(data, scale)`` (no copy for NONE)."""
    if fmt is QuantFormat.NONE:
        return x, None
    rows = x.shape[0]
    q = workspace[f"{prefix}_q"][:rows]
    scale = workspace[f"{prefix}_scale"]
    scale = scale if scale.dim() == 0 else scale[:rows]
    quantize_fp8_rows(x, fmt, q, scale, workspace[f"{prefix}_amax"], validity)
    return q, scale


def flat_rows(t: torch.Tensor | None) -> torch.Tensor | None:
    """Batched ``[E, T, X]`` data or scales as ``[E*T, X]``; 0-dim scales and None unchanged."""
    if t is None or t.dim() == 0:
        return t
    return t.reshape(-1, t.shape[-1])


def check_input(x: QuantizedTensor, problem: MoEProblem) -> None:
    """The activations must be unquantized or already in the scheme's activation format."""
    if x.fmt not in (QuantFormat.NONE, problem.quant.activation):
        raise MoEConfigError(
            f"activations arrive as {x.fmt} but the scheme {problem.quant_name} uses "
            f"{problem.quant.activation} activations"
        )
