"""The conformance kit: prove that an Experts or PrepareFinalize class keeps every contract it declares.

    from moe.testing import check_experts
    report = check_experts(MyExperts)              # platform=Platform.detect(), cases="quick"
    print(report)
    report.assert_ok()                             # ConformanceError listing every failure

``check_experts`` reads the class's ``capabilities`` and nothing else, and checks, in order:

1. the declaration is consistent (known schemes and activations, no reduced output in the batched
   format, ...);
2. everything the declaration excludes, per mode, is refused: ``check`` gives reasons and construction
   raises ``UnsupportedError``; composing with an undeclared format fails; ``check`` refuses a GPU
   outside a mode's architectures;
3. every problem the modes declare (see ``moe.testing.cases``) at M = 0, 1 and odd sizes, with and
   without biases and expert maps where declared, against ``ModularKernel(LocalPrepareFinalize(p),
   ReferenceExperts(p))`` under the named tolerance regimes, inside a poisoned workspace of exactly
   the declared shapes; output kind, shape and placement as declared; determinism; and on CUDA no
   allocation outside the workspace, no host sync and CUDA-graph capture where declared safe. A
   declared problem that ``check`` refuses is a failure (``mode``).

Problems this platform cannot run (the class's own ``check`` reasons given the platform) are skipped,
with the reasons.
"""

from __future__ import annotations

import inspect

from moe.activation import ActivationKind
from moe.errors import MoEConfigError, UnsupportedError
from moe.experts.base import ALL_DTYPES, Capabilities, Experts, Mode
from moe.formats import ActivationFormat, OutputKind
from moe.compose import composition_problems
from moe.kernel import ModularKernel
from moe.platform import Platform
from moe.prepare_finalize.base import PrepareFinalize
from moe.quant import QuantFormat
from moe.testing.cases import ExclusionCase, check_mode, exclusion_cases, experts_cases, prepare_finalize_cases
from moe.testing.diagnose import describe_exception
from moe.testing.experts_run import PREPARE_FINALIZE_FOR, run_experts_case
from moe.testing.pf_run import run_prepare_finalize_case
from moe.testing.report import CaseResult, ConformanceReport, Failure

def check_experts(experts_cls: type[Experts], platform: Platform | None = None, cases: str = "quick") -> ConformanceReport:
    """Runs ``experts_cls`` through every problem its capabilities declare; returns the report."""
    platform = platform or Platform.detect()
    report = ConformanceReport(f"experts {getattr(experts_cls, 'name', experts_cls.__name__)}", platform.name,
                               check_mode(cases))
    declaration = experts_declaration_problems(experts_cls)
    report.failures += [Failure("declaration", experts_cls.__name__, message) for message in declaration]
    report.cases_run += 1
    if declaration:
        return report  # the cases come from the declaration: nothing sensible to generate
    for exclusion in exclusion_cases(experts_cls.capabilities, cases):
        report.add(exclusion.label, run_exclusion_case(experts_cls, exclusion), problem_case=False)
    for case in experts_cases(experts_cls.capabilities, cases):
        report.add(case.label, run_experts_case(experts_cls, case, platform))
    return report


def check_prepare_finalize(pf_cls: type[PrepareFinalize], platform: Platform | None = None,
                           cases: str = "quick") -> ConformanceReport:
    """Runs ``pf_cls`` with the reference experts (in every output kind its format carries) against
    ``local + reference``, for every scheme whose activations it can produce."""
    platform = platform or Platform.detect()
    report = ConformanceReport(f"prepare_finalize {getattr(pf_cls, 'name', pf_cls.__name__)}", platform.name,
                               check_mode(cases))
    declaration = prepare_finalize_declaration_problems(pf_cls)
    report.failures += [Failure("declaration", pf_cls.__name__, message) for message in declaration]
    report.cases_run += 1
    if declaration:
        return report
    for case in prepare_finalize_cases(pf_cls.format, pf_cls.quant_formats, cases):
        report.add(case.label, run_prepare_finalize_case(pf_cls, case, platform))
    return report


# --- the declaration -----------------------------------------------------------------------------
def experts_declaration_problems(cls: type) -> list[str]:
    """Everything wrong with the class's declaration itself, before any case is generated."""
    if not (inspect.isclass(cls) and issubclass(cls, Experts)):
        return [f"{cls!r} is not a subclass of moe.experts.base.Experts"]
    problems = _class_problems(cls)
    cap = getattr(cls, "capabilities", None)
    if not isinstance(cap, Capabilities):
        return problems + [f"`capabilities` must be a moe.experts.base.Capabilities (got {type(cap).__name__})"]
    return problems + _capability_problems(cap)


def _class_problems(cls: type) -> list[str]:
    """What both kinds of backend class need: to be concrete and to have a ``name``."""
    problems = []
    if inspect.isabstract(cls):
        problems.append(f"{cls.__name__} is abstract: implement {', '.join(sorted(cls.__abstractmethods__))}")
    if not isinstance(getattr(cls, "name", None), str) or not cls.name:
        problems.append("set the class attribute `name` (a non-empty str; the registry and the oracle use it)")
    return problems


def _capability_problems(cap: Capabilities) -> list[str]:
    problems = []
    if not cap.formats or any(f not in set(ActivationFormat) for f in cap.formats):
        problems.append(f"capabilities.formats must be a non-empty set of ActivationFormat (got {set(cap.formats)})")
    if not cap.modes:
        problems.append("capabilities.modes is empty: the class could serve nothing")
    for scheme, mode in cap.modes.items():
        problems += [f"capabilities.modes[{scheme.name!r}]: {p}" for p in _mode_problems(mode)]
    if not isinstance(cap.output, OutputKind):
        problems.append(f"capabilities.output must be an OutputKind (got {cap.output!r})")
    elif ActivationFormat.BATCHED in cap.formats and cap.output is OutputKind.REDUCED:
        problems.append("capabilities declare the batched format with output=reduced, which the batched format "
                        "cannot carry (it has no [M, H] rows); batched experts return per_slot or per_slot_weighted")
    if cap.max_tokens is not None and cap.max_tokens < 1:
        problems.append(f"capabilities.max_tokens must be None or >= 1 (got {cap.max_tokens})")
    return problems


def _mode_problems(mode: object) -> list[str]:
    if not isinstance(mode, Mode):
        return [f"must be a moe.experts.base.Mode (got {type(mode).__name__})"]
    problems = []
    for field, values, universe in (("activations", mode.activations, set(ActivationKind)),
                                    ("dtypes", mode.dtypes, ALL_DTYPES)):
        if not values:
            problems.append(f"{field} is empty: the mode could serve nothing")
        unknown = [v for v in values if v not in universe]
        if unknown:
            problems.append(f"{field} holds unknown values {unknown}; known: {sorted(map(str, universe))}")
    for field in ("h_align", "i_align", "i_align_nongated"):
        value = getattr(mode, field)
        if not (value is None and field == "i_align_nongated") and (not isinstance(value, int) or value < 1):
            problems.append(f"{field}={value!r} must be a positive int")
    return problems


def prepare_finalize_declaration_problems(cls: type) -> list[str]:
    if not (inspect.isclass(cls) and issubclass(cls, PrepareFinalize)):
        return [f"{cls!r} is not a subclass of moe.prepare_finalize.base.PrepareFinalize"]
    problems = _class_problems(cls)
    if not isinstance(getattr(cls, "format", None), ActivationFormat):
        problems.append(f"`format` must be an ActivationFormat (got {getattr(cls, 'format', None)!r})")
    quant_formats = getattr(cls, "quant_formats", None)
    if not isinstance(quant_formats, frozenset) or any(not isinstance(f, QuantFormat) for f in quant_formats):
        problems.append(f"`quant_formats` must be a frozenset of QuantFormat (got {quant_formats!r})")
    return problems


# --- what the declaration excludes -----------------------------------------------------------------
def run_exclusion_case(experts_cls: type[Experts], case: ExclusionCase) -> CaseResult:
    """``check`` must reject the problem (on the case's platform, if it names one) and construction
    must raise UnsupportedError (or, for a format case, composing with that format's prepare/finalize
    must raise MoEConfigError)."""
    result = CaseResult(runs=1)
    fail = lambda message: result.failures.append(Failure("exclusion", case.label, message, case.problem))  # noqa: E731
    if case.format is not None:
        return _format_exclusion(experts_cls, case, result, fail)
    try:
        reasons = experts_cls.check(case.problem, case.platform)
    except Exception as error:  # noqa: BLE001
        fail(f"check() raised {describe_exception(error)} instead of returning reasons")
        return result
    if not reasons:
        fail(f"check() returned no reasons for a problem with {case.excluded}, which the capabilities exclude")
    if case.platform is not None:
        return result  # construction checks the problem alone
    try:
        experts_cls(case.problem)
    except Exception as error:  # noqa: BLE001 -- the type of the error is what is checked
        if not isinstance(error, UnsupportedError):
            fail(f"construction raised {describe_exception(error)}; it must raise UnsupportedError")
    else:
        fail(f"construction succeeded for a problem with {case.excluded}, which the capabilities exclude; "
             "it must raise UnsupportedError with check()'s reasons")
    return result


def _format_exclusion(experts_cls, case: ExclusionCase, result: CaseResult, fail) -> CaseResult:
    if experts_cls.check(case.problem, None):
        result.runs = 0
        return result  # the base problem is not served at all: nothing to compose
    pf_cls = PREPARE_FINALIZE_FOR[case.format]
    pf = pf_cls(case.problem)
    # the declarations alone must refuse the format (on a CPU a CUDA-only class is refused for its
    # device too, which would hide a wrong format declaration)
    if not composition_problems(pf_cls, experts_cls, case.problem, None):
        fail(f"composing with {pf.name} ({case.format.value} format) passes the checks although the capabilities declare "
             f"formats {sorted(f.value for f in experts_cls.capabilities.formats)}")
        return result
    try:
        ModularKernel(pf, experts_cls(case.problem))
    except MoEConfigError:
        return result
    except Exception as error:  # noqa: BLE001
        fail(f"composing with {pf.name} raised {describe_exception(error)}; expected MoEConfigError")
        return result
    fail(f"composing with {pf.name} reported problems but ModularKernel raised nothing")
    return result

