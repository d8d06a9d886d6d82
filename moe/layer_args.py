"""The arguments `moe.FusedMoE` takes, checked and converted: its device, routing options, the forms its
routing may come in, the policy it plans with. Each check raises `MoEConfigError` naming the argument,
the value and the constraint.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch

from moe.errors import MoEConfigError, SlowPathWarning
from moe.oracle import Plan, Policy
from moe.oracle.slow_path import slow_path
from moe.registry import experts_classes, get_experts
from moe.router import Router, TopK


def given_routing(router_logits, topk, topk_ids, topk_weights) -> TopK | None:
    """The precomputed routing as a `TopK` (ids int32, weights float32), or None when the layer routes
    ``router_logits`` itself; exactly one of the three ways must be given."""
    pair = topk_ids is not None or topk_weights is not None
    ways = [name for name, given in (("router_logits", router_logits is not None), ("topk", topk is not None),
                                     ("topk_ids/topk_weights", pair)) if given]
    if len(ways) != 1:
        raise MoEConfigError(
            "FusedMoE.forward takes its routing one way: router_logits [M, E], topk=TopK(...), or "
            f"topk_ids [M, k] with topk_weights [M, k] (got {' and '.join(ways) if ways else 'none of them'})"
        )
    if topk is not None or not pair:
        return topk
    if topk_ids is None or topk_weights is None:
        missing = "topk_weights" if topk_weights is None else "topk_ids"
        raise MoEConfigError(f"topk_ids and topk_weights go together; {missing} is missing")
    for name, value, kind, test in (("topk_ids", topk_ids, "an integer", _is_integer),
                                    ("topk_weights", topk_weights, "a floating-point", torch.is_floating_point)):
        if not isinstance(value, torch.Tensor) or not test(value):
            got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
            raise MoEConfigError(f"{name} must be {kind} torch.Tensor [M, k] (got {got})")
    return TopK(topk_ids.to(torch.int32), topk_weights.to(torch.float32))


def _is_integer(tensor: torch.Tensor) -> bool:
    return not tensor.is_floating_point() and not tensor.is_complex() and tensor.dtype != torch.bool


# what FusedMoE passes on to Router besides the routing, E and k (read from Router, not listed twice)
ROUTING_OPTIONS = tuple(f.name for f in dataclasses.fields(Router) if f.name not in ("routing", "num_experts", "top_k"))


def device_of(device: Any) -> torch.device:
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


def check_routing_options(options: dict) -> None:
    unknown = sorted(set(options) - set(ROUTING_OPTIONS))
    if unknown:
        raise MoEConfigError(
            f"FusedMoE got unknown keyword argument(s) {unknown}; besides its named arguments it takes the "
            f"routing options {', '.join(ROUTING_OPTIONS)}"
        )


def check_weight_on_input(router: Router) -> None:
    if router.kind.weight_on_input and router.top_k != 1:
        raise MoEConfigError(
            f"routing={router.routing!r} multiplies each expert's input by its router weight (Llama-4), which "
            f"this layer supports for top_k=1 only (got top_k={router.top_k}); each of k > 1 slots would need "
            "its own scaled input"
        )


def check_instance(name: str, value: Any, cls: type, example: str) -> None:
    if value is not None and not isinstance(value, cls):
        raise MoEConfigError(f"{name} must be a {cls.__name__} or None (got {type(value).__name__} {value!r}); {example}")


def warn_if_slow(layer_plan: Plan) -> None:
    """One SlowPathWarning when only the reference experts serve some bucket on a GPU (the same text
    from the same line is shown once per process: a model of many equal layers warns once)."""
    found = slow_path(layer_plan)
    if found is not None:
        warnings.warn(found.message(), SlowPathWarning, stacklevel=3)


def policy_with(policy: Policy | None, experts: str | None) -> Policy:
    """The given policy (or the environment's), forcing ``experts`` when given."""
    policy = Policy.from_env() if policy is None else policy
    if experts is None:
        return policy
    get_experts(experts)  # an unknown name is a MoEConfigError naming the registered ones
    return policy.forcing(experts, source=f"experts={experts!r}", replacing=experts_classes())


def on_device(options: dict, device: torch.device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in options.items()}
