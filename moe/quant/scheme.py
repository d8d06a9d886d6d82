"""How weights and activations are stored: `QuantFormat` (one tensor), `QuantScheme` (a pair).

A `QuantFormat` says how one tensor is stored; a `QuantScheme` pairs the weight format with the
activation format. Only the pairs in the named-scheme table below exist, so every scheme has a
name and ``QuantScheme.from_name(s.name) == s`` for every ``s``.

Named schemes (``SCHEME_NAMES``)::

    name            weight       activation
    bf16/fp16/fp32  NONE         NONE          the model dtype itself; see UNQUANTIZED
    unquantized     NONE         NONE          canonical name of the pair above
    fp8             FP8_TENSOR   FP8_TENSOR
    fp8_token       FP8_ROW      FP8_ROW
    fp8_block       FP8_BLOCK    FP8_BLOCK
    mxfp8           MXFP8        MXFP8
    mxfp4           MXFP4        NONE          W4A16
    mxfp4_a_mxfp8   MXFP4        MXFP8         W4A8; also from_name("mxfp4", act_quant="mxfp8")
    nvfp4           NVFP4        NVFP4

The unquantized dtype (bf16, fp16, fp32) is not part of the scheme: the pair is (NONE, NONE) for all
three and its ``name`` is ``"unquantized"``. ``UNQUANTIZED`` maps the three dtype names to torch
dtypes for callers that parse a single "quantization" string.

Example::

    >>> s = QuantScheme.from_name("mxfp4", act_quant="mxfp8")
    >>> s
    QuantScheme(weight=QuantFormat.MXFP4, activation=QuantFormat.MXFP8)
    >>> s.name
    'mxfp4_a_mxfp8'
"""

from __future__ import annotations

import enum
import types
from dataclasses import dataclass

import torch

from moe.errors import MoEConfigError


class QuantFormat(str, enum.Enum):  # not enum.StrEnum: that needs Python 3.11, we support 3.10
    """How one tensor is stored. K is the reduction (last) dimension."""

    NONE = "none"  # the model dtype (bf16/fp16/fp32), no scales
    # e4m3 + fp32 scale per expert (weights) / per tensor (activations)
    FP8_TENSOR = "fp8_tensor"
    # e4m3 + fp32 scale per output channel (weights) / per token (activations)
    FP8_ROW = "fp8_row"
    # e4m3 + fp32 scale per 128x128 weight block / per 1x128 activation group
    FP8_BLOCK = "fp8_block"
    MXFP8 = "mxfp8"  # e4m3 + e8m0 scale per 32 along K
    MXFP4 = "mxfp4"  # e2m1 packed 2/byte (low nibble = even element) + e8m0 scale per 32 along K
    NVFP4 = "nvfp4"  # e2m1 packed + e4m3 scale per 16 along K + fp32 global scale

    def __repr__(self) -> str:
        # "QuantFormat.FP8_TENSOR" evaluates back to the member, so dataclass reprs round-trip.
        return f"QuantFormat.{self.name}"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: object, argument: str = "fmt") -> QuantFormat:
        """``value`` as a QuantFormat (a member or its string value); MoEConfigError otherwise."""
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(f.value for f in cls)
            raise MoEConfigError(
                f"{argument}: {value!r} is not a QuantFormat; choose one of {allowed}"
            ) from None

    @property
    def k_multiple(self) -> int:
        """K (the last dimension) must be a multiple of this to be stored in this format."""
        return _K_MULTIPLE.get(self, 1)

    @property
    def is_packed_fp4(self) -> bool:
        """True where the payload holds two e2m1 values per byte (last dimension halved)."""
        return self in (QuantFormat.MXFP4, QuantFormat.NVFP4)


# The scale block along K of the micro-scaled formats; the other formats take any K.
_K_MULTIPLE = types.MappingProxyType(
    {QuantFormat.MXFP8: 32, QuantFormat.MXFP4: 32, QuantFormat.NVFP4: 16}
)

_F = QuantFormat
# name -> (weight, activation). The one declaration of which pairs exist.
_NAMED_PAIRS = types.MappingProxyType(
    {
        "bf16": (_F.NONE, _F.NONE),
        "fp16": (_F.NONE, _F.NONE),
        "fp32": (_F.NONE, _F.NONE),
        "unquantized": (_F.NONE, _F.NONE),
        "fp8": (_F.FP8_TENSOR, _F.FP8_TENSOR),
        "fp8_token": (_F.FP8_ROW, _F.FP8_ROW),
        "fp8_block": (_F.FP8_BLOCK, _F.FP8_BLOCK),
        "mxfp8": (_F.MXFP8, _F.MXFP8),
        "mxfp4": (_F.MXFP4, _F.NONE),
        "mxfp4_a_mxfp8": (_F.MXFP4, _F.MXFP8),
        "nvfp4": (_F.NVFP4, _F.NVFP4),
    }
)
SCHEME_NAMES: tuple[str, ...] = tuple(_NAMED_PAIRS)
# Every supported (weight, activation) pair; Experts capabilities name subsets of it.
SCHEME_PAIRS: frozenset[tuple[QuantFormat, QuantFormat]] = frozenset(_NAMED_PAIRS.values())

# The canonical name of each pair; the dtype aliases of (NONE, NONE) all map back to "unquantized".
_CANONICAL_NAME = types.MappingProxyType(
    {pair: name for name, pair in _NAMED_PAIRS.items() if name not in ("bf16", "fp16", "fp32")}
)

# base scheme name -> {act_quant value -> scheme name}
_ACT_QUANT_VARIANTS = types.MappingProxyType({"mxfp4": {"mxfp8": "mxfp4_a_mxfp8"}})

UNQUANTIZED: types.MappingProxyType[str, torch.dtype] = types.MappingProxyType(
    {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
)


@dataclass(frozen=True)
class QuantScheme:
    """A (weight format, activation format) pair, one of the named schemes in ``SCHEME_NAMES``.

    Strings are accepted for either field and converted (``QuantScheme("mxfp4", "none")``).
    """

    weight: QuantFormat  # how the expert weights w13/w2 are stored
    activation: QuantFormat  # how the activations fed to each GEMM are stored

    def __post_init__(self) -> None:
        object.__setattr__(self, "weight", QuantFormat.parse(self.weight, "weight"))
        object.__setattr__(self, "activation", QuantFormat.parse(self.activation, "activation"))
        if (self.weight, self.activation) not in SCHEME_PAIRS:
            pairs = ", ".join(f"{n}=({w}, {a})" for (w, a), n in _CANONICAL_NAME.items())
            raise MoEConfigError(
                f"(weight, activation): ({self.weight}, {self.activation}) is not a supported "
                f"quantization pair; supported: {pairs}"
            )

    @classmethod
    def from_name(cls, name: str, act_quant: str | None = None, argument: str = "quant") -> QuantScheme:
        """The scheme called ``name``; ``act_quant="mxfp8"`` turns "mxfp4" (W4A16) into W4A8. An unknown name
        is refused naming ``argument``, the caller's name for it (``FusedMoE(quant=...)``)."""
        if not isinstance(name, str) or name not in _NAMED_PAIRS:
            raise MoEConfigError(
                f"{argument}: unknown quantization scheme {name!r}; "
                f"choose one of {', '.join(SCHEME_NAMES)}"
            )
        if act_quant is not None:
            variants = _ACT_QUANT_VARIANTS.get(name, {})
            if act_quant not in variants:
                raise MoEConfigError(
                    f"act_quant: {act_quant!r} is not available for scheme {name!r}; only "
                    f"{_describe_act_quant_variants()} (or act_quant=None)"
                )
            name = variants[act_quant]
        return cls(*_NAMED_PAIRS[name])

    @staticmethod
    def unquantized_dtype(name: str) -> torch.dtype:
        """The torch dtype of an unquantized scheme name: "bf16", "fp16" or "fp32"."""
        if name not in UNQUANTIZED:
            raise MoEConfigError(
                f"name: {name!r} is not an unquantized dtype name; choose one of "
                f"{', '.join(UNQUANTIZED)}"
            )
        return UNQUANTIZED[name]

    @property
    def name(self) -> str:
        """The canonical name: "unquantized" for (NONE, NONE), "mxfp4_a_mxfp8" for W4A8 mxfp4."""
        return _CANONICAL_NAME[(self.weight, self.activation)]

    def with_unquantized_activations(self) -> QuantScheme | None:
        """These weights with unquantized activations, where that is a scheme of its own: W4A8 mxfp4 ->
        W4A16 mxfp4 (what a weight-only kernel runs, `moe.experts.mode.Mode.weight_only`); None where it is
        not (nvfp4, mxfp8 and fp8 weights come with quantized activations only) or is this scheme."""
        pair = (self.weight, QuantFormat.NONE)
        return QuantScheme(*pair) if pair in SCHEME_PAIRS and pair != (self.weight, self.activation) else None

    @property
    def is_quantized(self) -> bool:
        """True if either the weights or the activations are stored in a quantized format."""
        return self.weight is not QuantFormat.NONE or self.activation is not QuantFormat.NONE

    def __str__(self) -> str:
        return self.name


def _describe_act_quant_variants() -> str:
    return "; ".join(
        f"{base!r} takes act_quant in {sorted(variants)}"
        for base, variants in _ACT_QUANT_VARIANTS.items()
    )
