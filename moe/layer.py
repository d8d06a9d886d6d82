"""FusedMoE: an ``nn.Module`` holding the weights, the router and the kernels the oracle chose.

Lifecycle, each a named step: plan (``moe.oracle.plan``: the best (prepare/finalize, experts) pair per
token bucket, from declarations) -> build (``moe.build.build``: one ``ModularKernel`` per distinct pair,
sharing one workspace) -> load (``load_weights`` / ``load_checkpoint``: quantize to the scheme, then
``kernel.load`` on each kernel: its experts' ``prepare_weights`` once, warm-up, workspace views) -> run
(``forward`` dispatches on M to its bucket's kernel).

A plan that uses two experts backends holds the weights prepared for each (twice the weight memory);
force one backend (``experts=``, ``MOE_EXPERTS``, a policy) where that matters.

With redundant experts (``ParallelConfig(num_redundant_experts=N)``, `moe.eplb`) the kernels serve the
physical experts: forward counts the router's logical ids and maps them to replicas, and ``rebalance``
(collective) moves the replicas to where the counted load is.
"""

from __future__ import annotations

import bisect
from typing import Any, Mapping

import torch

from moe.build import build
from moe.custom_op import call, register
from moe.eplb import ExpertLoadBalancer, Placement
from moe.eplb_transfer import PendingRebalance, begin_rebalance, gather_slots
from moe.errors import MoEConfigError
from moe.kernel import ModularKernel, check_hidden, check_topk, sizes_differ
from moe.layer_args import (
    check_instance,
    check_routing_options,
    check_weight_on_input,
    device_of,
    given_routing,
    on_device,
    policy_with,
    warn_if_slow,
)
from moe.loaders import load_experts, requantize
from moe.oracle import Plan, Policy, plan
from moe.oracle.cost import SHARED_OVERLAP_MAX_TOKENS
from moe.sharding import shard_weights
from moe.platform import Platform
from moe.prepare_finalize._ep import process_group
from moe.problem import MoEProblem, ParallelConfig
from moe.router import Router, TopK
from moe.routing.layer_inputs import fold_zero_experts, weight_on_input
from moe.shared import PendingShared, SharedExperts, SharedExpertsConfig, SharedStream, join, shared_experts_for
from moe.shared_loaders import shared_layout_for
from moe.weights import ExpertWeights, check_dense_for
from moe.workspace import WorkspaceManager


class FusedMoE(torch.nn.Module):
    """A Mixture-of-Experts layer: ``forward(hidden_states [M, H], router_logits [M, E]) -> [M, H]``, or
    ``forward(hidden_states, topk_ids=..., topk_weights=...)`` with routing computed elsewhere.

    >>> layer = FusedMoE(8, 2, 64, 32, dtype=torch.float32, quant="fp32")
    >>> layer.load_weights(w13=torch.randn(8, 64, 64) / 8, w2=torch.randn(8, 64, 32) / 8)
    >>> layer(torch.randn(3, 64), torch.randn(3, 8)).shape
    torch.Size([3, 64])

    The backends come from ``moe.oracle.plan`` (``layer.plan.explain()`` says why): ``experts=NAME``
    forces one (raising with its reasons if it cannot serve), ``policy`` replaces the environment's
    (``MOE_POLICY`` / ``MOE_EXPERTS`` / ``MOE_PROFILE``), ``platform`` the detected one. ``workspace``, a
    `WorkspaceManager` on the layer's device, is shared with other layers that never run at once (the
    layers of one model): one buffer, as large as the largest of them needs.

    ``torch.compile``: the forward is one custom op, ``moe::fused_moe`` (`moe.custom_op`), that reaches
    the layer through an int handle, so ``torch.compile(layer)`` (``fullgraph=True`` too) and compiled
    models that call the layer see ``[M, H] -> [M, H]`` and nothing of the weights, workspace or token
    buckets; a compiled layer can be captured in a CUDA graph. For one graph across M = 0..max_tokens,
    mark M before the first compiled call -- ``moe.custom_op.mark_tokens_dynamic(x)`` on the compiled
    callable's inputs whose first dimension is M -- since dynamo otherwise specializes M = 0 and 1 and
    compiles once more after the first M. The layer is for inference: a backward raises.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        activation: str = "silu",
        quant: str | None = None,
        routing: str = "softmax",
        has_bias: bool = False,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        max_tokens: int = 8192,
        parallel: ParallelConfig | None = None,
        experts: str | None = None,
        policy: Policy | None = None,
        platform: Platform | None = None,
        shared_experts: SharedExperts | SharedExpertsConfig | None = None,
        workspace: WorkspaceManager | None = None,
        **routing_options: Any,
    ):
        super().__init__()
        # an unquantized scheme name must agree with dtype (quant="fp16" goes with torch.float16);
        # quant=None keeps the weights unquantized in dtype
        self.problem = MoEProblem.create(
            num_experts=num_experts,
            top_k=top_k,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            activation=activation,
            quant=quant,
            dtype=dtype,
            has_bias=has_bias,
            max_tokens=max_tokens,
            parallel=parallel or ParallelConfig(),
        )
        self.device = device_of(device)
        redundant = self.problem.parallel.num_redundant_experts
        self.balancer = ExpertLoadBalancer(self.problem, self.device) if redundant else None
        check_routing_options(routing_options)
        self.router = Router(routing, num_experts, top_k, **on_device(routing_options, self.device))
        check_weight_on_input(self.router)
        check_instance("platform", platform, Platform, "e.g. Platform.preset('h100'), or None to detect it")
        check_instance("policy", policy, Policy, "e.g. Policy(force=('triton',)), or None for the environment's")
        self.platform = Platform.detect(self.device) if platform is None else platform
        # the layer's own shared experts (moe/shared.py), on a second stream on CUDA
        self.shared_experts = shared_experts_for(shared_experts, self.problem, self.device)
        shared = None if self.shared_experts is None else self.shared_experts.config.problem(self.problem)
        self.plan: Plan = plan(self.problem, self.platform, policy_with(policy, experts), shared=shared)
        warn_if_slow(self.plan)
        check_instance("workspace", workspace, WorkspaceManager, "e.g. one WorkspaceManager(device) shared by layers "
                        "that never run at once, or None for the layer's own")
        self.kernels: dict = build(self.plan, self.device, workspace)  # Pair -> ModularKernel
        # per call: the bucket's upper edges and, for each bucket, its kernel and whether it routes itself
        self._edges = [b.high for b in self.plan.buckets]
        self._bucket_kernels = [self.kernels[b.chosen.pair] for b in self.plan.buckets]
        # replicas are picked from the router's ids here, and in-kernel routing knows no zero experts
        routes_here = redundant or self.router.num_zero_experts
        self._routes_in_kernel = [k.routes_in_kernel(self.router) and not routes_here for k in self._bucket_kernels]
        self.weights: ExpertWeights | None = None  # set once every kernel has loaded them
        has_stream = self.shared_experts is not None and self.device.type == "cuda"
        self._shared_stream = SharedStream(self.device) if has_stream else None
        self._handle = register(self)  # how moe::fused_moe finds this layer (moe.custom_op says why)

    def __setstate__(self, state: dict) -> None:
        # a copy (copy.deepcopy, pickle) is a layer of its own: it must not answer to the original's handle
        super().__setstate__(state)
        self._handle = register(self)

    @property
    def kernel(self) -> ModularKernel:
        """The kernel of the largest token bucket (the only one when the plan uses one pair)."""
        return self._bucket_kernels[-1]

    def kernel_for(self, num_tokens: int) -> ModularKernel:
        """The kernel that runs a forward of ``num_tokens`` tokens (M = 0 goes to the first bucket)."""
        return self._bucket_kernels[self._bucket(num_tokens)]

    def _bucket(self, num_tokens: int) -> int:
        """M's bucket; past max_tokens under expert parallelism the last one, whose kernel meets that error
        with the other ranks (`ModularKernel.forward`), else the error here."""
        index = bisect.bisect_left(self._edges, num_tokens)
        if index == len(self._edges) and self.problem.parallel.enabled:
            return index - 1
        if index == len(self._edges):
            raise MoEConfigError(
                f"hidden_states has M={num_tokens} tokens, which exceeds max_tokens={self.problem.max_tokens} "
                "this layer was built for; build it with a larger max_tokens or split the batch"
            )
        return index

    def extra_repr(self) -> str:
        p = self.problem
        text = (
            f"E={p.num_experts}, k={p.top_k}, H={p.hidden_size}, I={p.intermediate_size}, "
            f"activation={p.activation.name}, quant={p.quant_name}, routing={self.router.routing}, "
            f"kernel={self.kernel!r}"
        )
        if len(self.kernels) > 1:
            text += ", plan=[" + ", ".join(
                f"{b.low}-{b.high}: {b.chosen.pair}" for b in self.plan.buckets) + "]"
        return text

    # --- load ------------------------------------------------------------------------------------
    def load_weights(self, *, w13: torch.Tensor, w2: torch.Tensor, b13=None, b2=None) -> None:
        """Dense float weights in the canonical layout; quantized here to the layer's scheme.

        ``w13 [E, 2I, H]`` rows ``[gate; up]`` (non-gated activations: ``[E, I, H]``), ``w2 [E, H, I]``,
        ``b13 [E, 2I]``, ``b2 [E, H]`` (biases only when built with ``has_bias=True``); E is the layer's
        num_experts or, under expert parallelism, this rank's count.
        """
        check_dense_for(self.problem, w13=w13, w2=w2, b13=b13, b2=b2)
        weights = ExpertWeights.from_dense(w13, w2, b13, b2, quant=self.problem.quant, dtype=self.problem.dtype)
        self._install(weights)

    def load_checkpoint(self, tensors: Mapping[str, torch.Tensor], layout: str, *, prefix: str = "",
                        shared_layout: str | None = None) -> None:
        """Expert tensors as a checkpoint stores them (see ``moe.loaders``), re-quantized if needed; with
        shared experts, theirs too (``moe.shared_loaders``: ``shared_layout``, by default the one that goes
        with ``layout``: deepseek -> deepseek, qwen3 -> qwen2_moe), under the same ``prefix``."""
        p = self.problem
        if shared_layout is not None and self.shared_experts is None:
            raise MoEConfigError(f"shared_layout={shared_layout!r} but this layer has no shared experts; build it "
                                 "with shared_experts=SharedExpertsConfig(I) or leave shared_layout out")
        shared = None if self.shared_experts is None else shared_layout_for(layout, shared_layout)
        weights = load_experts(tensors, layout, num_experts=p.num_experts, prefix=prefix,
                               hidden_size=p.hidden_size, intermediate_size=p.intermediate_size)
        if self.shared_experts is not None:
            self.shared_experts.load_checkpoint(tensors, shared, prefix=prefix)
        self._install(requantize(weights, self.problem.quant, dtype=self.problem.dtype))

    def _install(self, weights: ExpertWeights) -> None:
        if self.balancer is not None:
            weights = self._slot_weights(weights)
        elif self.problem.parallel.enabled and weights.num_experts == self.problem.num_experts:
            weights = shard_weights(weights, self.problem)  # full checkpoint -> this rank's experts
        self._load_kernels(weights.to(self.device))

    def _slot_weights(self, weights: ExpertWeights) -> ExpertWeights:
        """This rank's physical slots, cut from the full logical weights by the current placement."""
        if weights.num_experts != self.problem.num_experts:
            raise MoEConfigError(
                f"with num_redundant_experts={self.problem.parallel.num_redundant_experts} the layer loads the full "
                f"weights of all E={self.problem.num_experts} logical experts (got {weights.num_experts}): its "
                "placement picks the replicas each rank holds"
            )
        return gather_slots(weights, self.balancer.local_experts())

    def _load_kernels(self, weights: ExpertWeights) -> None:
        weights.validate(self.problem)
        self.weights = None
        for kernel in self.kernels.values():  # the shared buffer at its final size before any kernel takes views
            kernel.reserve(max(self._buckets_of(kernel)))
        for kernel in self.kernels.values():
            kernel.load(weights, self._buckets_of(kernel))
        self.weights = weights

    def _buckets_of(self, kernel: ModularKernel) -> tuple[int, ...]:
        """Upper token edges of the plan's buckets this kernel serves (what warmup tunes for)."""
        return tuple(b.high for b, k in zip(self.plan.buckets, self._bucket_kernels) if k is kernel)

    # --- redundant experts (EPLB) ----------------------------------------------------------------
    def rebalance(self) -> Placement:
        """Collective: `begin_rebalance` then `finish_rebalance`; returns the new placement."""
        return self.finish_rebalance(self.begin_rebalance())

    def begin_rebalance(self) -> PendingRebalance:
        """Collective: the new placement from every rank's token counters, and this rank's weights under it,
        built in new tensors; forwards keep the old placement until `finish_rebalance`."""
        if self.balancer is None or self.weights is None:
            raise MoEConfigError("rebalance needs a loaded layer built with ParallelConfig(num_redundant_experts=N > 0) "
                                 f"(num_redundant_experts={self.problem.parallel.num_redundant_experts}, "
                                 f"weights {'loaded' if self.weights is not None else 'not loaded'})")
        return begin_rebalance(self.balancer, self.weights, process_group(self.problem.parallel, "rebalance"))

    def finish_rebalance(self, pending: PendingRebalance) -> Placement:
        """Swaps in ``pending``'s weights and placement (local: no collective)."""
        if self.balancer is None or not isinstance(pending, PendingRebalance):
            raise MoEConfigError(f"finish_rebalance takes what this layer's begin_rebalance returned (got "
                                 f"{type(pending).__name__}; num_redundant_experts="
                                 f"{self.problem.parallel.num_redundant_experts})")
        self._load_kernels(pending.weights)
        self.balancer.install(pending.placement)
        return pending.placement

    # --- run -------------------------------------------------------------------------------------
    def forward(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor | None = None,
        shared_output: torch.Tensor | None = None,
        *,
        topk: TopK | None = None,
        topk_ids: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        validate: bool = True,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[M, H]``, routed one of two ways:

        - ``router_logits [M, E + num_zero_experts]``: the layer's own `Router` picks the experts
          (``input_ids [M]``, the tokens' ids, are required by hash routing, ``deepseek_v4_hash``);
        - precomputed routing, for model code that routes itself: ``topk=TopK(...)``, or
          ``topk_ids [M, k]`` (any integer dtype) with ``topk_weights [M, k]`` (any float dtype; the
          weights are used as given: no scaling factor is applied to them; a ``llama4`` layer applies
          them to the experts' input, as its router's would be).

        ``shared_output`` (a shared expert's result) is added in finalize; a layer built with
        ``shared_experts`` computes it itself (`_shared_output`) and takes none. ``validate`` (precomputed
        routing only) checks that every id lies in ``[0, E)``, which reads the ids on the host: compiled
        or not, it runs when the op runs, except while a CUDA graph is being captured (a captured graph
        then replays without it); pass False where the ids are in range by construction (another
        router's output) to save the host read.

        Where the output is combined, in one place: the Router multiplies the top-k weights by
        ``routed_scaling_factor`` (precomputed weights are used as given); finalize then computes, in
        float32, ``sum over k of weights[m, j] * expert_output[m, j] + shared_output[m]`` (the weighted
        sum in ``moe.prepare_finalize.combine.sum_over_k``, or inside experts of reduced output; the
        shared add in the same finalize) and casts once to the layer's dtype.

        The arguments are checked here (in eager mode, and at trace time under ``torch.compile``), then
        everything else -- the shared experts, the Router, M's bucket and its kernel, the workspace --
        runs inside one custom op, ``moe::fused_moe`` (`moe.custom_op`), which the compiler sees as opaque
        (in eager mode without gradients, its body is called directly: `moe.custom_op.call`).
        """
        if self.weights is None:
            raise MoEConfigError("FusedMoE has no weights; call load_weights or load_checkpoint first")
        # the layer's own argument names and sizes; the kernel checks hidden again under its own name
        check_hidden(self.problem, self.device, hidden_states, shared_output, name="hidden_states", owner="layer",
                     tokens=not self.problem.parallel.enabled)  # under expert parallelism: all ranks, in the kernel
        if self.shared_experts is not None and shared_output is not None:
            raise MoEConfigError("shared_output: this layer computes its own shared experts (built with "
                                 "shared_experts=...); pass shared_output only to a layer built without them")
        given = given_routing(router_logits, topk, topk_ids, topk_weights)
        if given is None:
            self._check_router_logits(router_logits, hidden_states)
            return call(hidden_states, router_logits, None, None, shared_output, input_ids, self._handle, False, "")
        name = "topk.ids" if topk is not None else "topk_ids"
        check_topk(self.problem, hidden_states, given, validate=False, name=name)  # the range: inside the op
        return call(hidden_states, None, given.ids, given.weights, shared_output, None, self._handle, validate, name)

    def run(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor | None,
        topk_ids: torch.Tensor | None,
        topk_weights: torch.Tensor | None,
        shared_output: torch.Tensor | None,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The body of ``moe::fused_moe``, on arguments ``forward`` checked: M's bucket's kernel, routed by
        ``router_logits`` (and ``input_ids`` for hash routing) or by ``topk_ids`` int32 / ``topk_weights``
        float32 (ids in range). Zero experts' ``weight * hidden`` joins the shared output (waiting for
        shared experts computed on the second stream, when a layer has both)."""
        bucket = self._bucket(hidden_states.shape[0])
        kernel = self._bucket_kernels[bucket]
        shared_output = self._shared_output(hidden_states, shared_output)  # after every check: nothing queued yet
        if router_logits is not None and self._routes_in_kernel[bucket]:  # e.g. trtllm-gen routes from the logits
            return kernel.forward_logits(hidden_states, router_logits, self.router, shared_output=shared_output)
        topk = self.router(router_logits, input_ids) if router_logits is not None else TopK(topk_ids, topk_weights)
        if self.router.num_zero_experts:
            topk, shared_output = fold_zero_experts(topk, hidden_states, self.problem.num_experts, join(shared_output))
        if self.router.kind.weight_on_input:
            topk, hidden_states = weight_on_input(topk, hidden_states)
        if self.balancer is not None:  # logical ids counted, then sent to physical replicas
            self.balancer.record(topk.ids)
            topk = self.balancer.to_physical(topk)
        return kernel.forward(hidden_states, topk, validate=False, shared_output=shared_output)

    def _shared_output(self, hidden_states: torch.Tensor,
                       shared_output: torch.Tensor | None) -> torch.Tensor | PendingShared | None:
        """``shared_output`` as given, or the layer's shared experts on ``hidden_states``: launched on the
        second stream on CUDA up to ``SHARED_OVERLAP_MAX_TOKENS`` tokens (joined by the kernel right before
        finalize), computed here above it (where the streams' kernels would contend) and on a CPU."""
        if self.shared_experts is None:
            return shared_output
        if self._shared_stream is None or hidden_states.shape[0] > SHARED_OVERLAP_MAX_TOKENS:
            return self.shared_experts(hidden_states)
        return self._shared_stream.launch(self.shared_experts, hidden_states)

    def _check_router_logits(self, router_logits: torch.Tensor, hidden_states: torch.Tensor) -> None:
        p, tokens, width = self.problem, hidden_states.shape[0], self.router.num_choices
        zero = " + num_zero_experts" if self.router.num_zero_experts else ""

        # a function, not a string: formatting M would specialize it under torch.compile
        def want() -> str:
            return f"[M, num_experts{zero}] = [{tokens}, {width}] (M = hidden_states.shape[0])"
        if not isinstance(router_logits, torch.Tensor):
            raise MoEConfigError(f"router_logits must be a torch.Tensor {want()} (got {type(router_logits).__name__})")
        if sizes_differ(router_logits.shape, (tokens, width)):
            raise MoEConfigError(
                f"router_logits must be {want()} (got shape {list(router_logits.shape)}); the layer was built for {p.sizes}"
            )
        if not router_logits.is_floating_point():
            raise MoEConfigError(f"router_logits must be floating point (got {router_logits.dtype})")
        if router_logits.device != hidden_states.device:
            raise MoEConfigError(
                f"router_logits is on {router_logits.device} but hidden_states is on {hidden_states.device}"
            )
