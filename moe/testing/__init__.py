"""Testing backends against ``reference``: the conformance kit and the named tolerance regimes.

- ``check_experts(MyExperts)`` / ``check_prepare_finalize(MyPrepareFinalize)``: run a class through every
  problem its declaration covers and every contract it must keep; return a ``ConformanceReport``.
- ``moe.testing.pytest_plugin.experts_conformance(MyExperts)``: the same as parametrized pytest cases.
- ``assert_close_moe`` / ``regime_for`` / ``tolerance_for`` / ``TOLERANCES``: the tolerance regimes (the
  table: ``moe/tolerance.py``).
- ``random_weights`` / ``random_inputs``: seeded inputs for a problem.
- ``python -m moe.tools.docs``: regenerates the support table of docs/writing-a-backend.md.
"""

from moe.testing.cases import Case, ExclusionCase, exclusion_cases, experts_cases, prepare_finalize_cases
from moe.testing.conformance import check_experts, check_prepare_finalize
from moe.testing.experts_run import run_experts_case
from moe.testing.inputs import random_inputs, random_weights, seeded_generator
from moe.testing.pf_run import run_prepare_finalize_case
from moe.testing.poison import PoisonedWorkspace
from moe.testing.report import CaseResult, ConformanceError, ConformanceReport, Failure
from moe.testing.tolerance import TOLERANCES, Tolerance, assert_close_moe, regime_for, relative_error, tolerance_for

__all__ = [
    "TOLERANCES",
    "Tolerance",
    "Case",
    "CaseResult",
    "ConformanceError",
    "ConformanceReport",
    "ExclusionCase",
    "Failure",
    "PoisonedWorkspace",
    "assert_close_moe",
    "check_experts",
    "check_prepare_finalize",
    "exclusion_cases",
    "experts_cases",
    "prepare_finalize_cases",
    "random_inputs",
    "random_weights",
    "regime_for",
    "tolerance_for",
    "relative_error",
    "run_experts_case",
    "run_prepare_finalize_case",
    "seeded_generator",
]
