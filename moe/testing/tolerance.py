"""Tolerance checks for comparing a backend's output with ``reference``.

The regimes themselves (``TOLERANCES``, ``regime_for``, ``tolerance_for``, ``relative_error``) and
the table that justifies each bound live in `moe.tolerance`, which the product's demo uses too; they
are re-exported here so the kit reads as one place.
"""

from __future__ import annotations

import torch

from moe.tolerance import TOLERANCES, Tolerance, regime_for, relative_error, tolerance_for

__all__ = ["TOLERANCES", "Tolerance", "assert_close_moe", "regime_for", "relative_error", "tolerance_for"]


def assert_close_moe(out: torch.Tensor, ref: torch.Tensor, regime: "str | Tolerance", *, context: str = "") -> None:
    """Fails with the error, the bound and the context when ``out`` is not within ``regime`` (a name of
    ``TOLERANCES``, or a problem's ``tolerance_for``) of ``ref``."""
    if isinstance(regime, str):
        if regime not in TOLERANCES:
            raise ValueError(f"regime must be one of {sorted(TOLERANCES)} (got {regime!r})")
        regime = Tolerance(regime, TOLERANCES[regime])
    where = f" [{context}]" if context else ""
    assert out.shape == ref.shape, f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}{where}"
    err = relative_error(out, ref)
    assert err <= regime.bound, (
        f"relative error {err:.3e} exceeds the {regime}{where}; "
        f"max abs diff {(out.double() - ref.double()).abs().max().item() if out.numel() else 0:.3e}"
    )
