"""Runs one conformance case of a PrepareFinalize class, with the reference experts on the other side.

Per token count M: ``prepare`` inside a ``PoisonedWorkspace`` of exactly ``workspace_shapes(M)``; the
``Dispatched`` must have the class's format, the requested activation format and at most the rows that
``dispatch_shape(M)`` promised; the reference experts (in the case's output kind) run on it; ``finalize``
must return a new ``[M, H]`` tensor in the problem's dtype that matches
``ModularKernel(LocalPrepareFinalize(p), ReferenceExperts(p))`` under the tolerance regime, and no guard
byte of the workspace may change.
"""

from __future__ import annotations

import torch

from moe.errors import MoEConfigError
from moe.experts.reference import ReferenceExperts
from moe.formats import ActivationFormat, Dispatched
from moe.kernel import ModularKernel
from moe.platform import Platform
from moe.prepare_finalize import LocalPrepareFinalize
from moe.prepare_finalize.base import PrepareFinalize
from moe.router import TopK
from moe.testing import diagnose
from moe.testing.cases import Case
from moe.testing.experts_run import device_reasons
from moe.testing.inputs import random_inputs, random_weights, seeded_generator
from moe.testing.poison import PoisonedWorkspace
from moe.testing.reference_kinds import reference_experts_for
from moe.testing.report import CaseResult, Failure
from moe.testing.tolerance import relative_error, tolerance_for
from moe.workspace import WorkspaceManager


class PrepareFinalizeRun:
    """One case of one PrepareFinalize class; ``run()`` fills ``self.result``."""

    def __init__(self, pf_cls: type[PrepareFinalize], case: Case, platform: Platform):
        self.cls, self.case, self.platform = pf_cls, case, platform
        self.problem = case.problem
        self.device = torch.device(platform.device)
        self.result = CaseResult()

    def fail(self, check: str, message: str, num_tokens: int | None = None) -> None:
        self.result.failures.append(Failure(check, self.case.label, message, self.problem, num_tokens, self.case.format))

    def run(self) -> CaseResult:
        reasons = self.cls.check(self.problem, self.platform) + device_reasons(self.platform)
        if reasons:
            self.result.skipped = tuple(reasons)
            return self.result
        if not self._build():
            return self.result
        for m in self.case.token_counts:
            self.result.runs += 1
            try:
                self._run_tokens(m)
            except Exception as error:  # noqa: BLE001 -- report, do not crash the whole run
                self.fail("apply", f"prepare/finalize raised {diagnose.describe_exception(error)}", m)
        return self.result

    def _build(self) -> bool:
        p = self.problem
        try:
            pf = self.cls(p)
            self.kernel = ModularKernel(pf, reference_experts_for(self.case.output)(p), device=self.device,
                                        platform=self.platform)
        except MoEConfigError as error:
            self.fail("compose", str(error))
            return False
        except Exception as error:  # noqa: BLE001
            self.fail("construct", f"{self.cls.__name__}(problem) raised {diagnose.describe_exception(error)}")
            return False
        self.truth = ModularKernel(LocalPrepareFinalize(p), ReferenceExperts(p), device=self.device)
        weights = random_weights(p, seeded_generator(self.case.label), self.device)
        self.truth.load(weights)
        self.weights = self.kernel.experts.prepare_weights(weights)  # the reference twin runs by hand below
        return True

    def _run_tokens(self, m: int) -> None:
        pf, experts = self.kernel.prepare_finalize, self.kernel.experts
        hidden, topk = random_inputs(self.problem, m, seeded_generator(self.case.label, m), self.device)
        ref = self.truth.forward(hidden, topk, validate=False)
        poisoned = PoisonedWorkspace(pf.workspace_shapes(m), self.device)
        prepared = pf.prepare(hidden, topk, self.kernel.quantize_to, poisoned.workspace)
        problems = self._dispatched_problems(prepared, topk, m)
        for problem in problems:
            self.fail("dispatched", problem, m)
        if problems:
            return
        dispatched, route = prepared
        space = WorkspaceManager(self.device).take(experts.workspace_shapes(pf.dispatch_shape(m)))
        out = pf.finalize(experts.apply(dispatched, self.weights, space), dispatched, route, topk)
        for violation in poisoned.violations():
            self.fail("workspace", f"prepare/finalize wrote outside its declared workspace: {violation}", m)
        for problem in self._finalized_problems(out, hidden, poisoned, m):
            self.fail("output", problem, m)
        tolerance = tolerance_for(self.problem)
        err = relative_error(out.float(), ref.float()) if out.shape == ref.shape else float("inf")
        if err > tolerance.bound:
            message = (f"output differs from the reference: relative error {err:.3e} exceeds the {tolerance} "
                       f"(experts output {self.case.output.value})")
            self.fail("numerics", "\n".join(h for h in (message, diagnose.nan_hint(out)) if h), m)

    def _dispatched_problems(self, prepared: object, topk: TopK, m: int) -> list[str]:
        pf, want = self.kernel.prepare_finalize, self.kernel.quantize_to
        if not (isinstance(prepared, tuple) and len(prepared) == 2 and isinstance(prepared[0], Dispatched)):
            return [f"prepare returned {type(prepared).__name__}, not a (Dispatched, route) pair"]
        dispatched = prepared[0]
        problems = []
        if dispatched.format is not pf.format:
            problems.append(f"prepare returned the {dispatched.format.value} format but the class declares "
                            f"format={pf.format.value}")
        if dispatched.x.fmt is not want:
            problems.append(f"prepare returned {dispatched.x.fmt.value} activations; the experts asked for {want.value}")
        bound = pf.dispatch_shape(m).max_rows
        if dispatched.num_rows > bound:
            problems.append(f"prepare returned {dispatched.num_rows} rows but dispatch_shape({m}) promised at most {bound}")
        if dispatched.format is ActivationFormat.BATCHED:
            problems += _batched_problems(dispatched, self.problem.local_num_experts, m)
        return problems

    def _finalized_problems(self, out, hidden: torch.Tensor, poisoned: PoisonedWorkspace, m: int) -> list[str]:
        p = self.problem
        if not isinstance(out, torch.Tensor):
            return [f"finalize returned {type(out).__name__}, not a tensor"]
        problems = []
        if tuple(out.shape) != (m, p.hidden_size) or out.dtype != p.dtype:
            problems.append(f"finalize returned {list(out.shape)} {out.dtype}; expected [{m}, {p.hidden_size}] {p.dtype}")
        if poisoned.owns_storage_of(out) or (out.numel() and out.data_ptr() == hidden.data_ptr()):
            problems.append("finalize returned a view of its workspace or of hidden; it must return a new tensor "
                            "(the workspace is reused by the next call)")
        return problems


def _batched_problems(dispatched: Dispatched, local_experts: int, m: int) -> list[str]:
    problems = []
    counts, rows = dispatched.tokens_per_expert, dispatched.slot_rows
    if counts is None or tuple(counts.shape) != (local_experts,) or counts.dtype != torch.int32:
        got = None if counts is None else f"{list(counts.shape)} {counts.dtype}"
        problems.append(f"batched tokens_per_expert must be [{local_experts}] int32 (got {got})")
    if rows is None or tuple(rows.shape) != tuple(dispatched.topk.ids.shape) or rows.dtype != torch.int64:
        got = None if rows is None else f"{list(rows.shape)} {rows.dtype}"
        problems.append(f"batched slot_rows must be [{m}, k] int64 like topk.ids (got {got})")
    if tuple(dispatched.x.data.shape[:1]) != (local_experts,):
        problems.append(f"batched x must be [E_local={local_experts}, T, H] (got {list(dispatched.x.data.shape)})")
    return problems


def run_prepare_finalize_case(pf_cls: type[PrepareFinalize], case: Case, platform: Platform | None = None) -> CaseResult:
    """Runs one prepare/finalize case (see the module docstring)."""
    return PrepareFinalizeRun(pf_cls, case, platform or Platform.detect()).run()
