"""`TopK`: the router's output, the experts each token goes to and their weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe.errors import MoEConfigError


@dataclass(frozen=True, eq=False)
class TopK:
    """The experts each token goes to, and with what weight: the router's output.

    Row ``m`` lists token m's experts, best first (ties: lower expert id first). Equality is
    identity (tensors have no single truth value).

    Example, M=2 tokens, E=4 experts, k=2, softmax routing with renormalize::

        logits  = [[2.0, 1.0, 0.0, 0.0],    ids     = [[0, 1],    weights = [[e/(e+1), 1/(e+1)],
                   [0.0, 0.0, 3.0, 0.0]]               [2, 0]]               [e^3/(e^3+1), 1/(e^3+1)]]

    (row 1: experts 0, 1 and 3 tie at 0.0, so the lower id, 0, takes the second slot).
    """

    ids: torch.Tensor  # int32 [M, k]: global expert ids in [0, E) (E..E+Z-1: zero experts, folded by FusedMoE)
    weights: torch.Tensor  # float32 [M, k]: router weight of each chosen expert

    def __post_init__(self):
        for name in ("ids", "weights"):
            if not isinstance(getattr(self, name), torch.Tensor):
                raise MoEConfigError(
                    f"TopK {name} must be a torch.Tensor [M, k] (got {type(getattr(self, name)).__name__}); "
                    "a Router builds a TopK from router logits"
                )
        if self.ids.dim() != 2 or self.ids.shape != self.weights.shape:
            raise MoEConfigError(
                f"TopK ids and weights must both be [M, k] with the same shape "
                f"(got ids {tuple(self.ids.shape)}, weights {tuple(self.weights.shape)})"
            )
        if self.ids.dtype != torch.int32 or self.weights.dtype != torch.float32:
            raise MoEConfigError(
                f"TopK ids must be torch.int32 and weights torch.float32 "
                f"(got ids {self.ids.dtype}, weights {self.weights.dtype})"
            )
        if self.ids.device != self.weights.device:
            raise MoEConfigError(
                f"TopK ids and weights must be on one device "
                f"(got {self.ids.device} and {self.weights.device})"
            )

    @property
    def num_tokens(self) -> int:
        """M."""
        return self.ids.shape[0]

    @property
    def top_k(self) -> int:
        """k."""
        return self.ids.shape[1]
