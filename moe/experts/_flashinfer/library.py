"""FlashInfer as a lazily imported library: the import, the MoE feature probe, activation mapping.

The feature probe answers "which FlashInfer MoE entry points does this installation have", without a
GPU: it imports Python modules only (no JIT build, no kernel load), or reads the source of those that
need the CUDA stack to import (``SOURCE_FEATURES``). CuTe-DSL entry points need
nvidia-cutlass-dsl (the ``cutlass`` module) on top; FlashInfer itself reports that with
``flashinfer.cute_dsl.is_cute_dsl_available()``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
from pathlib import Path
from typing import Any, Iterator

import torch

from moe.activation import Activation, ActivationKind
from moe.errors import UnsupportedError
from moe.platform import Platform
from moe.registry import LibrarySupport, register_library

INSTALL_HINT = "pip install --no-deps flashinfer-python==0.7.2.post1 apache-tvm-ffi (see the Makefile)"

# feature name -> (module, attribute). The names are what Mode.features and Platform ask for.
FEATURE_SOURCES = {
    "cutlass_fused_moe": ("flashinfer.fused_moe", "cutlass_fused_moe"),
    "cutlass_fused_moe_workspace_size": ("flashinfer.fused_moe", "cutlass_fused_moe_workspace_size"),
    "sm90_mixed_gemm_interleave": ("flashinfer.fused_moe", "interleave_moe_weights_for_sm90_mixed_gemm"),
    "trtllm_bf16_moe": ("flashinfer.fused_moe", "trtllm_bf16_moe"),
    "trtllm_bf16_routed_moe": ("flashinfer.fused_moe", "trtllm_bf16_routed_moe"),
    "trtllm_fp8_per_tensor_scale_moe": ("flashinfer.fused_moe", "trtllm_fp8_per_tensor_scale_moe"),
    "trtllm_fp8_per_tensor_scale_routed_moe": ("flashinfer.fused_moe", "trtllm_fp8_per_tensor_scale_routed_moe"),
    "trtllm_fp8_block_scale_moe": ("flashinfer.fused_moe", "trtllm_fp8_block_scale_moe"),
    "trtllm_fp8_block_scale_routed_moe": ("flashinfer.fused_moe", "trtllm_fp8_block_scale_routed_moe"),
    "trtllm_fp4_block_scale_moe": ("flashinfer.fused_moe", "trtllm_fp4_block_scale_moe"),
    "trtllm_fp4_block_scale_routed_moe": ("flashinfer.fused_moe", "trtllm_fp4_block_scale_routed_moe"),
    "autotune": ("flashinfer", "autotune"),
    "cute_dsl_moe_wrapper": ("flashinfer.fused_moe.cute_dsl", "CuteDslMoEWrapper"),
    "cute_dsl_bf16_moe_wrapper": ("flashinfer.fused_moe.cute_dsl", "CuteDslBf16MoEWrapper"),
    "grouped_gemm_nt_masked": ("flashinfer.gemm", "grouped_gemm_nt_masked"),
    "scaled_fp4_grouped_quantize": ("flashinfer", "scaled_fp4_grouped_quantize"),
    "silu_and_mul_scaled_nvfp4_experts_quantize": ("flashinfer", "silu_and_mul_scaled_nvfp4_experts_quantize"),
}
_NEEDS_CUTE_DSL = frozenset({"cute_dsl_moe_wrapper", "cute_dsl_bf16_moe_wrapper", "grouped_gemm_nt_masked"})
# Features of modules that import cuda-python when imported (``flashinfer.comm``), which a machine without the
# CUDA stack lacks: found by reading the installed package's source instead -- (file, the definition in it).
# FlashInfer 0.7.4 has no MoeAlltoAll (its expert-parallel all-to-alls moved to ``flashinfer.moe_ep``).
SOURCE_FEATURES = {
    "moe_alltoall": ("comm/trtllm_moe_alltoall.py", "class MoeAlltoAll"),
}
FEATURES = frozenset(FEATURE_SOURCES) | frozenset(SOURCE_FEATURES)  # every feature the probe can report


def flashinfer_module(name: str = "flashinfer.fused_moe") -> Any:
    """Imports a flashinfer module, or raises UnsupportedError saying how to install it."""
    try:
        return importlib.import_module(name)
    except ImportError as error:
        raise UnsupportedError(
            f"{name} cannot be imported ({error}); install FlashInfer: {INSTALL_HINT}"
        ) from error


def _cute_dsl_available() -> bool:
    try:
        availability = importlib.import_module("flashinfer.cute_dsl.availability")
    except ImportError:
        return False
    return bool(availability.is_cute_dsl_available())


def source_features(package: Path) -> frozenset[str]:
    """The names of ``SOURCE_FEATURES`` whose definition stands in the flashinfer package at ``package``."""
    found = set()
    for feature, (relative, definition) in SOURCE_FEATURES.items():
        path = package / relative
        if path.is_file() and definition in path.read_text(errors="replace"):
            found.add(feature)
    return frozenset(found)


@functools.lru_cache(maxsize=1)
def flashinfer_moe_features() -> frozenset[str]:
    """The names of ``FEATURES`` this installation provides; empty without flashinfer."""
    spec = importlib.util.find_spec("flashinfer")
    if spec is None:
        return frozenset()
    cute_dsl = _cute_dsl_available()
    found = set(source_features(Path(spec.origin).parent)) if spec.origin else set()
    for feature, (module_name, attribute) in FEATURE_SOURCES.items():
        if feature in _NEEDS_CUTE_DSL and not cute_dsl:
            continue
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if hasattr(module, attribute):
            found.add(feature)
    return frozenset(found)


# --- activations -------------------------------------------------------------------------------

# moe ActivationKind -> flashinfer ActivationType value (flashinfer/tllm_enums.py). Geglu is the exact
# (erf) GELU; GegluTanh is the tanh approximation and is not used. swiglu_oai is Swiglu plus the
# per-expert alpha/beta/limit tensors (the kernels' SwigluBias path).
ACTIVATION_TYPES = {
    ActivationKind.SILU: 3,  # Swiglu
    ActivationKind.GELU: 4,  # Geglu
    ActivationKind.SWIGLU_OAI: 3,  # Swiglu + alpha/beta/limit
    ActivationKind.RELU2: 6,  # Relu2 (non-gated)
}


def activation_type(activation: Activation) -> int:
    return ACTIVATION_TYPES[activation.kind]


def swiglu_parameters(activation: Activation, num_experts: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Per-expert float32 ``alpha``/``beta``/``limit`` tensors for swiglu_oai; empty otherwise.

    GPT-OSS: 1.702 / 1.0 / 7.0. DeepSeek-V4-style clamped SiLU: 1.0 / 0.0 / the model's limit. All three
    are always set together, so the kernel never mixes a parameter with a default.
    """
    if activation.kind is not ActivationKind.SWIGLU_OAI:
        return {}
    full = lambda value: torch.full((num_experts,), float(value), dtype=torch.float32, device=device)  # noqa: E731
    return {"alpha": full(activation.alpha), "beta": full(activation.beta), "limit": full(activation.limit)}


@contextlib.contextmanager
def autotuning(buckets: tuple[int, ...] | None = None) -> Iterator[None]:
    """FlashInfer's autotuner in tuning mode (profiling ``buckets`` token counts), for warm-up only."""
    flashinfer = flashinfer_module("flashinfer")
    with flashinfer.autotune(True, tuning_buckets=buckets):
        yield


# How a platform learns about FlashInfer: the probe above, and what a simulated GPU assumes -- FlashInfer
# 0.7.2 (the release the capability facts are for) provides every feature, CuTe-DSL entry points and
# MoeAlltoAll included.
register_library(LibrarySupport("flashinfer", probe=flashinfer_moe_features, assumed_features=FEATURES,
                                assumed_version="0.7.2.post1"))
