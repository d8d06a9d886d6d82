"""The conformance kit as pytest cases: one line in a test file.

    # test_my_experts.py
    from moe.testing.pytest_plugin import experts_conformance
    from my_package.experts import MyExperts

    test_my_experts = experts_conformance(MyExperts)

That defines one parametrized test with a case per generated problem (ids like
``standard-bf16-silu-E6-k2-H40-I24-+bias``) plus one per exclusion; a case this machine cannot run
is skipped with the class's own ``check`` reasons, a broken one fails with the kit's message.
``prepare_finalize_conformance(MyPrepareFinalize)`` does the same for a prepare/finalize.

The case set is ``cases="quick"`` unless given, or unless ``MOE_CONFORMANCE=full`` is set. Installed
as a pytest plugin (the ``pytest11`` entry point ``moe = "moe.testing.pytest_plugin"``) this module
also adds ``pytest --moe-conformance=full`` and the fixture ``moe_conformance`` (a function that
runs ``check_experts`` or ``check_prepare_finalize`` on a class and fails the test on any failure).

Only ``pytest`` and ``os`` are imported at module level: as a plugin this loads in every pytest run
of the environment, and `moe` (with torch) is imported when a test asks for it.
"""

from __future__ import annotations

import os

import pytest

ENV = "MOE_CONFORMANCE"  # "quick" or "full"


def _mode(cases: str | None) -> str:
    return cases or os.environ.get(ENV) or "quick"


def experts_conformance(experts_cls, *, cases: str | None = None, platform=None):
    """A parametrized pytest test running ``experts_cls`` through the kit, one case per test item."""
    from moe.testing.cases import exclusion_cases, experts_cases
    from moe.testing.conformance import experts_declaration_problems, run_exclusion_case
    from moe.testing.experts_run import run_experts_case

    mode = _mode(cases)
    declaration = experts_declaration_problems(experts_cls)
    if declaration:  # no cases can be generated: one test that reports why
        params = [pytest.param(None, id="declaration")]
    else:
        cap = experts_cls.capabilities
        params = [pytest.param(c, id=c.id) for c in exclusion_cases(cap, mode)]
        params += [pytest.param(c, id=c.id) for c in experts_cases(cap, mode)]

    @pytest.mark.parametrize("conformance_case", params)
    def test(conformance_case):
        if conformance_case is None:
            pytest.fail("\n".join(["the declaration of " + experts_cls.__name__ + " is broken:"] + declaration),
                        pytrace=False)
        if hasattr(conformance_case, "excluded"):
            result = run_exclusion_case(experts_cls, conformance_case)
        else:
            result = run_experts_case(experts_cls, conformance_case, platform)
        _conclude(conformance_case.label, result)

    test.__name__ = f"test_{getattr(experts_cls, 'name', experts_cls.__name__)}_conformance"
    test.__doc__ = f"Conformance of {experts_cls.__module__}.{experts_cls.__qualname__} ({mode} cases)."
    return test


def prepare_finalize_conformance(pf_cls, *, cases: str | None = None, platform=None):
    """A parametrized pytest test running ``pf_cls`` through the kit, one case per test item."""
    from moe.testing.cases import prepare_finalize_cases
    from moe.testing.conformance import prepare_finalize_declaration_problems
    from moe.testing.pf_run import run_prepare_finalize_case

    declaration = prepare_finalize_declaration_problems(pf_cls)
    params = [pytest.param(None, id="declaration")] if declaration else [
        pytest.param(c, id=c.id) for c in prepare_finalize_cases(pf_cls.format, pf_cls.quant_formats, _mode(cases))
    ]

    @pytest.mark.parametrize("conformance_case", params)
    def test(conformance_case):
        if conformance_case is None:
            pytest.fail("\n".join([f"the declaration of {pf_cls.__name__} is broken:"] + declaration), pytrace=False)
        _conclude(conformance_case.label, run_prepare_finalize_case(pf_cls, conformance_case, platform))

    test.__name__ = f"test_{getattr(pf_cls, 'name', pf_cls.__name__)}_conformance"
    return test


def _conclude(label: str, result) -> None:
    if result.failures:
        pytest.fail("\n".join(str(f) for f in result.failures), pytrace=False)
    if result.skipped:
        pytest.skip(f"{label}: " + "; ".join(result.skipped))


# --- plugin hooks (active when registered through the pytest11 entry point) ----------------------
def pytest_addoption(parser):
    parser.addoption("--moe-conformance", choices=("quick", "full"), default=None,
                     help=f"case set of the moe conformance kit (default: ${ENV} or quick)")


def pytest_configure(config):
    mode = config.getoption("--moe-conformance", default=None)
    if mode:
        os.environ[ENV] = mode  # read when test modules call experts_conformance(), after this hook


@pytest.fixture
def moe_conformance():
    """``moe_conformance(MyExperts)`` runs the whole kit and fails the test with its report."""
    from moe.experts.base import Experts
    from moe.testing.conformance import check_experts, check_prepare_finalize

    def run(cls, platform=None, cases=None):
        check = check_experts if issubclass(cls, Experts) else check_prepare_finalize
        report = check(cls, platform=platform, cases=_mode(cases))
        if report.ran_nothing and not report.failures:
            pytest.skip(f"{cls.__name__} cannot run here: " + "; ".join(report.skip_reasons()))
        if not report.passed:
            pytest.fail(str(report), pytrace=False)
        return report

    return run
