"""What the two Triton experts share: their modes, checks, config keys, activation quantization."""

from __future__ import annotations

import torch

from moe.errors import MoEConfigError
from moe.experts._triton.config import ConfigKey
from moe.experts.base import Archs, Mode
from moe.experts._triton.rows import RowValidity, fp8_scale_shape, quantize_fp8_rows
from moe.platform import TRITON_INTERPRETER, Platform
from moe.problem import MoEProblem
from moe.quant import QuantFormat, QuantizedTensor

# fp8 needs e4m3 tensor-core instructions (Ada, Hopper and newer); the rest runs from Ampere up
_FP8 = Mode(archs=Archs.from_sm(89), name="fp8",
            arch_reason="{name} ({scheme}) needs {archs} for e4m3 tensor cores (got {got}); use bf16 or mxfp4 weights")
_FP8_SCHEMES = ("fp8", "fp8_token", "fp8_block")
MODES = {**Mode(archs=Archs.from_sm(80)).serving("unquantized", "mxfp4"), **_FP8.serving(*_FP8_SCHEMES)}
# The standard-format experts also run weight-only (activations stay bf16/fp16, weights dequantized in
# registers): fp8 where the GPU has no fp8 tensor cores (SM8x before Ada, and Triton refuses e4m3 there),
# and NVFP4 everywhere (no e2m1 x e2m1 product in Triton); NVFP4's elements are split in groups of 32 as
# MXFP4's (weights.py), so H and I must be multiples of 32. The MX schemes with mxfp8 activations run
# weight-only everywhere too, so no GPU falls back to the reference for them: MXFP8 weights decoded in
# registers (e4m3 bits times their group's e8m0 scale), and W4A8 MXFP4 as W4A16 (the MXFP4 kernels with
# bf16/fp16 activations, more accurate than activations rounded to mxfp8).
_NO_FP8_TENSOR_CORES = Archs.exactly(80, 86, 87)
STANDARD_MODES = {
    **MODES,
    **Mode(archs=Archs.from_sm(80), weight_only=_NO_FP8_TENSOR_CORES).serving(*_FP8_SCHEMES),
    **Mode(archs=Archs.from_sm(80), weight_only=Archs(), h_align=32, i_align=32,
           name="triton (nvfp4 weight-only)").serving("nvfp4"),
    **Mode(archs=Archs.from_sm(80), weight_only=Archs(), name="triton (mxfp8 weight-only)").serving("mxfp8"),
    **Mode(archs=Archs.from_sm(80), weight_only=Archs(),
           name="triton (mxfp4 weight-only: activations unquantized)").serving("mxfp4_a_mxfp8"),
}
# what both Triton backends declare alike; each adds its modes, format, output kind and who quantizes.
# Devices: CUDA; the CPU only in Triton's interpreter, which the platform reports (platform_reasons says so)
COMMON_CAPABILITIES = dict(
    devices=frozenset({"cuda", "cpu"}),
    libraries=("triton",),
    cuda_graph_safe=True,
    deterministic=True,  # atomics only order rows inside a tile; each row's sums are fixed
)


def platform_reasons(platform: Platform) -> list[str]:
    """The platform half the capability data cannot say: a CPU runs Triton only in its interpreter."""
    if platform.device == "cpu" and not platform.has_feature(TRITON_INTERPRETER):
        return ["runs on a CPU only in Triton's interpreter (TRITON_INTERPRET=1), which is for tests"]
    return []


def extra_reasons(problem: MoEProblem, platform: Platform | None) -> list[str]:
    """What the capability data cannot say about a problem: the interpreter's dtypes."""
    if platform is not None and platform.device == "cpu" and platform.has_feature(TRITON_INTERPRETER):
        if problem.dtype == torch.bfloat16:
            # triton 3.9's interpreter: errors of 1e11 on a plain bfloat16 matmul
            return ["Triton's CPU interpreter computes bfloat16 wrongly; use float16 or float32 on a CPU"]
    return []


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def gpu_of(device: torch.device) -> Platform | None:
    """The GPU ``device`` is, as far as the modes ask (its compute capability); None off CUDA."""
    if device.type != "cuda":
        return None
    return Platform(name=torch.cuda.get_device_name(device), device="cuda",
                    capability=torch.cuda.get_device_capability(device))


def require_sm90(device: torch.device, flag: str) -> None:
    """Raises unless ``device`` is an SM90 GPU, for the ``flag=True`` tiles (wgmma, ws) that only Hopper's
    warpgroup MMA runs."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        where = device.type if device.type != "cuda" else "SM{}{}".format(*torch.cuda.get_device_capability(device))
        raise MoEConfigError(f"{flag}=True tiles run on SM90 GPUs (Hopper: warpgroup MMA), not on {where}; "
                             f"use a config without {flag} here")


def config_key(problem: MoEProblem, fmt: str, device: torch.device) -> ConfigKey:
    """The key of ``problem``'s launch-config table on ``device``. A standard-format weight-only run whose
    kernels are another scheme's (W4A8 mxfp4 runs as W4A16: `MoEProblem.scheme_run_as`)
    shares that scheme's tables, tuned or packaged."""
    scheme = problem.scheme_run_as(activation_format(problem, gpu_of(device))) if fmt == "standard" \
        else problem.quant_name
    return ConfigKey(
        num_experts=problem.local_num_experts,
        top_k=problem.top_k,
        hidden_size=problem.hidden_size,
        intermediate_size=problem.intermediate_size,
        activation=problem.activation.name,
        scheme=scheme,
        format=fmt,
        device=device_name(device),
    )


def activation_format(problem: MoEProblem, platform: Platform | None) -> QuantFormat:
    """The format the standard-format GEMMs read activations in for ``problem`` on ``platform``
    (`Mode.activation_format`: NONE where the mode runs weight-only)."""
    return STANDARD_MODES[problem.quant].activation_format(problem.quant, platform)


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
