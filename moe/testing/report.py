"""What a conformance run returns: every failure with the case that produced it, readable as text.

    report = check_experts(MyExperts)
    print(report)          # a summary line, then one block per failure
    report.assert_ok()     # raises ConformanceError (an AssertionError) listing the failures

Each ``Failure`` names the contract it broke (``check``), the case (``problem``, ``num_tokens`` = M,
``format``) and a message that says what was expected and what happened.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from moe.formats import ActivationFormat
from moe.problem import MoEProblem

_NUMBER = re.compile(r"[-+]?\d+(\.\d+)?(e[-+]?\d+)?")
# the contracts a failure can name, in the order a report lists them
CHECKS = (
    "declaration",  # the capabilities record itself is inconsistent
    "exclusion",  # something the declaration excludes is not refused
    "construct",  # construction or prepare_weights raised on a declared problem
    "compose",  # ModularKernel refused the pair
    "workspace",  # writes outside the declared buffers, or shapes that are no upper bound
    "output",  # ExpertsOutput kind, shape or placement differs from the declaration
    "dispatched",  # prepare's Dispatched breaks its contract (prepare/finalize checks)
    "apply",  # apply (or prepare/finalize) raised
    "numerics",  # the result is not within the tolerance regime of the reference
    "determinism",  # declared deterministic, two runs differ
    "allocation",  # allocated device memory outside the workspace (CUDA)
    "cuda_graph",  # declared CUDA-graph safe, but syncs with the host or fails capture (CUDA)
)


@dataclass(frozen=True)
class Failure:
    """One broken contract, with the case that showed it."""

    check: str  # one of CHECKS
    case: str  # the case's label, e.g. "standard bf16 silu E=6 k=2 H=40 I=24 +bias"
    message: str
    problem: MoEProblem | None = None
    num_tokens: int | None = None  # M; None for checks that run no tokens
    format: ActivationFormat | None = None

    def __str__(self) -> str:
        where = self.case + (f", M={self.num_tokens}" if self.num_tokens is not None else "")
        body = self.message.replace("\n", "\n    ")
        return f"[{self.check}] {where}\n    {body}"


@dataclass
class CaseResult:
    """What running one case gave: its failures, how many runs it made, and why it was skipped."""

    failures: list[Failure] = field(default_factory=list)
    runs: int = 0
    skipped: tuple[str, ...] = ()  # reasons the case could not run here (check() said so)
    notes: list[str] = field(default_factory=list)


class ConformanceError(AssertionError):
    """Raised by ``ConformanceReport.assert_ok``; its message is the whole report."""


@dataclass
class ConformanceReport:
    """The result of ``check_experts`` / ``check_prepare_finalize``.

    ``cases_run`` counts runs (one problem at one M, or one contract check), ``cases_ran`` the generated
    problems that ran at all; ``skipped`` lists the
    cases this platform cannot run with the class's own reasons; ``notes`` are observations that
    break no declared contract (e.g. transient allocations of a class not declared CUDA-graph safe).
    """

    subject: str  # "experts torch_grouped" / "prepare_finalize local"
    platform: str
    mode: str
    failures: list[Failure] = field(default_factory=list)
    cases_run: int = 0
    cases_ran: int = 0  # generated problems that ran (not skipped) at one M or more
    skipped: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """No failure, and at least one problem ran (a class that cannot run here proves nothing)."""
        return not self.failures and self.cases_ran > 0

    @property
    def ran_nothing(self) -> bool:
        """True when every generated problem was skipped on this platform (see ``skipped``)."""
        return self.cases_ran == 0

    def skip_reasons(self) -> list[str]:
        """The reasons every skipped case shares (e.g. "runs on ['cuda'], not cpu"), else all of them."""
        sets = [set(reasons) for _, reasons in self.skipped]
        if not sets:
            return []
        return sorted(set.intersection(*sets) or set.union(*sets))

    def add(self, label: str, result: CaseResult, *, problem_case: bool = True) -> None:
        """Folds one case's result in; ``problem_case=False`` for contract-only cases (exclusions)."""
        self.failures += result.failures
        self.cases_run += result.runs
        self.cases_ran += int(problem_case and not result.skipped)
        self.notes += [f"{label}: {note}" for note in result.notes]
        if result.skipped:
            self.skipped.append((label, result.skipped))

    def by_check(self, check: str) -> list[Failure]:
        return [f for f in self.failures if f.check == check]

    def assert_ok(self) -> "ConformanceReport":
        """Returns self when passed; raises ConformanceError with the whole report otherwise."""
        if not self.passed:
            raise ConformanceError(str(self))
        return self

    def __str__(self) -> str:
        verdict = "PASSED" if self.passed else ("FAILED" if self.failures else "NOTHING RAN")
        lines = [
            f"{self.subject} on {self.platform} ({self.mode}): {verdict} -- {self.cases_run} runs, "
            f"{len(self.failures)} failures; {self.cases_ran} problems ran, {len(self.skipped)} skipped"
            + (" (similar failures grouped; all are in .failures)" if self.failures else "")
        ]
        for i, (first, others) in enumerate(_grouped(self.failures), 1):
            lines.append(f"  {i}. {first}".replace("\n", "\n     "))
            if others:
                shown = "; ".join(_where(f) for f in others[:4]) + ("; ..." if len(others) > 4 else "")
                lines.append(f"     ... and {len(others)} more like it: {shown}")
        lines += _skipped_lines(self.skipped)
        lines += _note_lines(self.notes)
        return "\n".join(lines)


def _where(failure: Failure) -> str:
    return failure.case + (f", M={failure.num_tokens}" if failure.num_tokens is not None else "")


def _grouped(failures: list[Failure]) -> list[tuple[Failure, list[Failure]]]:
    """Failures of one check whose messages differ only in numbers, together, in CHECKS order: the
    same bug seen at every M and in every case reads as one entry."""
    groups: dict[tuple[str, str], list[Failure]] = {}
    for failure in failures:
        groups.setdefault((failure.check, _NUMBER.sub("#", failure.message)), []).append(failure)
    order = {name: i for i, name in enumerate(CHECKS)}
    ordered = sorted(groups.items(), key=lambda item: order.get(item[0][0], len(CHECKS)))
    return [(members[0], members[1:]) for _, members in ordered]


def _skipped_lines(skipped: list[tuple[str, tuple[str, ...]]]) -> list[str]:
    """Skipped cases grouped by their reasons, so 30 cases skipped for one reason take one line."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for label, reasons in skipped:
        groups.setdefault(reasons, []).append(label)
    lines = []
    for reasons, labels in groups.items():
        first = labels[0] + (f" (and {len(labels) - 1} more)" if len(labels) > 1 else "")
        lines.append(f"  skipped: {first}: {'; '.join(reasons)}")
    return lines


def _note_lines(notes: list[str]) -> list[str]:
    """Notes of one kind (equal up to their numbers, after the case label) together, largest first."""
    groups: dict[str, list[str]] = {}
    for note in notes:
        label, _, text = note.partition(": ")
        groups.setdefault(_NUMBER.sub("#", text), []).append(note)
    lines = []
    for members in groups.values():
        lines.append(f"  note: {members[0]}")
        if len(members) > 1:
            lines.append(f"     ... and {len(members) - 1} more like it")
    return lines
