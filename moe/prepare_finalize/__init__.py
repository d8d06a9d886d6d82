"""How tokens reach the experts and come back. Importing this package registers the built-in classes."""

from moe.prepare_finalize.base import PrepareFinalize
from moe.prepare_finalize.local import LocalPrepareFinalize  # isort: skip
from moe.prepare_finalize.batched import BatchedPrepareFinalize  # isort: skip
from moe.prepare_finalize.all_to_all import AllToAllPrepareFinalize, BatchedAllToAllPrepareFinalize  # isort: skip
from moe.prepare_finalize.flashinfer_a2a import FlashInferAllToAllPrepareFinalize  # isort: skip

__all__ = [
    "AllToAllPrepareFinalize",
    "BatchedAllToAllPrepareFinalize",
    "BatchedPrepareFinalize",
    "FlashInferAllToAllPrepareFinalize",
    "LocalPrepareFinalize",
    "PrepareFinalize",
]
