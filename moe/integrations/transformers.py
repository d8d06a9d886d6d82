"""Hugging Face transformers (>= 5) models with their MoE experts on `moe.FusedMoE`.

Importing this module registers ``"moe"`` in transformers' experts interface (the mechanism behind
``experts_implementation="grouped_mm"``), so either of these runs every MoE layer's experts on a
`FusedMoE` the oracle composes for that layer's shape, dtype (bf16, fp16, fp32) and device::

    import moe.integrations.transformers as moe_hf
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="moe")  # prepared at first forward
    moe_hf.use_moe(model)  # or on a loaded model: switches it and prepares every layer now

The experts module hands over ``(hidden_states [M, H], top_k_index [M, k], top_k_weights [M, k])``; the
model's own router has chosen the experts, and the weights are used as given. What the module holds
decides the layer: ``gate_up_proj [E, 2I, H]`` rows ``[gate; up]`` (Qwen3-MoE, Mixtral, DeepSeek-V3/V4),
``up_proj [E, I, H]`` without a gate (Nemotron-H, relu2; with a latent MoE, H is the latent size: the
projections to and from it stay outside the experts), GPT-OSS's transposed, interleaved
``gate_up_proj [E, H, 2I]`` with biases, or the transposed ``[gate | up]`` halves of OpenAI's privacy filter,
or a transposed ``up_proj [E, H, I]`` without a gate (Ergo, whose experts module calls the decorated projections
with one route per row and normalizes each route's output). The activation comes from the module: ``act_fn``
(silu, gelu, relu2), or a gate function it knows (`_GATES`): GPT-OSS's and the privacy filter's clamped SwiGLU
(their ``alpha`` and ``limit``), DeepSeek-V4's and HY-V4's clamped SiLU (``swiglu_oai`` with alpha=1, beta=0),
Ling's without a limit.

A module `moe` cannot serve -- expert parallel, a post-expert norm, quantized weights, an unknown
activation or gate function, a layout it does not read, or a shape the oracle refuses -- runs on the
module's own (eager) forward, with one `ExpertsFallbackWarning` naming the module and the reason.
Preparing, re-preparing and memory (in place where the layouts agree; released and written back by
``state_dict`` where they do not) are described in ``moe.integrations._binding``. ``torch.compile(model)``
of a patched model (``fullgraph=True`` too) sees each layer as one ``moe::fused_moe`` call; call
``use_moe`` before compiling, since a compiled forward does not prepare or re-prepare weights.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
import transformers
from transformers.activations import GELUActivation, ReLUSquaredActivation, SiLUActivation
from transformers.integrations.moe import ExpertsInterface, _default_apply_gate

from moe.activation import Activation
from moe.errors import MoEConfigError
from moe.integrations._binding import Binding, ExpertsFallbackWarning, ModuleSpec, Options
from moe.oracle import Policy
from moe.weights import DENSE_DTYPES

__all__ = ["IMPLEMENTATION", "ExpertsFallbackWarning", "memory_bytes", "moe_experts_forward", "unuse_moe", "use_moe"]

IMPLEMENTATION = "moe"
_BINDING = "_moe_binding"  # the attribute of an experts module that holds its Binding
# options of models that switched through from_pretrained(experts_implementation="moe") rather than
# use_moe: one per model config, so the layers of a model share one workspace; dropped with the config
_LAZY_OPTIONS: dict[int, Options] = {}
_ACTIVATIONS = ((SiLUActivation, "silu"), (torch.nn.SiLU, "silu"), (GELUActivation, "gelu"),
                (ReLUSquaredActivation, "relu2"))
# act_fn as a function rather than a module (LFM2-MoE's F.silu); F.gelu's default is the exact (erf) GELU
_FUNCTIONS = ((torch.nn.functional.silu, "silu"), (torch.nn.functional.gelu, "gelu"))


def moe_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``"moe"`` experts implementation: ``[M, H]`` from the module's weights on a `FusedMoE`, or the
    module's own forward where moe cannot serve it."""
    binding = self.__dict__.get(_BINDING) or _lazy_binding(self)
    layer = binding.current(self, top_k_index.shape[-1])
    if layer is None:
        return _own_forward(self)(self, hidden_states, top_k_index, top_k_weights)
    return binding.run(hidden_states, top_k_index, top_k_weights)


def use_moe(model: torch.nn.Module, *, max_tokens: int = 1024, experts: str | None = None,
            policy: Policy | None = None) -> dict[str, str]:
    """Switches ``model`` to ``experts_implementation="moe"`` and prepares every experts module now.

    ``max_tokens`` bounds the rows one layer call takes (longer inputs run in chunks) and so the workspace,
    which all layers share; ``experts`` forces one backend and ``policy`` replaces the environment's, as
    for `FusedMoE`. Returns ``{module name: what serves it}`` (a kernel, or ``"fallback: <reason>"``).
    Call it again to change the options; the weights are prepared again.
    """
    if not isinstance(model, transformers.PreTrainedModel):
        raise MoEConfigError(f"model must be a transformers PreTrainedModel (got {type(model).__name__})")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise MoEConfigError(f"max_tokens must be a positive int (got {max_tokens!r})")
    model.set_experts_implementation(IMPLEMENTATION)
    options, report = Options(max_tokens, experts, policy), {}
    for name, module in model.named_modules():
        if not _is_experts(module):
            continue
        binding = Binding(name, options, _read, _serving)
        old = module.__dict__.get(_BINDING)
        if old is not None:
            old.detach(module)  # gives released parameters back before the new binding reads them
        module.__dict__[_BINDING] = binding
        top_k = getattr(getattr(module, "config", None), "num_experts_per_tok", None)
        if top_k is None:
            report[name] = "prepared at the first forward (the config names no num_experts_per_tok)"
            continue
        layer = binding.current(module, top_k)
        report[name] = f"fallback: {binding.reason}" if layer is None else repr(layer.kernel)
    return report


def unuse_moe(model: torch.nn.Module, implementation: str = "grouped_mm") -> None:
    """Switches ``model`` to another experts implementation, giving every released parameter back first
    (a module whose parameters moe released cannot run on another implementation until then)."""
    for module in model.modules():
        binding = module.__dict__.pop(_BINDING, None)
        if binding is not None:
            binding.detach(module)
    model.set_experts_implementation(implementation)


def memory_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes the model holds: ``model`` (its parameters and buffers, released ones not counted), ``moe``
    (what the layers hold beyond them: converted or prepared weights) and ``workspace`` (shared buffers).
    Tensors sharing storage count once."""
    seen: set[tuple] = set()

    def size(tensors) -> int:
        total = 0
        for tensor in tensors:
            if tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            key = (str(tensor.device), storage.data_ptr())
            if key not in seen and storage.nbytes():
                seen.add(key)
                total += storage.nbytes()
        return total

    bindings = [m.__dict__[_BINDING] for m in model.modules() if _BINDING in m.__dict__]
    counts = {"model": size(list(model.parameters()) + list(model.buffers()))}
    counts["moe"] = size(t for b in bindings for t in b.tensors())
    managers = {id(w): w for b in bindings for w in b.options.workspaces.values()}.values()
    counts["workspace"] = size(w._buffer for w in managers)
    return counts


# --- reading a module ------------------------------------------------------------------------------
def _read(module: torch.nn.Module) -> ModuleSpec | str:
    """The module as moe serves it, or why it cannot."""
    if getattr(module, "_is_expert_parallel", False):
        return "it is expert parallel (_is_expert_parallel=True); moe's expert parallelism is its own"
    if getattr(module, "has_post_expert_norm", False):
        return "it normalizes each expert's output (has_post_expert_norm=True), which moe does not"
    layout = _layout(module)
    if layout.startswith("its "):
        return layout
    first = "gate_up_proj" if module.has_gate else "up_proj"
    params = tuple(n for n in (first, "down_proj", first + "_bias", "down_proj_bias")
                   if isinstance(module._parameters.get(n), torch.Tensor))
    if first not in params or "down_proj" not in params:
        return f"it has no {first} and down_proj parameters"
    quantized = sorted({str(module._parameters[n].dtype) for n in params} - {str(d) for d in DENSE_DTYPES})
    if quantized or len({module._parameters[n].dtype for n in params[:2]}) > 1:
        return f"its weights are {quantized or 'of two dtypes'}; moe serves bf16, fp16 and fp32 modules"
    activation = _activation(module)
    if isinstance(activation, str):
        return activation
    return ModuleSpec(layout, activation, params)


def _layout(module: torch.nn.Module) -> str:
    """The module's parameter layout in moe.loaders, or a reason starting with "its "."""
    transposed, concatenated = module.is_transposed, module.is_concatenated or not module.has_gate
    if not transposed and concatenated:  # without a gate there is nothing to interleave
        return "transformers_fused"
    if transposed:
        return "transformers_transposed" if concatenated else "transformers_fused_transposed"
    return f"its layout (is_transposed={transposed}, is_concatenated={concatenated}) is not one moe reads"


def _clamped(alpha, beta: float, limit) -> Activation | str:
    """The gates that clamp GPT-OSS's way -- gate at most ``limit``, up within +-limit -- then return
    ``(up + beta) * gate * sigmoid(alpha * gate)``: moe's swiglu_oai."""
    if limit is None:
        return "its clamped gate has no limit"
    return Activation.parse("swiglu_oai", alpha=float(alpha), beta=beta, limit=float(limit))


# The gate functions of transformers' experts modules that moe computes, by (model folder, qualified name): each
# gives the module's Activation, or why not, from the module and its act_fn's name.
_GATES: dict[tuple[str, str], Callable[[torch.nn.Module, str], Activation | str]] = {
    ("gpt_oss", "GptOssExperts._apply_gate"): lambda m, act: _clamped(m.alpha, 1.0, m.limit),
    # GPT-OSS's gate on [gate | up] halves instead of interleaved columns (the layout tells them apart)
    ("openai_privacy_filter", "OpenAIPrivacyFilterExperts._apply_gate"): lambda m, act: _clamped(m.alpha, 1.0, m.limit),
    # silu(clamped gate) * clamped up: alpha 1, beta 0
    ("deepseek_v4", "DeepseekV4Experts._apply_gate"):
        lambda m, act: _clamped(1.0, 0.0, m.limit) if act == "silu" else f"its clamped {act} gate is not silu",
    ("hy_v4", "HYV4Experts._apply_gate"): lambda m, act: _clamped(1.0, 0.0, m.swiglu_limit),  # F.silu, not act_fn
    # Ling clamps the gate after its activation, which moe does not compute; without a limit it is act(gate) * up
    ("bailing_hybrid", "BailingHybridExperts._apply_gate"):
        lambda m, act: (Activation.parse(act) if m.limit is None and act in ("silu", "gelu") else
                        f"its gate clamps {act}(gate) at limit={m.limit} after the activation, which moe does not"),
}


def _activation(module: torch.nn.Module) -> Activation | str:
    act = _act_name(getattr(module, "act_fn", None))
    if not module.has_gate:
        return Activation.parse("relu2") if act == "relu2" else f"its non-gated activation {act} is not relu2"
    gate = type(module)._apply_gate
    if gate is _default_apply_gate:
        if act in ("silu", "gelu"):
            return Activation.parse(act)
        return f"its activation {act} is not one moe computes (silu, gelu gated; relu2 non-gated)"
    parts = gate.__module__.split(".")  # transformers.models.<folder>.modeling_<folder>
    known = _GATES.get((parts[2] if parts[:2] == ["transformers", "models"] and len(parts) > 2 else "",
                        gate.__qualname__))
    if known is None:
        return f"its gate function {gate.__qualname__} is not one moe knows"
    return known(module, act)


def _act_name(act_fn: object) -> str:
    for cls, name in _ACTIVATIONS:
        if type(act_fn) is cls:
            return name
    for function, name in _FUNCTIONS:
        if act_fn is function:
            return name
    return getattr(act_fn, "__name__", None) or type(act_fn).__name__  # a function by its name, a module by its class


# --- plumbing -------------------------------------------------------------------------------------
def _is_experts(module: torch.nn.Module) -> bool:
    """An experts module transformers dispatches through the experts interface."""
    return all(hasattr(module, a) for a in ("has_gate", "is_transposed", "is_concatenated", "_is_expert_parallel"))


def _serving(module: torch.nn.Module) -> bool:
    """The module's model still dispatches its experts to this implementation."""
    return getattr(getattr(module, "config", None), "_experts_implementation", None) == IMPLEMENTATION


def _lazy_binding(module: torch.nn.Module) -> Binding:
    """The binding of a module first met in a forward (the model was switched without use_moe), with the
    options its model's other layers share."""
    config, options = getattr(module, "config", None), Options()
    if config is not None:
        key = id(config)
        if key not in _LAZY_OPTIONS:
            _LAZY_OPTIONS[key] = options
            weakref.finalize(config, _LAZY_OPTIONS.pop, key, None)
        options = _LAZY_OPTIONS[key]
    name = f"a {type(module).__name__} (use_moe(model) names it)"
    binding = module.__dict__[_BINDING] = Binding(name, options, _read, _serving)
    return binding


def _own_forward(module: torch.nn.Module):
    """The forward use_experts_implementation wrapped (with functools.wraps), as written. It is the one of the
    class the decorator wrapped, which need not be the module's own: a subclass may override forward and
    call the wrapped one through super() (Ergo's ErgoExperts normalizes each route's output around it), and
    falling back to that override would call back into this implementation without end."""
    for cls in type(module).__mro__:
        forward = cls.__dict__.get("forward")
        if forward is not None and hasattr(forward, "__wrapped__"):
            return forward.__wrapped__
    return type(module).forward


def _register() -> None:
    ExpertsInterface.register(IMPLEMENTATION, moe_experts_forward)
    try:  # fp8 experts dispatch through their own interface; there "moe" falls back (quantized weights)
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    except ImportError:
        return
    FP8ExpertsInterface.register(IMPLEMENTATION, moe_experts_forward)


_register()
