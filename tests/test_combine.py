"""`sum_over_k`, the one weighted sum over k behind every finalize and every torch twin of a combine."""

from __future__ import annotations

import pytest
import torch

from moe.errors import MoEConfigError
from moe.experts._triton.rows import combine_slots_reference
from moe.formats import OutputKind
from moe.prepare_finalize.combine import sum_over_k


def _slots(m=5, k=3, h=8, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(m * k * h)
    return torch.randn(m, k, h, generator=gen).to(dtype), torch.rand(m, k, generator=gen)


def test_per_slot_is_weighted_and_summed_in_float32():
    per_slot, weights = _slots()
    out = sum_over_k(per_slot, weights, OutputKind.PER_SLOT)
    assert out.dtype == torch.float32 and out.shape == (5, 8)
    want = per_slot.float()[:, 0] * weights[:, :1]
    for j in range(1, 3):  # k = 3: torch.sum adds the slots in order
        want = want + per_slot.float()[:, j] * weights[:, j : j + 1]
    assert torch.equal(out, want)


def test_already_weighted_slots_are_only_summed():
    per_slot, weights = _slots()
    assert torch.equal(sum_over_k(per_slot, weights, OutputKind.PER_SLOT_WEIGHTED), per_slot.float().sum(1))


def test_invalid_slots_are_selected_away_even_when_nan():
    per_slot, weights = _slots(dtype=torch.float32)
    valid = torch.tensor([[True, False, True]] * 5)
    garbage = per_slot.clone()
    garbage[:, 1] = float("nan")  # slots of other ranks may hold anything
    for kind in (OutputKind.PER_SLOT, OutputKind.PER_SLOT_WEIGHTED):
        out = sum_over_k(garbage, weights, kind, valid=valid)
        assert torch.isfinite(out).all()
        zeroed = per_slot.clone()
        zeroed[:, 1] = 0
        assert torch.equal(out, sum_over_k(zeroed, weights, kind))


def test_writes_into_the_given_buffer():
    per_slot, weights = _slots()
    buffer = torch.full((5, 8), float("nan"))
    assert sum_over_k(per_slot, weights, OutputKind.PER_SLOT, out=buffer) is buffer
    assert torch.equal(buffer, sum_over_k(per_slot, weights, OutputKind.PER_SLOT))


def test_zero_tokens():
    per_slot, weights = _slots(m=0)
    assert sum_over_k(per_slot, weights, OutputKind.PER_SLOT).shape == (0, 8)


def test_reduced_output_has_no_k_to_sum():
    per_slot, weights = _slots()
    with pytest.raises(MoEConfigError, match="takes per-slot output, not reduced"):
        sum_over_k(per_slot, weights, OutputKind.REDUCED)


def test_the_triton_twin_is_sum_over_k_of_the_slots_here():
    per_slot, weights = _slots(dtype=torch.float16)
    ids = torch.tensor([[0, 2, 1]] * 5, dtype=torch.int32)
    expert_map = torch.tensor([0, 1, -1], dtype=torch.int32)  # expert 2 lives elsewhere
    y = per_slot.reshape(15, 8).clone()
    y[1::3] = float("nan")
    twin = combine_slots_reference(y, weights, ids, expert_map)
    assert torch.equal(twin, sum_over_k(per_slot, weights, OutputKind.PER_SLOT, valid=ids != 2))
