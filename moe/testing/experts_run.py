"""Runs one conformance case of an Experts class: every token count, every contract.

A case is a problem the class's modes declare served, so ``check(problem, None)`` refusing it is a
failure (``mode``: the declaration is wrong); only what the platform lacks skips it. Per case: construct, compose with the prepare/finalize of the case's format (``local`` for standard,
``batched`` for batched), prepare random weights; check ``workspace_shapes`` is monotone up to
``max_tokens`` (what ``ModularKernel.reserve`` relies on); then per token count M:

1. prepare, then ``apply`` inside a ``PoisonedWorkspace`` of exactly the declared shapes;
2. no write outside the declared buffers; the output has the declared kind and shape and lives in
   the workspace;
3. finalize and compare with ``ModularKernel(LocalPrepareFinalize(p), ReferenceExperts(p))`` under the
   problem's tolerance regime (hints on failure); a mode that runs weight-only on the platform is held
   to the weight-only reference instead (`moe.experts.reference.reference_for`).

Once more at the smallest M > 0 below ``max_tokens``, with the shapes declared for ``max_tokens``: a
kernel hands ``apply`` the views of M's token bucket, sized for its upper edge.

At the largest M: two more runs must agree bit for bit when ``deterministic``; on CUDA, no device
memory may be allocated outside the workspace, and when ``cuda_graph_safe`` no host sync may happen
and the call must capture into a CUDA graph and replay to the same result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moe.errors import MoEConfigError
from moe.experts.base import Experts
from moe.experts.reference import reference_for
from moe.formats import ActivationFormat, Dispatched, ExpertsOutput, OutputKind
from moe.kernel import ModularKernel
from moe.platform import Platform
from moe.prepare_finalize import BatchedPrepareFinalize, LocalPrepareFinalize
from moe.router import TopK
from moe.testing import cuda_checks, diagnose
from moe.testing.cases import Case
from moe.testing.inputs import random_inputs, random_weights, seeded_generator
from moe.testing.poison import PoisonedWorkspace
from moe.testing.report import CaseResult, Failure
from moe.testing.tolerance import relative_error, tolerance_for
from moe.workspace import WorkspaceManager

PREPARE_FINALIZE_FOR = {ActivationFormat.STANDARD: LocalPrepareFinalize, ActivationFormat.BATCHED: BatchedPrepareFinalize}


def device_reasons(platform: Platform) -> list[str]:
    """Why this process cannot run on ``platform`` (a simulated GPU on a machine without one)."""
    if platform.is_cuda and not torch.cuda.is_available():
        return [f"platform {platform.name} is simulated: this machine has no CUDA device to run on"]
    return []


@dataclass
class _Attempt:
    dispatched: Dispatched
    route: Any  # prepare's record of how the rows travelled, for finalize
    poisoned: PoisonedWorkspace
    output: Any = None


class ExpertsRun:
    """One case of one Experts class; ``run()`` fills ``self.result``."""

    def __init__(self, experts_cls: type[Experts], case: Case, platform: Platform):
        self.cls, self.case, self.platform = experts_cls, case, platform
        self.problem = case.problem
        self.device = torch.device(platform.device)
        self.tolerance = tolerance_for(self.problem)
        self.result = CaseResult()

    def fail(self, check: str, message: str, num_tokens: int | None = None) -> None:
        self.result.failures.append(
            Failure(check, self.case.label, message, self.problem, num_tokens, self.case.format)
        )

    # --- orchestration ---------------------------------------------------------------------------
    def run(self) -> CaseResult:
        refused = self.cls.check(self.problem, None)
        if refused:
            self.fail("mode", f"check() refuses a problem the capabilities' modes declare served: {'; '.join(refused)}; "
                      "declare each mode as the class serves it (alignment, activations, dtypes, bias, expert layout)")
            return self.result
        reasons = self.cls.check(self.problem, self.platform) + device_reasons(self.platform)
        if reasons:
            self.result.skipped = tuple(reasons)
            return self.result
        if not self._build():
            return self.result
        self._check_upper_bound()
        for m in self.case.token_counts:
            self._run_tokens(m)
        smaller = [m for m in self.case.token_counts if 0 < m < self.problem.max_tokens]
        if smaller and not self.result.failures:
            self._run_tokens(min(smaller), bucket=self.problem.max_tokens)
        largest = max(self.case.token_counts)
        if largest and not self.result.failures:
            self._repeat_contracts(largest)
        return self.result

    def _build(self) -> bool:
        p, gen = self.problem, seeded_generator(self.case.label, "weights")
        try:
            experts = self.cls(p)
        except Exception as error:  # noqa: BLE001 -- report, do not crash the whole run
            self.fail("construct", f"{self.cls.__name__}(problem) raised {diagnose.describe_exception(error)}")
            return False
        try:
            self.kernel = ModularKernel(PREPARE_FINALIZE_FOR[self.case.format](p), experts, device=self.device,
                                        platform=self.platform)
        except MoEConfigError as error:
            self.fail("compose", str(error))
            return False
        truth_cls = reference_for(self.cls, p, self.platform)
        self.truth = ModularKernel(LocalPrepareFinalize(p), truth_cls(p), device=self.device)
        weights = random_weights(p, gen, self.device)
        self.truth.load(weights)
        self.canonical = weights  # what the diagnoses load into reference kernels of nearby problems
        try:
            self.weights = experts.prepare_weights(weights)
        except Exception as error:  # noqa: BLE001
            self.fail("construct", f"prepare_weights raised {diagnose.describe_exception(error)}")
            return False
        return True

    # --- contracts -----------------------------------------------------------------------------
    def _check_upper_bound(self) -> None:
        """Shapes for any M fit in those for max_tokens: reserve(max_tokens) + lock() must hold."""
        kernel, top = self.kernel, self.problem.max_tokens
        largest = kernel.workspace_bytes(top)
        for m in self.case.token_counts:
            if kernel.workspace_bytes(m) > largest:
                self.fail("workspace", f"workspace_shapes for M={m} need {kernel.workspace_bytes(m)} bytes, more "
                          f"than the {largest} bytes for max_tokens={top}: a workspace reserved for max_tokens "
                          "and locked would not fit", m)
        self.result.runs += 1

    def _dispatch(self, hidden: torch.Tensor, topk: TopK, bucket: int | None = None) -> _Attempt:
        """Prepared inputs, and a poisoned workspace declared for M (or for ``bucket`` tokens)."""
        pf, m = self.kernel.prepare_finalize, hidden.shape[0]
        pf_space = WorkspaceManager(self.device).take(pf.workspace_shapes(m), caller=pf.name)
        dispatched, route = pf.prepare(hidden, topk, self.kernel.quantize_to, pf_space)
        shapes = self.kernel.experts.workspace_shapes(pf.dispatch_shape(m if bucket is None else bucket))
        return _Attempt(dispatched, route, PoisonedWorkspace(shapes, self.device))

    def _apply(self, attempt: _Attempt) -> Any:
        return self.kernel.experts.apply(attempt.dispatched, self.weights, attempt.poisoned.workspace)

    def _run_tokens(self, m: int, bucket: int | None = None) -> None:
        hidden, topk = random_inputs(self.problem, m, seeded_generator(self.case.label, m), self.device)
        ref = self.truth.forward(hidden, topk, validate=False)
        self.result.runs += 1
        views = "" if bucket is None else f" (in the views declared for {bucket} tokens, as a kernel's bucket gives them)"
        try:
            attempt = self._dispatch(hidden, topk, bucket)
            attempt.output = self._apply(attempt)
        except Exception as error:  # noqa: BLE001
            self.fail("apply", f"apply raised {diagnose.describe_exception(error)}{views}", m)
            return
        for violation in attempt.poisoned.violations():
            self.fail("workspace", f"apply wrote outside its declared workspace: {violation}{views}", m)
        problems = self._output_problems(attempt)
        for problem in problems:
            self.fail("output", problem + views, m)
        if not problems:
            self._compare(attempt, hidden, topk, ref)

    def _output_problems(self, attempt: _Attempt) -> list[str]:
        output, declared = attempt.output, self.cls.capabilities.output
        if not isinstance(output, ExpertsOutput):
            return [f"apply returned {type(output).__name__}, not an ExpertsOutput"]
        problems = []
        if output.kind is not declared:
            problems.append(f"apply returned {output.kind.value} output but the capabilities declare "
                            f"output={declared.value}; the oracle and ModularKernel's compose-time checks "
                            "read the declaration, so declare what apply returns")
        expected = expected_output_shape(self.problem, attempt.dispatched, declared)
        if tuple(output.out.shape) != expected:
            problems.append(f"ExpertsOutput.out has shape {list(output.out.shape)}; {declared.value} output in "
                            f"the {attempt.dispatched.format.value} format must be {list(expected)}")
        if not attempt.poisoned.holds(output.out):
            problems.append("ExpertsOutput.out is not a view inside one declared workspace buffer (apply allocated "
                            "it, or it reaches past its buffer); declare an output buffer in workspace_shapes and "
                            "fill a view of it")
        return problems

    def _compare(self, attempt: _Attempt, hidden: torch.Tensor, topk: TopK, ref: torch.Tensor) -> None:
        pf, m = self.kernel.prepare_finalize, hidden.shape[0]
        out = pf.finalize(attempt.output, attempt.dispatched, attempt.route, topk)
        err = relative_error(out.float(), ref.float())
        if err <= self.tolerance.bound:
            return
        message = f"output differs from the reference: relative error {err:.3e} exceeds the {self.tolerance}"
        hints = [
            diagnose.nan_hint(out),
            diagnose.output_kind_hint(pf, attempt.output, attempt.dispatched, attempt.route, topk, ref,
                                      self.tolerance.bound),
            diagnose.activation_hint(self.problem, hidden, topk, self.canonical, out, self.tolerance.bound),
        ]
        self.fail("numerics", "\n".join([message] + [h for h in hints if h]), m)

    # --- repeated runs at the largest M --------------------------------------------------------------
    def _repeat_contracts(self, m: int) -> None:
        hidden, topk = random_inputs(self.problem, m, seeded_generator(self.case.label, m), self.device)
        first, second = self._dispatch(hidden, topk), self._dispatch(hidden, topk)
        try:
            first.output = self._apply(first)
            on_cuda = self.device.type == "cuda"
            second.output = self._measured_apply(second, m) if on_cuda else self._apply(second)
            if self.cls.capabilities.deterministic:
                self._check_deterministic(self._final(first, topk), self._final(second, topk), m)
            if on_cuda and self.cls.capabilities.cuda_graph_safe:
                self._check_graph(second, topk, m)
        except Exception as error:  # noqa: BLE001
            self.fail("apply", f"a repeated apply raised {diagnose.describe_exception(error)}", m)

    def _final(self, attempt: _Attempt, topk: TopK) -> torch.Tensor:
        return self.kernel.prepare_finalize.finalize(attempt.output, attempt.dispatched, attempt.route, topk)

    def _check_deterministic(self, first: torch.Tensor, second: torch.Tensor, m: int) -> None:
        self.result.runs += 1
        if not torch.equal(first, second):
            diff = (first.double() - second.double()).abs().max().item()
            self.fail("determinism", f"two runs on the same input differ (max abs diff {diff:.3e}) but the "
                      "capabilities declare deterministic=True", m)

    def _measured_apply(self, attempt: _Attempt, m: int) -> Any:
        graph_safe = self.cls.capabilities.cuda_graph_safe
        output, allocated = cuda_checks.measure_allocations(lambda: self._apply(attempt), self.device)
        self.result.runs += 1
        if allocated.persistent > 0:
            self.fail("allocation", f"apply left {allocated.persistent} bytes of device memory allocated outside its "
                      "workspace (declare them in workspace_shapes)", m)
        if allocated.transient > 0:
            message = (f"apply allocated up to {allocated.transient} bytes of device memory outside its workspace "
                       "while it ran")
            if graph_safe:
                self.fail("allocation", message + "; a class declared cuda_graph_safe must take all its scratch "
                          "from workspace_shapes", m)
            else:
                self.result.notes.append(f"M={m}: {message} (allowed: not declared cuda_graph_safe)")
        if graph_safe:
            _, error = cuda_checks.host_syncs(lambda: self._apply(attempt))
            if error:
                self.fail("cuda_graph", f"apply synchronizes with the host ({error}) but the capabilities declare "
                          "cuda_graph_safe=True", m)
        return output

    def _check_graph(self, eager: _Attempt, topk: TopK, m: int) -> None:
        expected = self._final(eager, topk)
        self.result.runs += 1
        output, error = cuda_checks.capture_and_replay(lambda: self._apply(eager), eager.poisoned.refill)
        if error:
            self.fail("cuda_graph", f"apply cannot be captured in a CUDA graph ({error}) but the capabilities "
                      "declare cuda_graph_safe=True", m)
            return
        eager.output = output
        err = relative_error(self._final(eager, topk).float(), expected.float())
        if err > self.tolerance.bound:
            self.fail("cuda_graph", "replaying the captured CUDA graph gives another result than the eager call "
                      f"(relative error {err:.3e})", m)


def expected_output_shape(problem, dispatched: Dispatched, kind: OutputKind) -> tuple[int, ...]:
    """``reduced``: ``[M', H]``; per-slot: ``[M', k, H]``, or batched ``[E_local, T, H]``."""
    rows, hidden = dispatched.num_rows, problem.hidden_size
    if dispatched.format is ActivationFormat.BATCHED:
        return (problem.local_num_experts, rows, hidden)
    return (rows, hidden) if kind is OutputKind.REDUCED else (rows, problem.top_k, hidden)


def run_experts_case(experts_cls: type[Experts], case: Case, platform: Platform | None = None) -> CaseResult:
    """Runs one case (see the module docstring); the result lists failures with the M that showed them."""
    return ExpertsRun(experts_cls, case, platform or Platform.detect()).run()
