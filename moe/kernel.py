"""ModularKernel: one PrepareFinalize composed with one Experts, checked when composed.

    kernel = ModularKernel(prepare_finalize, experts, device=...)   # every contract checked (moe.compose)
    kernel.load(weights)       # once: experts.prepare_weights, warmup, the workspace views of each bucket
    out = kernel(hidden, topk) # dispatched, route = prepare(hidden, topk); then
                               # finalize(experts.apply(dispatched, prepared, workspace), dispatched, route, topk)

Every contract between the two halves -- activation format, who quantizes, who applies the router
weights and sums over k, the problem they were built for -- is checked in ``__init__`` and reported
all at once, never half-way through a forward. Everything static is decided before the first call:
whether the experts route from the logits (``__init__``), and the workspace views of every token
bucket (``load``), so a forward only looks its bucket's views up.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any, Sequence

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false

from moe.compose import activation_quant, composition_problems
from moe.errors import MoEConfigError
from moe.experts.base import Experts
from moe.formats import ActivationFormat, ExpertsOutput, OutputKind
from moe.platform import Platform
from moe.prepare_finalize.base import PrepareFinalize
from moe.problem import MoEProblem
from moe.router import Router, TopK
from moe.shared import PendingShared, join, pending_tensor
from moe.weights import ExpertWeights
from moe.workspace import Workspace, WorkspaceLayout, WorkspaceManager

# the sections of a kernel's workspace: each half's buffers under its own names
_PREPARE, _EXPERTS = "prepare_finalize", "experts"
_UNLOADED = object()


class ModularKernel:
    """``ModularKernel(LocalPrepareFinalize(p), TritonExperts(p), device="cuda")``.

    Composition is checked against ``platform``: the detected platform of ``device`` unless one is given
    (a simulated one, as ``moe.build`` passes the platform the oracle planned for). ``workspace`` is the
    `WorkspaceManager` whose buffer the kernel takes its views from: one shared by kernels that never run
    at once (the members of a plan), or None for a manager of its own.
    """

    def __init__(
        self,
        prepare_finalize: PrepareFinalize,
        experts: Experts,
        *,
        device: torch.device | str = "cpu",
        platform: Platform | None = None,
        workspace: WorkspaceManager | None = None,
    ):
        self.platform = Platform.detect(device) if platform is None else platform
        problems = [] if prepare_finalize.problem == experts.problem else [
            "prepare/finalize and experts were built for different MoEProblems"]
        problems += composition_problems(type(prepare_finalize), type(experts), experts.problem, self.platform)
        if problems:
            raise MoEConfigError(
                f"cannot compose {prepare_finalize.name} with {experts.name}:\n"
                + "\n".join(f"  - {p}" for p in problems)
            )
        self.prepare_finalize = prepare_finalize
        self.experts = experts
        self.problem = experts.problem
        self.quantize_to = activation_quant(type(experts), self.problem)
        self.workspace = _manager(workspace, device)
        self._routings_in_kernel = _routings_in_kernel(prepare_finalize, experts)
        self._prepared: Any = _UNLOADED  # what experts.prepare_weights returned, set by load
        self._edges: tuple[int, ...] = ()  # upper token edges of the buckets, ascending
        self._layouts: tuple[WorkspaceLayout, ...] = ()  # the workspace of each bucket
        self._views: tuple[dict[str, Workspace], ...] = ()  # and its views, taken at load
        self._generation = -1  # the manager's generation the views were taken from
        self._writes_result = False  # the experts write each forward's result into a fresh "out" (load)
        prepare_finalize.load(self.workspace.device)  # the load step: its tables on this device

    def __repr__(self) -> str:
        return f"ModularKernel({self.prepare_finalize.name} + {self.experts.name})"

    # --- workspace -----------------------------------------------------------------------------
    def workspace_shapes(self, num_tokens: int) -> WorkspaceLayout:
        """The buffers a forward of ``num_tokens`` tokens uses, one section per half."""
        pf = self.prepare_finalize
        experts = self.experts.workspace_shapes(pf.dispatch_shape(num_tokens))
        return WorkspaceLayout.of(**{_PREPARE: pf.workspace_shapes(num_tokens), _EXPERTS: experts})

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

    # --- load ----------------------------------------------------------------------------------
    def load(self, weights: ExpertWeights, buckets: Sequence[int] | None = None) -> None:
        """Makes ``weights`` (the canonical `ExpertWeights` of this problem) the kernel's own: the experts'
        ``prepare_weights`` once, their ``warmup`` for the token ``buckets`` (the upper edges of the M the
        caller will run; None: the experts' defaults), and the workspace views of every bucket, taken from
        the reserved buffer (the largest first). A forward of M tokens then runs on the views of the first
        bucket edge >= M. Loading again replaces the weights."""
        if not isinstance(weights, ExpertWeights):
            raise MoEConfigError(self._not_canonical(weights))
        edges = self._bucket_edges(buckets)
        prepared = self.experts.prepare_weights(weights)
        self.experts.warmup(prepared, None if buckets is None else tuple(sorted(set(buckets))))
        layouts = tuple(self.workspace_shapes(edge) for edge in edges)
        views = self._taken(layouts)  # all or nothing: a load that fails leaves the kernel as it was
        self._edges, self._layouts, self._views, self._prepared = edges, layouts, views, prepared
        self._writes_result = self._result_in_out(views[0][_EXPERTS])

    @property
    def prepared_weights(self) -> Any:
        """What the experts' ``prepare_weights`` returned at ``load`` (to time ``experts.apply`` alone)."""
        self._require_loaded()
        return self._prepared

    def _bucket_edges(self, buckets: Sequence[int] | None) -> tuple[int, ...]:
        top = self.problem.max_tokens
        edges = set() if buckets is None else set(buckets)
        bad = sorted((e for e in edges if isinstance(e, bool) or not isinstance(e, int) or not 0 < e <= top), key=repr)
        if bad:
            raise MoEConfigError(f"buckets must be token counts in [1, max_tokens={top}] (got {bad}); "
                                 "they are the upper edges of the M this kernel runs")
        return tuple(sorted(edges | {top}))

    def _taken(self, layouts: tuple[WorkspaceLayout, ...]) -> tuple[dict[str, Workspace], ...]:
        """The views of each layout; notes the manager's generation they were taken from."""
        views: dict[int, dict[str, Workspace]] = {}
        # the largest first: it reserves the buffer (or, locked and too small, fails naming this kernel)
        for i in sorted(range(len(layouts)), key=lambda i: -layouts[i].nbytes):
            views[i] = self.workspace.take_sections(layouts[i], caller=repr(self))
        self._generation = self.workspace.generation
        return tuple(views[i] for i in range(len(layouts)))

    def _sections(self, num_tokens: int) -> dict[str, Workspace]:
        """The views of ``num_tokens``'s bucket (the first edge >= M, as the layer picks its kernel)."""
        self._require_loaded()
        if self.workspace.generation != self._generation:  # a kernel sharing the manager grew its buffer
            self._views = self._taken(self._layouts)
        return self._views[bisect.bisect_left(self._edges, num_tokens)]

    def _require_loaded(self) -> None:
        if self._prepared is _UNLOADED:
            raise MoEConfigError(f"{self!r} has no weights: call kernel.load(weights) once, with the canonical "
                                 "ExpertWeights (e.g. ExpertWeights.from_dense(w13, w2, quant=...)), before a forward")

    def _not_canonical(self, weights: object) -> str:
        got = "None" if weights is None else type(weights).__name__
        if isinstance(weights, self.experts.prepared_type):
            got += " (prepared already: load prepares the canonical weights itself)"
        return (f"weights: kernel.load takes the canonical ExpertWeights, which {self.experts.name} prepares into "
                f"its {self.experts.prepared_type.__name__}; got {got}. Make them with "
                "ExpertWeights.from_dense(w13, w2, quant=...) or moe.loaders")

    # --- forward ---------------------------------------------------------------------------------
    def forward(
        self,
        hidden: torch.Tensor,
        topk: TopK,
        *,
        validate: bool = True,
        shared_output: torch.Tensor | PendingShared | None = None,
    ) -> torch.Tensor:
        """``hidden [M, H]`` routed by ``topk`` -> a new ``[M, H]`` tensor (+ ``shared_output [M, H]``,
        the shared experts' result, added inside finalize), on the weights given to ``load``. A
        `moe.shared.PendingShared` (computed on a second stream) is joined right before finalize.

        ``validate`` also checks that every expert id is in range, which reads the ids on the host; pass
        False when the ids come from a Router (in range by construction) or inside a CUDA graph.

        Under expert parallelism M > max_tokens on one rank raises on every rank, from prepare
        (`PrepareFinalize.agrees_on_tokens`), or, where the transport exchanges no counts, on this rank after
        it took part in the forward with no tokens: never an error that leaves the other ranks waiting.
        """
        over = self._too_many(hidden)
        self._check_hidden(hidden, shared_output, tokens=not self.problem.parallel.enabled)
        self._check_topk(hidden, topk, validate)
        if over and not self.prepare_finalize.agrees_on_tokens:
            return self._idle_then_raise(hidden, topk)
        space = self._sections(self.problem.max_tokens if over else hidden.shape[0])  # over: prepare raises
        dispatched, route = self.prepare_finalize.prepare(hidden, topk, self.quantize_to, space[_PREPARE])
        experts_space, fresh = self._experts_space(space[_EXPERTS], hidden)
        output = _owned(self.experts.apply(dispatched, self._prepared, experts_space), fresh)
        return self.prepare_finalize.finalize(output, dispatched, route, topk, join(shared_output))

    __call__ = forward

    def routes_in_kernel(self, router: Router) -> bool:
        """True when the experts compute ``router``'s routing themselves from the logits (decided when
        composed: one rank, standard format, reduced output) -- then ``forward_logits`` skips the Router
        and prepare."""
        return router.routing in self._routings_in_kernel

    def forward_logits(
        self, hidden: torch.Tensor, router_logits: torch.Tensor, router: Router,
        *, shared_output: torch.Tensor | PendingShared | None = None,
    ) -> torch.Tensor:
        """Like ``forward(hidden, router(router_logits))``, with the routing fused into the experts'
        kernel where ``routes_in_kernel(router)``; the Router runs here otherwise."""
        if not self.routes_in_kernel(router):
            return self.forward(hidden, router(router_logits), validate=False, shared_output=shared_output)
        self._check_hidden(hidden, shared_output)
        if tuple(router_logits.shape) != (hidden.shape[0], self.problem.num_experts):
            raise MoEConfigError(
                f"router_logits must be [M, num_experts] = [{hidden.shape[0]}, {self.problem.num_experts}] "
                f"(got {list(router_logits.shape)})"
            )
        experts_space, fresh = self._experts_space(self._sections(hidden.shape[0])[_EXPERTS], hidden)
        output = _owned(self.experts.apply_router_logits(hidden, router_logits, router, self._prepared, experts_space),
                        fresh)
        return self.prepare_finalize.finalize_reduced(output.out, join(shared_output), owned=output.owned)

    def _result_in_out(self, space: Workspace) -> bool:
        """Whether finalize returns an owned output and the experts reduce into an ``"out"`` of ``[rows, H]``
        in the layer's dtype (decided at load: the same for every bucket's views)."""
        p, out = self.problem, space.get("out")
        return (self.prepare_finalize.returns_owned_output and self.experts.capabilities.output is OutputKind.REDUCED
                and out is not None and out.dtype == p.dtype and out.dim() == 2 and out.shape[1] == p.hidden_size)

    def _experts_space(self, space: Workspace, hidden: torch.Tensor) -> tuple[Workspace, torch.Tensor | None]:
        """The experts' workspace for ``hidden [M, H]``: where they write the result (`_result_in_out`), its
        ``"out"`` replaced by a fresh ``[M, H]`` tensor (also returned) -- the forward's result directly."""
        if not self._writes_result:
            return space, None
        fresh = torch.empty((hidden.shape[0], self.problem.hidden_size), dtype=self.problem.dtype, device=hidden.device)
        return space.replacing(out=fresh), fresh

    def _check_hidden(self, hidden: torch.Tensor, shared_output: torch.Tensor | PendingShared | None,
                      tokens: bool = True) -> None:
        check_hidden(self.problem, self.workspace.device, hidden, pending_tensor(shared_output), tokens=tokens)

    def _too_many(self, hidden: torch.Tensor) -> bool:
        """M > max_tokens on an expert-parallel rank: an error that the ranks must meet together."""
        return self.problem.parallel.enabled and guard_or_false(hidden.shape[0] > self.problem.max_tokens)

    def _idle_then_raise(self, hidden: torch.Tensor, topk: TopK) -> torch.Tensor:
        """This rank has too many tokens and its transport cannot tell the others: it takes part in the
        forward's collectives with no tokens, as an idle rank does, so no rank waits for it; then raises."""
        self.forward(hidden[:0], TopK(topk.ids[:0], topk.weights[:0]), validate=False)
        raise MoEConfigError(too_many_tokens(self.problem, hidden.shape[0], "hidden", "kernel") + "; this rank "
                             f"took part in the forward with no tokens ({self.prepare_finalize.name} cannot tell "
                             "the other ranks), so theirs completed without its tokens")

    def _check_topk(self, hidden: torch.Tensor, topk: TopK, validate: bool) -> None:
        check_topk(self.problem, hidden, topk, validate=validate)


def _owned(output: ExpertsOutput, fresh: torch.Tensor | None) -> ExpertsOutput:
    """``output``, marked owned when it is exactly the ``fresh`` tensor the experts were handed."""
    if (fresh is not None and output.kind is OutputKind.REDUCED and output.out.data_ptr() == fresh.data_ptr()
            and output.out.shape == fresh.shape and output.out.is_contiguous()):
        return dataclasses.replace(output, owned=True)
    return output


def check_topk(problem: MoEProblem, hidden: torch.Tensor, topk: TopK, *, validate: bool, name: str = "topk.ids") -> None:
    """Raises `MoEConfigError` naming ``name`` unless ``topk`` is a `TopK` of ``[M, top_k]`` on
    ``hidden``'s device; ``validate`` also checks every id is in ``[0, E)`` (a host read of the ids)."""
    p = problem
    if not isinstance(topk, TopK):
        raise MoEConfigError(
            f"topk must be a moe.TopK(ids [M, k] int32, weights [M, k] float32), e.g. router(router_logits) "
            f"(got {type(topk).__name__})"
        )
    if sizes_differ(topk.ids.shape, (hidden.shape[0], p.top_k)):
        raise MoEConfigError(
            f"{name} must be [M, top_k] = [{hidden.shape[0]}, {p.top_k}] (got {list(topk.ids.shape)}); "
            f"the kernel was built for {p.sizes}"
        )
    if topk.ids.device != hidden.device:
        raise MoEConfigError(f"{name} is on {topk.ids.device} but hidden is on {hidden.device}")
    if validate:
        check_ids_in_range(p, topk.ids, name)


def check_ids_in_range(problem: MoEProblem, ids: torch.Tensor, name: str) -> None:
    """Raises `MoEConfigError` naming ``name`` unless every id is in ``[0, E)``: a host read of the ids."""
    if ids.numel():
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= problem.num_experts:
            raise MoEConfigError(
                f"{name} must lie in [0, num_experts={problem.num_experts}) (got values in [{low}, {high}])"
            )


def too_many_tokens(problem: MoEProblem, num_tokens: int, name: str, owner: str) -> str:
    return (f"{name} has M={num_tokens} tokens, which exceeds max_tokens={problem.max_tokens} the {owner} was "
            f"built for; build the {owner} with a larger max_tokens or split the batch")


def check_hidden(
    problem: MoEProblem,
    device: torch.device,
    hidden: torch.Tensor,
    shared_output: torch.Tensor | None = None,
    *,
    name: str = "hidden",
    owner: str = "kernel",
    tokens: bool = True,
) -> None:
    """Raises `MoEConfigError` naming ``name`` unless ``hidden`` is ``[M, H]`` in the problem's dtype on
    ``device``'s type with M <= max_tokens (``tokens=False``: M unchecked, for expert parallelism, where
    the ranks meet that error together: `PrepareFinalize.agrees_on_tokens`), and ``shared_output`` (if
    given) is shaped, typed and placed like it. ``owner`` ("kernel", "layer") is what the messages say
    was built for the problem."""
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
    # an unbacked M (torch.compile, mark_unbacked) cannot be compared at trace time; the layer's bucket
    # lookup raises the same error when the op runs
    if tokens and guard_or_false(hidden.shape[0] > p.max_tokens):
        raise MoEConfigError(too_many_tokens(p, hidden.shape[0], name, owner))
    if shared_output is None:
        return
    # a function, not a string: formatting M would specialize it under torch.compile
    def want() -> str:
        return f"[{hidden.shape[0]}, {hidden.shape[1]}] {hidden.dtype} on {hidden.device}"
    if not isinstance(shared_output, torch.Tensor):
        raise MoEConfigError(f"shared_output must match {name}: {want()} (got {type(shared_output).__name__})")
    if sizes_differ(shared_output.shape, hidden.shape) or (shared_output.dtype, shared_output.device) != (hidden.dtype, hidden.device):
        raise MoEConfigError(
            f"shared_output must match {name}: {want()} "
            f"(got {list(shared_output.shape)} {shared_output.dtype} on {shared_output.device})"
        )



def sizes_differ(got: Sequence, want: Sequence) -> bool:
    """True when the sizes ``got`` and ``want`` certainly differ. Under ``torch.compile`` a pair that
    cannot be decided at trace time (an unbacked M against another unbacked M) counts as equal here, so
    the check does not break the trace; the kernel inside ``moe::fused_moe`` checks it again when it runs."""
    return len(got) != len(want) or any(guard_or_false(a != b) for a, b in zip(got, want))


def _manager(workspace: WorkspaceManager | None, device: torch.device | str) -> WorkspaceManager:
    if workspace is None:
        return WorkspaceManager(device)
    if not isinstance(workspace, WorkspaceManager):
        raise MoEConfigError(f"workspace must be a moe.WorkspaceManager (one shared by kernels that never run at "
                             f"once) or None for one of the kernel's own (got {type(workspace).__name__})")
    if workspace.device.type != torch.device(device).type:
        raise MoEConfigError(f"workspace is on {workspace.device} but the kernel is built for {device}")
    return workspace


def _routings_in_kernel(prepare_finalize: PrepareFinalize, experts: Experts) -> frozenset[str]:
    """The routings the experts compute from the logits in this composition: their declared ones when
    there is one rank, the standard format and reduced output (nothing to send, nothing to sum), else none."""
    cap = experts.capabilities
    fused = (prepare_finalize.transport.format is ActivationFormat.STANDARD
             and not experts.problem.parallel.enabled and cap.output is OutputKind.REDUCED)
    return cap.routes_from_logits if fused else frozenset()
