"""Helpers for testing backends against ``reference``: named tolerance regimes and input builders."""

from moe.testing.tolerance import TOLERANCES, assert_close_moe, regime_for, relative_error

__all__ = ["TOLERANCES", "assert_close_moe", "regime_for", "relative_error"]
