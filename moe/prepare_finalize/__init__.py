"""How tokens reach the experts and come back. Importing this package registers the built-in classes."""

from moe.prepare_finalize.base import PrepareFinalize
from moe.prepare_finalize.batched import BatchedPrepareFinalize
from moe.prepare_finalize.local import LocalPrepareFinalize

__all__ = ["PrepareFinalize", "LocalPrepareFinalize", "BatchedPrepareFinalize"]
