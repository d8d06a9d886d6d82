"""Loaders for shared experts: a checkpoint's shared MLP -> the dense weights of `moe.shared.SharedExperts`.

``read_shared(tensors, layout, prefix="model.layers.3.mlp.", ...)`` returns ``{"w13": [2I, H] rows
[gate; up] (non-gated: [I, H]), "w2": [H, I], "gate": [1, H] or None}``. The layouts, as transformers
5.24's modeling code defines them (``nn.Linear(in, out)`` stores ``[out, in]``, no biases; keys follow
the MoE block's ``prefix``):

``deepseek`` -- ``DeepseekV3MoE.shared_experts`` (a ``DeepseekV3MLP`` of I = ``moe_intermediate_size *
    n_shared_experts``) and ``DeepseekV4SparseMoeBlock.shared_experts`` (a ``DeepseekV4MLP`` of I =
    ``moe_intermediate_size``, whose clamped SiLU is ``Activation.parse("swiglu_oai", alpha=1, beta=0,
    limit=swiglu_limit)``): ``shared_experts.{gate_proj,up_proj}.weight [I, H]``,
    ``shared_experts.down_proj.weight [H, I]``; forward ``down(act(gate(x)) * up(x))``, added to the
    routed output. Block: ``model.layers.{l}.mlp.``.
``qwen2_moe`` -- ``Qwen2MoeSparseMoeBlock.shared_expert`` (a ``Qwen2MoeMLP`` of I =
    ``shared_expert_intermediate_size``) and ``shared_expert_gate = Linear(H, 1)``:
    ``shared_expert.{gate_proj,up_proj,down_proj}.weight`` as above and ``shared_expert_gate.weight
    [1, H]``; forward ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``. Block: ``model.layers.{l}.mlp.``.
``nemotron_h`` -- ``NemotronHMoE.shared_experts`` (a ``NemotronHMLP`` of I =
    ``moe_shared_expert_intermediate_size``, ``mlp_hidden_act`` relu2, non-gated):
    ``shared_experts.up_proj.weight [I, H]``, ``shared_experts.down_proj.weight [H, I]``; forward
    ``down(relu(up(x))**2)``. Block: ``model.layers.{l}.mixer.`` (``backbone.layers.{l}.mixer.`` in
    NVIDIA's own checkpoints).
``llama4`` -- ``Llama4TextMoe.shared_expert`` (a ``Llama4TextMLP`` of I = ``intermediate_size``, the
    routed experts' I): ``shared_expert.{gate_proj,up_proj,down_proj}.weight`` as in deepseek. Block:
    ``model.layers.{l}.feed_forward.`` (``language_model.model.layers.{l}.feed_forward.`` in the
    multimodal checkpoints).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from moe.errors import MoEConfigError, UnsupportedError
from moe.loaders import _Checkpoint


@dataclass(frozen=True)
class SharedLayout:
    """Where one model family keeps its shared MLP, relative to the MoE block's prefix."""

    name: str
    module: str  # the MLP's key prefix: "shared_experts."
    gate_proj: str | None  # the gate projection's module name; None for a non-gated MLP
    sigmoid_gate: str | None = None  # the key of Linear(H, 1)'s weight, where the model gates the output


SHARED_LAYOUTS: dict[str, SharedLayout] = {
    layout.name: layout for layout in (
        SharedLayout("deepseek", "shared_experts.", "gate_proj"),
        SharedLayout("qwen2_moe", "shared_expert.", "gate_proj", "shared_expert_gate.weight"),
        SharedLayout("nemotron_h", "shared_experts.", None),
        SharedLayout("llama4", "shared_expert.", "gate_proj"),
    )
}
# the shared layout that goes with a routed layout of moe.loaders (Qwen2-MoE's routed experts are
# stored as Qwen3-MoE's); other models name theirs with shared_layout=
DEFAULT_SHARED_LAYOUT = {"deepseek": "deepseek", "qwen3": "qwen2_moe"}


def read_shared(tensors: Mapping[str, torch.Tensor], layout: str, *, prefix: str = "", hidden_size: int,
                intermediate_size: int, gated: bool, sigmoid_gate: bool) -> dict[str, torch.Tensor | None]:
    """The shared MLP stored in ``layout`` under ``prefix``, for a module of H=``hidden_size``,
    I=``intermediate_size``, a gated activation or not, a sigmoid gate or not. Raises `MoEConfigError`
    naming the key for a missing key, a wrong shape or dtype and NaN, and naming the layout when its
    kind of MLP is not the module's; `UnsupportedError` for biases (``mlp_bias=True``)."""
    found = _layout(layout)
    if not isinstance(tensors, Mapping):
        raise MoEConfigError(f"tensors: expected a mapping of key -> torch.Tensor such as a state dict "
                             f"(got {type(tensors).__name__})")
    _check_kind(found, gated, sigmoid_gate)
    checkpoint = _Checkpoint(tensors, prefix, f"{layout} (shared experts)",
                             f" (the shared experts have H={hidden_size}, I={intermediate_size})")
    names = ("up_proj", "down_proj") + ((found.gate_proj,) if found.gate_proj else ())
    biases = [found.module + n + ".bias" for n in names if checkpoint.has(found.module + n + ".bias")]
    if biases:
        raise UnsupportedError(f"shared experts with biases are not supported (found {prefix + biases[0]!r})", [])
    shape = (intermediate_size, hidden_size)
    up = checkpoint.get(found.module + "up_proj.weight", "[I, H]", shape)
    down = checkpoint.get(found.module + "down_proj.weight", "[H, I]", (hidden_size, intermediate_size))
    w13 = up
    if found.gate_proj is not None:
        w13 = torch.cat([checkpoint.get(found.module + found.gate_proj + ".weight", "[I, H]", shape), up])
    gate = checkpoint.get(found.sigmoid_gate, "[1, H]", (1, hidden_size)) if found.sigmoid_gate else None
    return {"w13": w13, "w2": down, "gate": gate}


def shared_layout_for(layout: str, shared_layout: str | None) -> str:
    """The shared layout a layer loaded from routed ``layout`` reads: ``shared_layout`` when given,
    else the one that goes with ``layout`` (`DEFAULT_SHARED_LAYOUT`)."""
    if shared_layout is not None:
        return _layout(shared_layout).name
    if layout not in DEFAULT_SHARED_LAYOUT:
        raise MoEConfigError(
            f"shared_layout: the {layout!r} layout has no shared experts of its own; pass shared_layout= one of "
            f"{tuple(SHARED_LAYOUTS)} to say where this checkpoint keeps them")
    return DEFAULT_SHARED_LAYOUT[layout]


def _layout(name: str) -> SharedLayout:
    if name not in SHARED_LAYOUTS:
        raise MoEConfigError(f"layout: unknown shared-expert layout {name!r}; choose one of {tuple(SHARED_LAYOUTS)}")
    return SHARED_LAYOUTS[name]


def _check_kind(layout: SharedLayout, gated: bool, sigmoid_gate: bool) -> None:
    """The layout must store the module's kind of MLP (gated or not, sigmoid gate or not)."""
    if (layout.gate_proj is not None) != gated:
        stores, module = ("a gated", "non-gated") if layout.gate_proj else ("a non-gated", "gated")
        raise MoEConfigError(f"layout {layout.name!r} stores {stores} shared MLP but the shared experts have a "
                             f"{module} activation; build them with the model's activation")
    if (layout.sigmoid_gate is not None) != sigmoid_gate:
        has = "has" if layout.sigmoid_gate else "has no"
        raise MoEConfigError(f"layout {layout.name!r} {has} a sigmoid gate (shared_expert_gate) but the shared "
                             f"experts were built with sigmoid_gate={sigmoid_gate}; build them with "
                             f"sigmoid_gate={layout.sigmoid_gate is not None}")
