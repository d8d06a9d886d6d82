"""Model presets: the MoE layer shapes of known models, one YAML file per model in this folder.

Schema (every key required but the last, no others)::

    name: mixtral-8x7b                 # str, equal to the file's stem
    source: mistralai/Mixtral-8x7B-v0.1  # str, the Hugging Face model id the numbers come from
    num_experts: 8                     # int, E (routed experts; shared experts are not part of it)
    top_k: 2                           # int, k
    hidden_size: 4096                  # int, H
    intermediate_size: 14336           # int, I of one routed expert (HF: moe_intermediate_size)
    activation: silu                   # str, one of moe.activation.ACTIVATION_NAMES
    routing: softmax                   # str, one of moe.router.ROUTING_NAMES
    routing_options:                   # mapping, may be empty ({}); keys from ROUTING_OPTION_KEYS:
      renormalize: true                #   Router options (n_group, topk_group, routed_scaling_factor too)
      has_correction_bias: false       #   the checkpoint holds e_score_correction_bias [E] (deepseek_v3)
    has_bias: false                    # bool, experts have biases b13/b2
    quant: bf16                        # str, the checkpoint's own scheme (moe.quant.scheme.SCHEME_NAMES)
    notes: ...                         # str, where the numbers come from and what is approximate
    shared_intermediate_size: 2048     # int, optional: I of the shared experts' dense MLP (same activation;
                                       #   DeepSeek: moe_intermediate_size * n_shared_experts); absent: none

A comment in each file cites the config.json the numbers were read from.

>>> preset = load_preset("mixtral-8x7b")
>>> preset.problem(max_tokens=256).intermediate_size
14336
>>> preset.scaled(max_hidden=256, max_intermediate=128, max_experts=4).name
'mixtral-8x7b-scaled'
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from moe.activation import Activation
from moe.errors import MoEConfigError
from moe.problem import MoEProblem
from moe.quant.scheme import SCHEME_NAMES
from moe.router import Router
from moe.shared import SharedExpertsConfig

PRESET_DIR = Path(__file__).parent

# The Router keyword arguments a preset may set, plus has_correction_bias (a fact about the weights).
ROUTER_OPTION_KEYS = ("renormalize", "n_group", "topk_group", "routed_scaling_factor")
ROUTING_OPTION_KEYS = ROUTER_OPTION_KEYS + ("has_correction_bias",)

# Every key of a preset file and the Python types its value may have.
_SCHEMA: dict[str, tuple[type, ...]] = {
    "name": (str,),
    "source": (str,),
    "num_experts": (int,),
    "top_k": (int,),
    "hidden_size": (int,),
    "intermediate_size": (int,),
    "activation": (str,),
    "routing": (str,),
    "routing_options": (dict,),
    "has_bias": (bool,),
    "quant": (str,),
    "notes": (str,),
}
_OPTIONAL: dict[str, tuple[type, ...]] = {"shared_intermediate_size": (int,)}

_SCALED_SUFFIX = "-scaled"
# mxfp4 and mxfp8 scale every 32 elements along K, and both H and I are a K.
_SCALED_MULTIPLE = 32


@dataclass(frozen=True)
class Preset:
    """One model's MoE layer, as read from its YAML file (see the module docstring for the fields).

    ``routing_options`` is stored as a sorted tuple of ``(key, value)`` pairs so that the preset
    stays immutable and hashable; a dict given to the constructor is converted.
    """

    name: str
    source: str  # Hugging Face model id
    num_experts: int  # E
    top_k: int  # k
    hidden_size: int  # H
    intermediate_size: int  # I
    activation: str  # activation name
    routing: str  # routing name
    routing_options: tuple[tuple[str, Any], ...]  # see ROUTING_OPTION_KEYS
    has_bias: bool  # expert biases b13/b2
    quant: str  # the checkpoint's quantization scheme name
    notes: str = ""
    shared_intermediate_size: int = 0  # I of the shared experts' MLP; 0: the model has none

    def __post_init__(self):
        options = self.routing_options
        if isinstance(options, dict):
            options = tuple(sorted(options.items()))
            object.__setattr__(self, "routing_options", options)
        unknown = sorted(k for k, _ in options if k not in ROUTING_OPTION_KEYS)
        if unknown:
            raise MoEConfigError(
                f"routing_options: unknown key(s) {unknown} in preset {self.name!r}; "
                f"allowed: {ROUTING_OPTION_KEYS}"
            )
        has_correction_bias = dict(options).get("has_correction_bias", False)
        if not isinstance(has_correction_bias, bool):
            raise MoEConfigError(
                f"routing_options.has_correction_bias must be a bool (got {has_correction_bias!r}) "
                f"in preset {self.name!r}"
            )
        if has_correction_bias and self.routing != "deepseek_v3":
            raise MoEConfigError(
                f"routing_options.has_correction_bias=true needs routing='deepseek_v3' "
                f"(got routing={self.routing!r}) in preset {self.name!r}"
            )
        if self.quant not in SCHEME_NAMES:
            raise MoEConfigError(
                f"quant must be one of {SCHEME_NAMES} (got {self.quant!r}) in preset {self.name!r}"
            )
        Router(self.routing, self.num_experts, self.top_k, **self.router_options())  # validates routing
        self.problem()  # validates shapes, activation and quant together
        if isinstance(self.shared_intermediate_size, bool) or not isinstance(self.shared_intermediate_size, int) \
                or self.shared_intermediate_size < 0:
            raise MoEConfigError(f"shared_intermediate_size must be an int >= 0, 0 for none (got "
                                 f"{self.shared_intermediate_size!r}) in preset {self.name!r}")

    def shared_experts(self) -> SharedExpertsConfig | None:
        """The shared experts of this model (the layer's activation), or None when it has none."""
        return SharedExpertsConfig(self.shared_intermediate_size) if self.shared_intermediate_size else None

    @property
    def options(self) -> dict[str, Any]:
        """``routing_options`` as a new dict."""
        return dict(self.routing_options)

    @property
    def has_correction_bias(self) -> bool:
        """True if the checkpoint holds a per-expert correction bias for the router."""
        return bool(self.options.get("has_correction_bias", False))

    @property
    def is_scaled(self) -> bool:
        """True for a copy made by `scaled` (its numbers are not the model's)."""
        return self.name.endswith(_SCALED_SUFFIX)

    def router_options(self) -> dict[str, Any]:
        """Keyword arguments for `moe.router.Router` besides routing/num_experts/top_k.

        ``correction_bias`` is a weight, so it is not here; pass it alongside when
        ``has_correction_bias`` is true.
        """
        return {k: v for k, v in self.routing_options if k in ROUTER_OPTION_KEYS}

    def router(self, correction_bias: torch.Tensor | None = None) -> Router:
        """The preset's `Router`; ``correction_bias`` is the checkpoint's ``[E]`` tensor, if any."""
        return Router(
            self.routing,
            self.num_experts,
            self.top_k,
            correction_bias=correction_bias,
            **self.router_options(),
        )

    def problem(
        self, *, quant: str | None = None, dtype: torch.dtype | None = None, **kwargs: Any
    ) -> MoEProblem:
        """The `MoEProblem` of this layer; ``quant`` defaults to the checkpoint's scheme.

        Other keyword arguments (``max_tokens``, ``parallel``, ``has_bias``) go to `MoEProblem.create`.
        """
        kwargs.setdefault("has_bias", self.has_bias)
        return MoEProblem.create(
            num_experts=self.num_experts,
            top_k=self.top_k,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            activation=Activation.parse(self.activation),
            quant=self.quant if quant is None else quant,
            dtype=dtype,
            **kwargs,
        )

    def scaled(self, max_hidden: int, max_intermediate: int, max_experts: int) -> Preset:
        """A smaller copy for CPU demos, named ``<name>-scaled`` (scaling it again keeps the name).

        H and I shrink to at most ``max_hidden``/``max_intermediate``, rounded down to multiples of
        32 (never below 32); E to at most ``max_experts``. Routing groups shrink with E so they stay
        valid (n_group the largest divisor of E that is <= the original and leaves >= 2 experts per
        group, topk_group <= n_group) and k shrinks to what the kept groups can hold.
        """
        for name, value, least in (
            ("max_hidden", max_hidden, _SCALED_MULTIPLE),
            ("max_intermediate", max_intermediate, _SCALED_MULTIPLE),
            ("max_experts", max_experts, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise MoEConfigError(f"{name} must be an int >= {least} (got {value!r})")
        num_experts = min(self.num_experts, max_experts)
        options = self.options
        top_k = min(self.top_k, num_experts)
        if options.get("n_group") is not None:
            top_k = _scale_groups(options, num_experts, top_k)
        note = (  # a scaled copy of a scaled copy keeps the model's numbers in its notes
            ""
            if self.is_scaled
            else f"Scaled for demos from E={self.num_experts}, k={self.top_k}, H={self.hidden_size}, "
            f"I={self.intermediate_size}. "
        )
        return dataclasses.replace(
            self,
            name=self.name if self.is_scaled else self.name + _SCALED_SUFFIX,
            num_experts=num_experts,
            top_k=top_k,
            hidden_size=_round_down(min(self.hidden_size, max_hidden)),
            intermediate_size=_round_down(min(self.intermediate_size, max_intermediate)),
            shared_intermediate_size=self.shared_intermediate_size and _round_down(
                min(self.shared_intermediate_size, max_intermediate)),
            routing_options=options,
            notes=note + self.notes,
        )


def _round_down(size: int) -> int:
    return max(_SCALED_MULTIPLE, size // _SCALED_MULTIPLE * _SCALED_MULTIPLE)


def _scale_groups(options: dict[str, Any], num_experts: int, top_k: int) -> int:
    """Shrinks n_group/topk_group in ``options`` (in place) for E=``num_experts``; returns the new k."""
    if num_experts < 2:
        raise MoEConfigError(
            f"max_experts must be >= 2 for a grouped routing (n_group={options['n_group']}): "
            f"a group is scored by its top-2 experts (got max_experts={num_experts})"
        )
    n_group = max(
        g for g in range(1, options["n_group"] + 1) if num_experts % g == 0 and num_experts // g >= 2
    )
    topk_group = min(options["topk_group"], n_group)
    options.update(n_group=n_group, topk_group=topk_group)
    return min(top_k, topk_group * (num_experts // n_group))


def preset_names() -> tuple[str, ...]:
    """The names of the presets shipped in this folder, sorted."""
    return tuple(sorted(path.stem for path in PRESET_DIR.glob("*.yaml")))


def load_preset(name: str) -> Preset:
    """The preset called ``name`` (one of `preset_names`)."""
    names = preset_names()
    if name not in names:
        raise MoEConfigError(f"name: unknown preset {name!r}; available: {', '.join(names)}")
    preset = load_preset_file(PRESET_DIR / f"{name}.yaml")
    if preset.name != name:
        raise MoEConfigError(f"preset file {name}.yaml has name {preset.name!r}; they must match")
    return preset


def load_preset_file(path: str | Path) -> Preset:
    """Reads and validates one preset file (see the module docstring for the schema)."""
    with open(path, encoding="utf-8") as file:
        data = yaml.safe_load(file)
    if not isinstance(data, dict):
        raise MoEConfigError(
            f"preset file {path} must hold a mapping of the preset keys (got {type(data).__name__})"
        )
    missing = [key for key in _SCHEMA if key not in data]
    unknown = sorted(str(key) for key in data if key not in _SCHEMA and key not in _OPTIONAL)
    if missing or unknown:
        raise MoEConfigError(
            f"preset file {path}: missing key(s) {missing}, unknown key(s) {unknown}; "
            f"the keys are exactly {tuple(_SCHEMA)}, and optionally {tuple(_OPTIONAL)}"
        )
    for key, types in {**_SCHEMA, **_OPTIONAL}.items():
        if key not in data:
            continue
        value = data[key]
        if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
            raise MoEConfigError(
                f"preset file {path}: {key} must be {' or '.join(t.__name__ for t in types)} (got {value!r})"
            )
    return Preset(**data)
