"""Experts backends, one module per family. Importing this package registers the built-in ones.

Backends whose libraries are missing still register (their ``check`` says what is missing); their
modules import those libraries lazily, inside methods.
"""

# Registration order is the order of the support table: reference first, then by family.
from moe.experts.base import Capabilities, Experts, Mode
from moe.experts.reference import ReferenceExperts  # isort: skip
from moe.experts.torch_grouped import TorchGroupedExperts  # isort: skip
from moe.experts.triton import TritonExperts  # isort: skip
from moe.experts.triton_batched import TritonBatchedExperts  # isort: skip
from moe.experts.flashinfer_cutlass import FlashInferCutlassExperts  # isort: skip
from moe.experts.flashinfer_trtllm import FlashInferTrtllmExperts  # isort: skip
from moe.experts.flashinfer_cutedsl import FlashInferCuteDslBatchedExperts, FlashInferCuteDslExperts  # isort: skip

__all__ = [
    "Capabilities",
    "Experts",
    "FlashInferCuteDslBatchedExperts",
    "FlashInferCuteDslExperts",
    "FlashInferCutlassExperts",
    "FlashInferTrtllmExperts",
    "Mode",
    "ReferenceExperts",
    "TorchGroupedExperts",
    "TritonBatchedExperts",
    "TritonExperts",
]
