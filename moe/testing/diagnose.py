"""Hints for a numeric failure: which plausible mistake the wrong output is consistent with.

Only run after a comparison failed, so their cost does not matter. Each hint re-reads the same
output under one alternative hypothesis and reports it when that makes the output match:

- the other per-slot output kind (router weights applied twice, or never);
- another activation of the same shape (silu where gelu is declared, ...);
- NaN in the output: the workspace is poisoned with NaN, so an unwritten buffer that is read shows.
"""

from __future__ import annotations

import traceback
from dataclasses import replace

import torch

from moe.activation import Activation, ActivationKind
from moe.experts.reference import ReferenceExperts
from moe.formats import Dispatched, ExpertsOutput, OutputKind
from moe.kernel import ModularKernel
from moe.prepare_finalize import LocalPrepareFinalize
from moe.prepare_finalize.base import PrepareFinalize
from moe.problem import MoEProblem
from moe.router import TopK
from moe.weights import ExpertWeights
from moe.testing.tolerance import relative_error

_OTHER_PER_SLOT = {OutputKind.PER_SLOT: OutputKind.PER_SLOT_WEIGHTED, OutputKind.PER_SLOT_WEIGHTED: OutputKind.PER_SLOT}


def describe_exception(error: BaseException) -> str:
    """``TypeName: message (at file.py:123 in function)`` -- the innermost frame of the traceback."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f" (at {frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    return f"{type(error).__name__}: {error}{where}"


def within(out: torch.Tensor, ref: torch.Tensor, bound: float) -> bool:
    return out.shape == ref.shape and relative_error(out.float(), ref.float()) <= bound


def output_kind_hint(pf: PrepareFinalize, output: ExpertsOutput, dispatched: Dispatched, route: object,
                     topk: TopK, ref: torch.Tensor, bound: float) -> str | None:
    other = _OTHER_PER_SLOT.get(output.kind)
    if other is None:
        return None
    try:
        reread = pf.finalize(ExpertsOutput(other, output.out), dispatched, route, topk)
    except Exception:  # noqa: BLE001 -- a hint that cannot be computed is no hint
        return None
    if not within(reread, ref, bound):
        return None
    did = "applies the router weights itself" if other is OutputKind.PER_SLOT_WEIGHTED else "does not apply the router weights"
    return (f"hint: the output matches the reference when read as {other.value}: apply {did} but the "
            f"output is handed over as {output.kind.value}; declare output={other.value} (and return it)")


def activation_hint(problem: MoEProblem, hidden: torch.Tensor, topk: TopK, weights: ExpertWeights,
                    out: torch.Tensor, bound: float) -> str | None:
    gated = problem.activation.is_gated
    for kind in ActivationKind:
        candidate = Activation.parse(kind)
        if kind is problem.activation.kind or candidate.is_gated != gated:
            continue
        other = replace(problem, activation=candidate)
        truth = ModularKernel(LocalPrepareFinalize(other), ReferenceExperts(other), device=hidden.device)
        truth.load(weights)
        if within(out, truth.forward(hidden, topk, validate=False), bound):
            return (f"hint: the output matches the reference computed with activation {kind.value} "
                    f"instead of the problem's {problem.activation.name}")
    return None


def nan_hint(out: torch.Tensor) -> str | None:
    if out.numel() and not bool(torch.isfinite(out).all()):
        return ("hint: the output holds NaN/inf. The workspace views are filled with NaN (0xFF bytes) "
                "before apply, so a buffer read before it is written (an accumulator never zeroed, rows "
                "past the valid ones) shows up this way")
    return None
