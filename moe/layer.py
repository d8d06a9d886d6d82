"""FusedMoE: an ``nn.Module`` holding the weights, the router and the composed kernel.

Lifecycle, each a named step: select (``select_experts``) -> build (``ModularKernel``) -> load
(``load_weights`` / ``load_checkpoint``: quantize to the scheme, then ``prepare_weights`` once) -> run
(``forward``).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from moe.errors import MoEConfigError, UnsupportedError
from moe.kernel import ModularKernel
from moe.loaders import load_experts, requantize
from moe.platform import Platform
from moe.prepare_finalize import LocalPrepareFinalize
from moe.problem import MoEProblem, ParallelConfig
from moe.registry import experts_classes
from moe.router import Router
from moe.weights import ExpertWeights

# Until the oracle ranks candidates by cost, the layer takes the first that can serve, in this order.
_PREFERENCE = ("triton", "torch_grouped", "reference")


def select_experts(problem: MoEProblem, platform: Platform) -> type:
    """The first Experts class in the preference order whose ``check`` passes; all reasons otherwise."""
    classes = experts_classes()
    rejected = {}
    for name in _PREFERENCE:
        cls = classes.get(name)
        if cls is None:
            continue
        reasons = cls.check(problem, platform)
        if not reasons:
            return cls
        rejected[name] = reasons
    raise UnsupportedError(
        "no experts backend can serve this problem",
        [f"{name}: {'; '.join(reasons)}" for name, reasons in rejected.items()],
    )


class FusedMoE(torch.nn.Module):
    """A Mixture-of-Experts layer: ``forward(hidden_states [M, H], router_logits [M, E]) -> [M, H]``.

    >>> layer = FusedMoE(8, 2, 64, 32, dtype=torch.float32)
    >>> layer.load_weights(w13=torch.randn(8, 64, 64) / 8, w2=torch.randn(8, 64, 32) / 8)
    >>> layer(torch.randn(3, 64), torch.randn(3, 8)).shape
    torch.Size([3, 64])
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        activation: str = "silu",
        quant: str = "bf16",
        routing: str = "softmax",
        has_bias: bool = False,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        max_tokens: int = 8192,
        parallel: ParallelConfig | None = None,
        experts: str | None = None,
        **routing_options: Any,
    ):
        super().__init__()
        # an unquantized scheme name must agree with dtype (quant="fp16" goes with torch.float16)
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
        self.device = torch.device(device)
        self.router = Router(routing, num_experts, top_k, **_on_device(routing_options, self.device))
        self.platform = Platform.detect(self.device)
        experts_cls = _named_experts(experts, self.problem, self.platform) if experts else select_experts(
            self.problem, self.platform
        )
        self.kernel = ModularKernel(LocalPrepareFinalize(self.problem), experts_cls(self.problem), device=self.device)
        self.weights: ExpertWeights | None = None
        self._prepared: Any = None

    def extra_repr(self) -> str:
        p = self.problem
        return (
            f"E={p.num_experts}, k={p.top_k}, H={p.hidden_size}, I={p.intermediate_size}, "
            f"activation={p.activation.name}, quant={p.quant_name}, routing={self.router.routing}, "
            f"kernel={self.kernel!r}"
        )

    # --- load ------------------------------------------------------------------------------------
    def load_weights(self, *, w13: torch.Tensor, w2: torch.Tensor, b13=None, b2=None) -> None:
        """Dense float weights in the canonical layout; quantized here to the layer's scheme."""
        weights = ExpertWeights.from_dense(w13, w2, b13, b2, quant=self.problem.quant, dtype=self.problem.dtype)
        self._install(weights)

    def load_checkpoint(self, tensors: Mapping[str, torch.Tensor], layout: str, *, prefix: str = "") -> None:
        """Expert tensors as a checkpoint stores them (see ``moe.loaders``), re-quantized if needed."""
        weights = load_experts(tensors, layout, num_experts=self.problem.num_experts, prefix=prefix)
        self._install(requantize(weights, self.problem.quant, dtype=self.problem.dtype))

    def _install(self, weights: ExpertWeights) -> None:
        weights = weights.to(self.device)
        weights.validate(self.problem)
        self._prepared = self.kernel.experts.prepare_weights(weights)
        self.weights = weights

    # --- run -------------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        if self._prepared is None:
            raise MoEConfigError("FusedMoE has no weights; call load_weights or load_checkpoint first")
        if router_logits.dim() != 2 or router_logits.shape[0] != hidden_states.shape[0]:
            raise MoEConfigError(
                f"router_logits must be [M, num_experts] with M = hidden_states.shape[0] = "
                f"{hidden_states.shape[0]} (got {list(router_logits.shape)})"
            )
        topk = self.router(router_logits)
        return self.kernel.forward(hidden_states, topk, self._prepared, validate=False)


def _named_experts(name: str, problem: MoEProblem, platform: Platform) -> type:
    from moe.registry import get_experts

    cls = get_experts(name)
    reasons = cls.check(problem, platform)
    if reasons:
        raise UnsupportedError(f"experts={name!r} cannot serve this problem", reasons)
    return cls


def _on_device(options: dict, device: torch.device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in options.items()}
