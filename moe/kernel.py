"""ModularKernel: one PrepareFinalize composed with one Experts, checked when composed.

    dispatched, route = prepare(hidden, topk)
    out = finalize(experts.apply(dispatched, weights, workspace), dispatched, route, topk)

Every contract between the two halves -- activation format, who quantizes, who applies the router
weights and sums over k, the problem they were built for -- is checked in ``__init__`` and reported
all at once, never half-way through a forward.
"""

from __future__ import annotations

from typing import Any

import torch

from moe.errors import MoEConfigError
from moe.experts.base import Experts
from moe.formats import ActivationFormat, OutputKind
from moe.platform import Platform
from moe.prepare_finalize.base import PrepareFinalize
from moe.problem import MoEProblem
from moe.quant import QuantFormat
from moe.router import Router, TopK
from moe.workspace import Workspace, WorkspaceManager, WorkspaceShapes

_PREPARE, _EXPERTS = "prepare_finalize.", "experts."


def composition_problems(
    prepare_finalize: PrepareFinalize, experts: Experts, platform: Platform | None
) -> list[str]:
    """Every reason the two halves cannot work together on ``platform``; empty when they can.

    ``platform=None`` checks the declarations only (what the conformance kit asks of a format);
    a kernel that will run always passes its platform, so a backend that would compute wrongly or
    not at all there (Triton's CPU interpreter with bfloat16, a CUDA-only kernel on a CPU) is refused
    when it is composed.
    """
    pf, cap = prepare_finalize, experts.capabilities
    problems = []
    if pf.problem != experts.problem:
        problems.append("prepare/finalize and experts were built for different MoEProblems")
    if pf.format not in cap.formats:
        takes = ", ".join(sorted(f.value for f in cap.formats))
        problems.append(f"{pf.name} produces the {pf.format.value} format but {experts.name} takes {takes}")
    if pf.format is ActivationFormat.BATCHED and cap.output is OutputKind.REDUCED:
        problems.append(f"{experts.name} declares reduced output, which the batched format cannot carry")
    wanted = activation_quant(experts)
    if wanted is not QuantFormat.NONE and wanted not in pf.quant_formats:
        problems.append(f"{experts.name} wants {wanted.value} activations, which {pf.name} cannot produce")
    problems += [f"{pf.name}: {r}" for r in pf.check(pf.problem, platform)]
    if platform is not None:
        problems += [f"{experts.name} on {platform.name}: {r}" for r in experts.check(experts.problem, platform)]
    return problems


def activation_quant(experts: Experts) -> QuantFormat:
    """The format prepare must quantize activations to: none if the experts quantize themselves."""
    if experts.capabilities.quantizes_input:
        return QuantFormat.NONE
    return experts.problem.quant.activation


class ModularKernel:
    """``ModularKernel(LocalPrepareFinalize(p), TritonExperts(p), device="cuda")``.

    Composition is checked against ``platform``: the detected platform of ``device`` unless one is given
    (a simulated one, as the oracle passes the platform it planned for).
    """

    def __init__(
        self,
        prepare_finalize: PrepareFinalize,
        experts: Experts,
        *,
        device: torch.device | str = "cpu",
        platform: Platform | None = None,
    ):
        self.platform = Platform.detect(device) if platform is None else platform
        problems = composition_problems(prepare_finalize, experts, self.platform)
        if problems:
            raise MoEConfigError(
                f"cannot compose {prepare_finalize.name} with {experts.name}:\n"
                + "\n".join(f"  - {p}" for p in problems)
            )
        self.prepare_finalize = prepare_finalize
        self.experts = experts
        self.problem = experts.problem
        self.quantize_to = activation_quant(experts)
        self.workspace = WorkspaceManager(device)
        prepare_finalize.load(self.workspace.device)  # the load step: its tables on this device

    def __repr__(self) -> str:
        return f"ModularKernel({self.prepare_finalize.name} + {self.experts.name})"

    # --- workspace -----------------------------------------------------------------------------
    def workspace_shapes(self, num_tokens: int) -> WorkspaceShapes:
        pf = self.prepare_finalize
        experts = self.experts.workspace_shapes(pf.dispatch_shape(num_tokens))
        return WorkspaceShapes().merge(pf.workspace_shapes(num_tokens), _PREPARE).merge(experts, _EXPERTS)

    def workspace_bytes(self, max_tokens: int | None = None) -> int:
        """Exact bytes of workspace a forward of up to ``max_tokens`` tokens uses."""
        return self.workspace_shapes(self.problem.max_tokens if max_tokens is None else max_tokens).nbytes

    def reserve(self, max_tokens: int | None = None, *, lock: bool = False) -> int:
        """Reserves the workspace for the largest M up front; returns the bytes."""
        nbytes = self.workspace_bytes(max_tokens)
        self.workspace.reserve(nbytes)
        if lock:
            self.workspace.lock()
        return nbytes

    # --- forward ---------------------------------------------------------------------------------
    def forward(
        self,
        hidden: torch.Tensor,
        topk: TopK,
        weights: Any,
        *,
        validate: bool = True,
        shared_output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``hidden [M, H]`` routed by ``topk`` -> a new ``[M, H]`` tensor (+ ``shared_output [M, H]``,
        the shared experts' result, added inside finalize).

        ``weights`` are what ``experts.prepare_weights`` returned. ``validate`` also checks that every
        expert id is in range, which reads the ids on the host, and that the weights were prepared for
        this problem's sizes; pass False when the ids come from a Router (in range by construction) or
        inside a CUDA graph.
        """
        self._check_hidden(hidden, shared_output)
        self._check_topk(hidden, topk, validate)
        self.experts.check_prepared(weights, sizes=validate)  # raw ExpertWeights: says to prepare them
        shapes = self.workspace_shapes(hidden.shape[0])
        views = self.workspace.take(shapes, caller=repr(self))
        pf_space, experts_space = _split(views, _PREPARE), _split(views, _EXPERTS)
        dispatched, route = self.prepare_finalize.prepare(hidden, topk, self.quantize_to, pf_space)
        output = self.experts.apply(dispatched, weights, experts_space)
        return self.prepare_finalize.finalize(output, dispatched, route, topk, shared_output)

    __call__ = forward

    def routes_in_kernel(self, router: Router) -> bool:
        """True when the experts compute ``router``'s routing themselves from the logits: one rank,
        standard format, reduced output -- then ``forward_logits`` skips the Router and prepare."""
        cap = self.experts.capabilities
        return (
            router.routing in cap.routes_from_logits
            and self.prepare_finalize.format is ActivationFormat.STANDARD
            and not self.problem.parallel.enabled
            and cap.output is OutputKind.REDUCED
        )

    def forward_logits(
        self, hidden: torch.Tensor, router_logits: torch.Tensor, router: Router, weights: Any,
        *, shared_output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Like ``forward(hidden, router(router_logits), weights)``, with the routing fused into the
        experts' kernel where ``routes_in_kernel(router)``; the Router runs here otherwise."""
        if not self.routes_in_kernel(router):
            return self.forward(hidden, router(router_logits), weights, validate=False, shared_output=shared_output)
        self._check_hidden(hidden, shared_output)
        if tuple(router_logits.shape) != (hidden.shape[0], self.problem.num_experts):
            raise MoEConfigError(
                f"router_logits must be [M, num_experts] = [{hidden.shape[0]}, {self.problem.num_experts}] "
                f"(got {list(router_logits.shape)})"
            )
        views = self.workspace.take(self.workspace_shapes(hidden.shape[0]), caller=repr(self))
        output = self.experts.apply_router_logits(hidden, router_logits, router, weights, _split(views, _EXPERTS))
        return self.prepare_finalize.finalize_reduced(output.out, shared_output)

    def _check_hidden(self, hidden: torch.Tensor, shared_output: torch.Tensor | None) -> None:
        check_hidden(self.problem, self.workspace.device, hidden, shared_output)

    def _check_topk(self, hidden: torch.Tensor, topk: TopK, validate: bool) -> None:
        p = self.problem
        if not isinstance(topk, TopK):
            raise MoEConfigError(
                f"topk must be a moe.TopK(ids [M, k] int32, weights [M, k] float32), e.g. router(router_logits) "
                f"(got {type(topk).__name__})"
            )
        if tuple(topk.ids.shape) != (hidden.shape[0], p.top_k):
            raise MoEConfigError(
                f"topk.ids must be [M, top_k] = [{hidden.shape[0]}, {p.top_k}] (got {list(topk.ids.shape)}); "
                f"the kernel was built for {p.sizes}"
            )
        if topk.ids.device != hidden.device:
            raise MoEConfigError(f"topk is on {topk.ids.device} but hidden is on {hidden.device}")
        if validate and topk.ids.numel():
            low, high = int(topk.ids.min()), int(topk.ids.max())
            if low < 0 or high >= p.num_experts:
                raise MoEConfigError(
                    f"topk.ids must lie in [0, num_experts={p.num_experts}) (got values in [{low}, {high}])"
                )


def check_hidden(
    problem: MoEProblem,
    device: torch.device,
    hidden: torch.Tensor,
    shared_output: torch.Tensor | None = None,
    *,
    name: str = "hidden",
    owner: str = "kernel",
) -> None:
    """Raises `MoEConfigError` naming ``name`` unless ``hidden`` is ``[M, H]`` in the problem's dtype on
    ``device``'s type with M <= max_tokens, and ``shared_output`` (if given) is shaped, typed and placed
    like it. ``owner`` ("kernel", "layer") is what the messages say was built for the problem."""
    p, built = problem, f"the {owner} was built for"
    if not isinstance(hidden, torch.Tensor):
        raise MoEConfigError(
            f"{name} must be a torch.Tensor [M, {p.hidden_size}] of {p.dtype} (got {type(hidden).__name__})"
        )
    if hidden.dim() != 2 or hidden.shape[1] != p.hidden_size:
        raise MoEConfigError(
            f"{name} must be [M, {p.hidden_size}]: 2-D, the hidden size H last (got shape {list(hidden.shape)}); "
            f"{built} {p.sizes}"
        )
    if hidden.dtype != p.dtype:
        raise MoEConfigError(f"{name} must be {p.dtype}, the dtype {built} (got {hidden.dtype})")
    if hidden.device.type != torch.device(device).type:
        raise MoEConfigError(f"{name} is on {hidden.device} but {built} {device}")
    if hidden.shape[0] > p.max_tokens:
        raise MoEConfigError(
            f"{name} has M={hidden.shape[0]} tokens, which exceeds max_tokens={p.max_tokens} {built}; "
            f"build the {owner} with a larger max_tokens or split the batch"
        )
    if shared_output is None:
        return
    want = f"[{hidden.shape[0]}, {hidden.shape[1]}] {hidden.dtype} on {hidden.device}"
    if not isinstance(shared_output, torch.Tensor):
        raise MoEConfigError(f"shared_output must match {name}: {want} (got {type(shared_output).__name__})")
    if (shared_output.shape, shared_output.dtype, shared_output.device) != (hidden.shape, hidden.dtype, hidden.device):
        raise MoEConfigError(
            f"shared_output must match {name}: {want} "
            f"(got {list(shared_output.shape)} {shared_output.dtype} on {shared_output.device})"
        )


def _split(views: Workspace, prefix: str) -> Workspace:
    return Workspace({name[len(prefix) :]: t for name, t in views.items() if name.startswith(prefix)})
