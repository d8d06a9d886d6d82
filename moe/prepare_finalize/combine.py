"""The weighted sum over k: the one rule by which per-slot expert outputs become a token's result.

    out[m] = sum over the valid slots j of weights[m, j] * per_slot[m, j]    (float32, j in order)

`sum_over_k` is the function form of vLLM's ``TopKWeightAndReduce``: it weights unless the experts
already did (`moe.formats.OutputKind`), selects away slots that are not valid -- experts of other
ranks, rows past an expert's count: they may hold garbage, even NaN, so they are never multiplied by
0 -- and sums in float32 with ``torch.sum`` over k, which adds in a fixed order (no atomics), so a
result is the same from run to run. Every finalize and every torch reference of a combine calls it.
"""

from __future__ import annotations

import torch

from moe.errors import MoEConfigError
from moe.formats import OutputKind


def sum_over_k(
    per_slot: torch.Tensor, weights: torch.Tensor, kind: OutputKind, valid: torch.Tensor | None = None,
    *, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``per_slot [M, k, H]`` (any float dtype), router ``weights [M, k]`` -> float32 ``[M, H]``.

    ``kind``: PER_SLOT weights each slot, PER_SLOT_WEIGHTED only sums (REDUCED output has no k to
    sum over). ``valid [M, k]`` bool: the slots that count (None: all). ``out``: a float32 ``[M, H]``
    to write into (e.g. a workspace view), returned; a new tensor otherwise.

    >>> sum_over_k(torch.ones(1, 2, 3), torch.tensor([[0.25, 0.5]]), OutputKind.PER_SLOT)
    tensor([[0.7500, 0.7500, 0.7500]])
    """
    if kind is OutputKind.PER_SLOT:
        values = per_slot.float() * weights.unsqueeze(-1)
    elif kind is OutputKind.PER_SLOT_WEIGHTED:
        values = per_slot.float()
    else:
        raise MoEConfigError(f"sum_over_k takes per-slot output, not {kind.value}: reduced output has no k left")
    if valid is not None:
        values = torch.where(valid.unsqueeze(-1), values, 0.0)
    return torch.sum(values, dim=1, dtype=torch.float32, out=out)
