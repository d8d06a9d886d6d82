"""Experts backends, one module per family. Importing this package registers the built-in ones.

Backends whose libraries are missing still register (their ``check`` says what is missing); their
modules import those libraries lazily, inside methods.
"""

from moe.experts.base import Capabilities, Experts
from moe.experts.reference import ReferenceExperts
from moe.experts.torch_grouped import TorchGroupedExperts

__all__ = ["Capabilities", "Experts", "ReferenceExperts", "TorchGroupedExperts"]
