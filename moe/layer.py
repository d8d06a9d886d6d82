"""FusedMoE: an ``nn.Module`` holding the weights, the router and the kernels the oracle chose.

Lifecycle, each a named step: plan (``moe.oracle.plan``: the best (prepare/finalize, experts) pair per
token bucket, from declarations) -> build (``moe.build.build``: one ``ModularKernel`` per distinct pair,
sharing one workspace) -> load (``load_weights`` / ``load_checkpoint``: quantize to the scheme, then
``kernel.load`` on each kernel: its experts' ``prepare_weights`` once, warm-up, workspace views) -> run
(``forward`` dispatches on M to its bucket's kernel).

A plan that uses two experts backends holds the weights prepared for each (twice the weight memory);
force one backend (``experts=``, ``MOE_EXPERTS``, a policy) where that matters.
"""

from __future__ import annotations

import bisect
import dataclasses
import warnings
from typing import Any, Mapping

import torch

from moe.build import build
from moe.errors import MoEConfigError, SlowPathWarning
from moe.kernel import ModularKernel, check_hidden
from moe.loaders import load_experts, requantize
from moe.oracle import Plan, Policy, plan
from moe.oracle.slow_path import slow_path
from moe.sharding import shard_weights
from moe.platform import Platform
from moe.problem import MoEProblem, ParallelConfig
from moe.registry import experts_classes, get_experts
from moe.router import Router
from moe.routing.layer_inputs import fold_zero_experts, weight_on_input
from moe.weights import ExpertWeights, check_dense_for


class FusedMoE(torch.nn.Module):
    """A Mixture-of-Experts layer: ``forward(hidden_states [M, H], router_logits [M, E]) -> [M, H]``.

    >>> layer = FusedMoE(8, 2, 64, 32, dtype=torch.float32, quant="fp32")
    >>> layer.load_weights(w13=torch.randn(8, 64, 64) / 8, w2=torch.randn(8, 64, 32) / 8)
    >>> layer(torch.randn(3, 64), torch.randn(3, 8)).shape
    torch.Size([3, 64])

    The backends come from ``moe.oracle.plan`` (``layer.plan.explain()`` says why): ``experts=NAME``
    forces one (raising with its reasons if it cannot serve), ``policy`` replaces the environment's
    (``MOE_POLICY`` / ``MOE_EXPERTS`` / ``MOE_PROFILE``), ``platform`` the detected one.
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
        self.device = _device(device)
        _check_routing_options(routing_options)
        self.router = Router(routing, num_experts, top_k, **_on_device(routing_options, self.device))
        _check_weight_on_input(self.router)
        _check_instance("platform", platform, Platform, "e.g. Platform.preset('h100'), or None to detect it")
        _check_instance("policy", policy, Policy, "e.g. Policy(force=('triton',)), or None for the environment's")
        self.platform = Platform.detect(self.device) if platform is None else platform
        self.plan: Plan = plan(self.problem, self.platform, _policy(policy, experts))
        _warn_if_slow(self.plan)
        self.kernels: dict = build(self.plan, self.device)  # Pair -> ModularKernel
        # per call: the bucket's upper edges and, for each bucket, its kernel and whether it routes itself
        self._edges = [b.high for b in self.plan.buckets]
        self._bucket_kernels = [self.kernels[b.chosen.pair] for b in self.plan.buckets]
        # in-kernel routing knows no zero experts
        self._routes_in_kernel = [
            k.routes_in_kernel(self.router) and not self.router.num_zero_experts for k in self._bucket_kernels
        ]
        self.weights: ExpertWeights | None = None  # set once every kernel has loaded them

    @property
    def kernel(self) -> ModularKernel:
        """The kernel of the largest token bucket (the only one when the plan uses one pair)."""
        return self._bucket_kernels[-1]

    def kernel_for(self, num_tokens: int) -> ModularKernel:
        """The kernel that runs a forward of ``num_tokens`` tokens (M = 0 goes to the first bucket)."""
        return self._bucket_kernels[self._bucket(num_tokens)]

    def _bucket(self, num_tokens: int) -> int:
        index = bisect.bisect_left(self._edges, num_tokens)
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

    def load_checkpoint(self, tensors: Mapping[str, torch.Tensor], layout: str, *, prefix: str = "") -> None:
        """Expert tensors as a checkpoint stores them (see ``moe.loaders``), re-quantized if needed."""
        p = self.problem
        weights = load_experts(tensors, layout, num_experts=p.num_experts, prefix=prefix,
                               hidden_size=p.hidden_size, intermediate_size=p.intermediate_size)
        self._install(requantize(weights, self.problem.quant, dtype=self.problem.dtype))

    def _install(self, weights: ExpertWeights) -> None:
        if self.problem.parallel.enabled and weights.num_experts == self.problem.num_experts:
            weights = shard_weights(weights, self.problem)  # full checkpoint -> this rank's experts
        weights = weights.to(self.device)
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

    # --- run -------------------------------------------------------------------------------------
    def forward(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        shared_output: torch.Tensor | None = None,
        *,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[M, H]``; ``shared_output`` (a shared expert's result, DeepSeek-style) is added in finalize.

        ``router_logits`` is ``[M, E + num_zero_experts]``; ``input_ids [M]`` (the tokens' ids) is
        required by hash routing (``deepseek_v4_hash``) and shape-checked, unread, by the others."""
        if self.weights is None:
            raise MoEConfigError("FusedMoE has no weights; call load_weights or load_checkpoint first")
        # the layer's own argument names and sizes; the kernel checks hidden again under its own name
        check_hidden(self.problem, self.device, hidden_states, shared_output, name="hidden_states", owner="layer")
        self._check_router_logits(router_logits, hidden_states)
        bucket = self._bucket(hidden_states.shape[0])
        kernel = self._bucket_kernels[bucket]
        if self._routes_in_kernel[bucket]:  # e.g. trtllm-gen routes from the logits itself
            return kernel.forward_logits(hidden_states, router_logits, self.router, shared_output=shared_output)
        topk = self.router(router_logits, input_ids)
        if self.router.num_zero_experts:
            topk, shared_output = fold_zero_experts(topk, hidden_states, self.problem.num_experts, shared_output)
        if self.router.kind.weight_on_input:
            topk, hidden_states = weight_on_input(topk, hidden_states)
        return kernel.forward(hidden_states, topk, validate=False, shared_output=shared_output)

    def _check_router_logits(self, router_logits: torch.Tensor, hidden_states: torch.Tensor) -> None:
        p, tokens, width = self.problem, hidden_states.shape[0], self.router.num_choices
        zero = " + num_zero_experts" if self.router.num_zero_experts else ""
        want = f"[M, num_experts{zero}] = [{tokens}, {width}] (M = hidden_states.shape[0])"
        if not isinstance(router_logits, torch.Tensor):
            raise MoEConfigError(f"router_logits must be a torch.Tensor {want} (got {type(router_logits).__name__})")
        if tuple(router_logits.shape) != (tokens, width):
            raise MoEConfigError(
                f"router_logits must be {want} (got shape {list(router_logits.shape)}); the layer was built for {p.sizes}"
            )
        if not router_logits.is_floating_point():
            raise MoEConfigError(f"router_logits must be floating point (got {router_logits.dtype})")
        if router_logits.device != hidden_states.device:
            raise MoEConfigError(
                f"router_logits is on {router_logits.device} but hidden_states is on {hidden_states.device}"
            )


# what FusedMoE passes on to Router besides the routing, E and k (read from Router, not listed twice)
_ROUTING_OPTIONS = tuple(f.name for f in dataclasses.fields(Router) if f.name not in ("routing", "num_experts", "top_k"))


def _device(device: Any) -> torch.device:
    """``device`` as a torch.device that exists here (cpu or cuda); `MoEConfigError` otherwise."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise MoEConfigError(f"device: {device!r} is not a device moe runs on; use 'cpu' or 'cuda' (or 'cuda:N')")
    count = torch.cuda.device_count() if parsed.type == "cuda" and torch.cuda.is_available() else 0
    if parsed.type == "cuda" and count == 0:
        raise MoEConfigError(
            f"device: {device!r} but torch.cuda.is_available() is False here (torch {torch.__version__}: no GPU, "
            "or a CPU-only build); use device='cpu'"
        )
    if parsed.type == "cuda" and (parsed.index or 0) >= count:
        raise MoEConfigError(f"device: {device!r} but this machine has {count} CUDA device(s): cuda:0..cuda:{count - 1}")
    return parsed


def _check_routing_options(options: dict) -> None:
    unknown = sorted(set(options) - set(_ROUTING_OPTIONS))
    if unknown:
        raise MoEConfigError(
            f"FusedMoE got unknown keyword argument(s) {unknown}; besides its named arguments it takes the "
            f"routing options {', '.join(_ROUTING_OPTIONS)}"
        )


def _check_weight_on_input(router: Router) -> None:
    if router.kind.weight_on_input and router.top_k != 1:
        raise MoEConfigError(
            f"routing={router.routing!r} multiplies each expert's input by its router weight (Llama-4), which "
            f"this layer supports for top_k=1 only (got top_k={router.top_k}); each of k > 1 slots would need "
            "its own scaled input"
        )


def _check_instance(name: str, value: Any, cls: type, example: str) -> None:
    if value is not None and not isinstance(value, cls):
        raise MoEConfigError(f"{name} must be a {cls.__name__} or None (got {type(value).__name__} {value!r}); {example}")


def _warn_if_slow(layer_plan: Plan) -> None:
    """One SlowPathWarning when only the reference experts serve some bucket on a GPU (the same text
    from the same line is shown once per process: a model of many equal layers warns once)."""
    found = slow_path(layer_plan)
    if found is not None:
        warnings.warn(found.message(), SlowPathWarning, stacklevel=3)


def _policy(policy: Policy | None, experts: str | None) -> Policy:
    """The given policy (or the environment's), forcing ``experts`` when given."""
    policy = Policy.from_env() if policy is None else policy
    if experts is None:
        return policy
    get_experts(experts)  # an unknown name is a MoEConfigError naming the registered ones
    return policy.forcing(experts, source=f"experts={experts!r}", replacing=experts_classes())


def _on_device(options: dict, device: torch.device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in options.items()}
