"""One model experts module bound to one `moe.FusedMoE` (library-agnostic; the transformers integration
reads the module into a `ModuleSpec` and hands it here).

Lifecycle: read the module (a `ModuleSpec`, or the reason it cannot be served) -> canonical weights through
``moe.loaders`` (the module's in-memory layout) -> a `FusedMoE` the oracle composes for the shape, dtype
and device -> load. Weights are prepared once and again only when the module's parameters change: a
cheap signature (each parameter's identity, ``data_ptr``, ``_version``, dtype, device and shape, plus
top-k) is compared on every forward. In-place writes through ``param.data`` bypass the version counter
and are not seen; assign a new ``nn.Parameter`` or write under ``torch.no_grad()`` instead. A write into a
released parameter (below) raises `MoEConfigError`: its values live in the layer.

Memory: where the module stores the canonical layout (``transformers_fused``) and the backend keeps it
(torch_grouped, triton, fp32 reference), the layer uses the module's tensors in place. Where the module's
layout differs (the transposed ones: GPT-OSS, Ergo), the layer holds a converted copy and the
module's parameters are released: replaced by ``meta`` placeholders of the same shape and dtype.
``state_dict`` (so ``save_pretrained``) writes them back from the layer's weights, ``load_state_dict``
restores real parameters before loading (the next forward prepares again), and replacing a parameter
restores the others. A released module cannot run on another implementation (its forward pre-hook raises:
some ops would compute with the placeholders silently), nor be moved or cast (``model.to``):
``unuse_moe(model)`` gives the parameters back first. Where the chosen backend converts the weights itself
(FlashInfer), the module keeps its parameters and the weights are held twice.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Mapping
from typing import Any, Callable

import torch

from moe.activation import Activation
from moe.errors import MoEConfigError, UnsupportedError
from moe.layer import FusedMoE
from moe.loaders import load_experts, to_layout
from moe.oracle import Policy
from moe.weights import ExpertWeights
from moe.workspace import WorkspaceManager

IN_PLACE_LAYOUT = "transformers_fused"  # the canonical layout under transformers' names
_SCHEMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


class ExpertsFallbackWarning(UserWarning):
    """An experts module `moe` cannot serve runs on the library's own implementation instead."""


@dataclasses.dataclass(frozen=True)
class ModuleSpec:
    """What an experts module holds, as the integration read it."""

    layout: str  # its parameters' layout in moe.loaders: transformers_fused or one of the transposed two
    activation: Activation  # between the two GEMMs, with its parameters (GPT-OSS alpha/limit, ...)
    params: tuple[str, ...]  # the names of its expert parameters (gate_up_proj, down_proj, biases, ...)


@dataclasses.dataclass
class Options:
    """What every binding of one model shares: the layers' settings and one workspace per device (the
    layers run one after another, so one buffer serves them all)."""

    max_tokens: int = 1024
    experts: str | None = None
    policy: Policy | None = None
    workspaces: dict[torch.device, WorkspaceManager] = dataclasses.field(default_factory=dict)

    def workspace(self, device: torch.device) -> WorkspaceManager:
        return self.workspaces.setdefault(device, WorkspaceManager(device))


Reader = Callable[[torch.nn.Module], "ModuleSpec | str"]  # a spec, or why the module cannot be served


class Binding:
    """One experts module and the `FusedMoE` serving it (None while it falls back)."""

    def __init__(self, name: str, options: Options, read: Reader, serving: Callable[[torch.nn.Module], bool]):
        """``serving(module)``: whether a call of the module reaches this binding's layer now (the model still
        runs this implementation). A released module called otherwise raises instead of computing with
        placeholders, which some ops do silently (a CPU tensor times a meta one is a CPU tensor)."""
        self.name, self.options, self._read, self._serving = name, options, read, serving
        self.layer: FusedMoE | None = None
        self.spec: ModuleSpec | None = None
        self.reason: str | None = None  # why the module falls back, when it does
        self._signature: tuple | None = None
        self._placeholders: dict[str, torch.nn.Parameter] = {}  # released parameters -> their meta stand-ins
        self._versions: dict[str, int] = {}  # the placeholders' versions at release (a write bumps them)
        self._hooks: list = []

    # --- prepare ---------------------------------------------------------------------------------
    def current(self, module: torch.nn.Module, top_k: int) -> FusedMoE | None:
        """The layer for the module's parameters as they are now (prepared again if they changed), or None
        when the module falls back (warned once per reason)."""
        if self._signature is not None and torch.compiler.is_compiling():
            return self.layer  # prepared before compiling; the signature reads host-side state
        if signature(module, top_k) == self._signature:
            return self.layer
        with torch.inference_mode(False), torch.no_grad():
            self._restore(module)
            self._prepare(module, top_k)
            self._signature = signature(module, top_k)
        return self.layer

    def _prepare(self, module: torch.nn.Module, top_k: int) -> None:
        self.layer, self.spec = None, None
        read = self._read(module)
        if isinstance(read, str):
            return self._fall_back(read)
        meta = [n for n in read.params if module._parameters[n].device.type == "meta"]
        if meta:
            raise MoEConfigError(f"{self.name}: parameters {meta} are on the meta device (released, then moved "
                                 "or cast?); move or cast the model before moe.integrations binds it")
        try:
            weights = load_experts({f"experts.{n}": module._parameters[n].detach() for n in read.params},
                                   read.layout, num_experts=module._parameters[read.params[0]].shape[0])
            layer = self._build(weights, read.activation, top_k)
            layer.load_weights(w13=weights.w13.data, w2=weights.w2.data, b13=weights.b13, b2=weights.b2)
        except (MoEConfigError, UnsupportedError) as error:
            return self._fall_back(f"moe cannot serve it: {error}")
        self.layer, self.spec, self.reason = layer, read, None
        if read.layout != IN_PLACE_LAYOUT:
            self._release(module)

    def _build(self, weights: ExpertWeights, activation: Activation, top_k: int) -> FusedMoE:
        """The oracle's layer for these weights; one experts backend (the decode bucket's) so the weights are
        prepared once, not once per backend -- generation is decode-bound."""
        dtype, options = weights.w13.data.dtype, self.options
        sizes = (weights.num_experts, top_k, weights.hidden_size, weights.intermediate_size)
        settings = dict(activation=activation, quant=_SCHEMES[dtype], has_bias=weights.has_bias, dtype=dtype,
                        device=weights.device, max_tokens=options.max_tokens, policy=options.policy,
                        workspace=options.workspace(weights.device))
        layer = FusedMoE(*sizes, experts=options.experts, **settings)
        chosen = {bucket.chosen.pair.experts for bucket in layer.plan.buckets}
        if options.experts is None and len(chosen) > 1:
            layer = FusedMoE(*sizes, experts=layer.plan.buckets[0].chosen.pair.experts, **settings)
        return layer

    def _fall_back(self, reason: str) -> None:
        if reason != self.reason:
            warnings.warn(f"{self.name} runs on its own implementation, not moe: {reason}",
                          ExpertsFallbackWarning, stacklevel=4)
        self.reason = reason

    # --- release and restore ---------------------------------------------------------------------
    def _release(self, module: torch.nn.Module) -> None:
        """Replaces the module's expert parameters by meta placeholders; state_dict writes them back."""
        for name in self.spec.params:
            param = module._parameters[name]
            placeholder = torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"),
                                             requires_grad=param.requires_grad)
            module._parameters[name] = self._placeholders[name] = placeholder
            self._versions[name] = placeholder._version
        if not self._hooks:
            # partials: torch marks a state_dict hook with an attribute, which a bound method cannot take
            self._hooks = [module.register_state_dict_post_hook(functools.partial(Binding._write_state, self)),
                           module.register_load_state_dict_pre_hook(functools.partial(Binding._before_load, self)),
                           module.register_forward_pre_hook(self._refuse_other_implementations)]

    def _released(self, module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
        """The placeholders still standing in the module (one the user replaced is theirs again)."""
        return {n: p for n, p in self._placeholders.items() if module._parameters.get(n) is p}

    def _refuse_other_implementations(self, module: torch.nn.Module, args) -> None:
        if self._serving(module):  # every forward passes here: the cheap test first
            return
        released = list(self._released(module))
        if released:
            raise MoEConfigError(
                f"{self.name}: {released} were released to moe (their values live in the layer, converted), so it "
                "cannot run on another implementation; call unuse_moe(model) first, which gives them back"
            )

    def detach(self, module: torch.nn.Module) -> None:
        """Gives the module its released parameters back and removes this binding's hooks."""
        with torch.inference_mode(False), torch.no_grad():
            self._restore(module, check=False)
        for hook in self._hooks:
            hook.remove()
        self._hooks, self.layer, self._signature = [], None, None

    def _originals(self) -> dict[str, torch.Tensor]:
        """The released parameters' values, rebuilt from the layer's weights in their own dtypes."""
        tensors = to_layout(self.layer.weights, self.spec.layout, dtype=self.layer.problem.dtype)
        return {name: tensors["experts." + name].to(p.dtype) for name, p in self._placeholders.items()}

    def _restore(self, module: torch.nn.Module, *, check: bool = True) -> None:
        """Real parameters again for every placeholder still in place (one the user replaced stays theirs);
        ``check`` refuses placeholders written into (the write went nowhere)."""
        released = self._released(module)
        written = [n for n, p in released.items() if check and p._version != self._versions[n]]
        if written:
            raise MoEConfigError(
                f"{self.name}: {written} were written in place, but moe released them (their values live in the "
                "layer, converted); assign a new nn.Parameter, load_state_dict, or call unuse_moe(model) first"
            )
        if released:
            values = self._originals()
            for name, placeholder in released.items():
                module._parameters[name] = torch.nn.Parameter(values[name], requires_grad=placeholder.requires_grad)
        self._placeholders = {}

    def _write_state(self, module, state_dict, prefix, local_metadata) -> None:
        released = self._released(module)
        if released:
            values = self._originals()
            for name in released:
                state_dict[prefix + name] = values[name]

    def _before_load(self, module, state_dict, prefix, *args) -> None:
        with torch.no_grad():
            self._restore(module)  # load_state_dict copies into real tensors; the next forward prepares again

    # --- run -------------------------------------------------------------------------------------
    def run(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The layer on ``hidden [..., H]`` in chunks of at most max_tokens rows, in ``hidden``'s dtype."""
        layer, shape = self.layer, hidden.shape
        x = hidden.reshape(-1, shape[-1]).to(layer.problem.dtype)
        ids, weights = topk_ids.reshape(x.shape[0], -1), topk_weights.reshape(x.shape[0], -1)
        step = layer.problem.max_tokens
        outs = [layer(x[i:i + step], topk_ids=ids[i:i + step], topk_weights=weights[i:i + step], validate=False)
                for i in range(0, max(x.shape[0], 1), step)]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out.to(hidden.dtype).reshape(shape)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the layer holds beyond the workspace (its weights and what its kernels prepared)."""
        if self.layer is None:
            return []
        found: list[torch.Tensor] = []
        _collect(self.layer.weights, found, depth=0)
        for kernel in self.layer.kernels.values():
            _collect(kernel.prepared_weights, found, depth=0)
        return found


def signature(module: torch.nn.Module, top_k: int) -> tuple:
    """What, if it changes, makes the module's weights need preparing again (cheap: no data is read)."""
    params = tuple((name, id(p), p.data_ptr(), p._version, p.dtype, p.device, tuple(p.shape))
                   for name, p in module._parameters.items() if p is not None)
    flags = (getattr(module, "_is_expert_parallel", False), getattr(module, "has_post_expert_norm", False),
             id(getattr(module, "act_fn", None)))
    return (top_k, flags, params)


def _collect(value: Any, found: list[torch.Tensor], depth: int) -> None:
    """The tensors inside ``value`` (dataclasses, mappings, sequences, plain objects), a few levels deep."""
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif depth > 4 or value is None or isinstance(value, (str, int, float, bool, torch.dtype, torch.device)):
        return
    elif dataclasses.is_dataclass(value):
        for field in dataclasses.fields(value):
            _collect(getattr(value, field.name), found, depth + 1)
    elif isinstance(value, Mapping):
        for item in value.values():
            _collect(item, found, depth + 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect(item, found, depth + 1)
    elif hasattr(value, "__dict__"):
        _collect(vars(value), found, depth + 1)
