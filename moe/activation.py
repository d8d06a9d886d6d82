"""Activations between the two expert GEMMs, with their reference math.

Gated activations read the first GEMM's output as ``[gate; up]`` halves (``w13`` has ``2I`` rows) and
return ``act(gate) * up`` with ``I`` columns; non-gated ones (``relu2``) read ``I`` columns and return ``I``.

``swiglu_oai`` is GPT-OSS's clamped SwiGLU::

    gate = min(gate, limit); up = clamp(up, -limit, limit)
    out  = gate * sigmoid(alpha * gate) * (up + beta)

with alpha=1.702, beta=1.0, limit=7.0 by default. DeepSeek-V4-style models use the same form with
alpha=1, beta=0 and their own limit (a clamped SiLU), so all three parameters are configurable.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

from moe.errors import MoEConfigError


class ActivationKind(str, enum.Enum):
    SILU = "silu"  # silu(gate) * up
    GELU = "gelu"  # gelu(gate) * up, exact (erf) GELU
    SWIGLU_OAI = "swiglu_oai"  # GPT-OSS clamped SwiGLU, see the module docstring
    RELU2 = "relu2"  # relu(x)^2, non-gated (Nemotron-H)

    def __repr__(self) -> str:
        return f"ActivationKind.{self.name}"


GATED_KINDS = frozenset({ActivationKind.SILU, ActivationKind.GELU, ActivationKind.SWIGLU_OAI})
ACTIVATION_NAMES = tuple(kind.value for kind in ActivationKind)


@dataclass(frozen=True)
class Activation:
    """One activation with its parameters; only ``swiglu_oai`` has any.

    >>> Activation.parse("silu").is_gated
    True
    >>> Activation.parse("swiglu_oai", limit=10.0)
    Activation(kind=ActivationKind.SWIGLU_OAI, alpha=1.702, beta=1.0, limit=10.0)
    """

    kind: ActivationKind
    alpha: float | None = None
    beta: float | None = None
    limit: float | None = None

    def __post_init__(self):
        params = (self.alpha, self.beta, self.limit)
        if self.kind is ActivationKind.SWIGLU_OAI:
            if any(p is None for p in params):
                raise MoEConfigError(
                    f"activation swiglu_oai needs alpha, beta and limit (got {params}); "
                    "use Activation.parse('swiglu_oai') for GPT-OSS's 1.702 / 1.0 / 7.0"
                )
            if not self.limit > 0:
                raise MoEConfigError(f"swiglu_oai limit must be > 0 (got {self.limit})")
        elif any(p is not None for p in params):
            raise MoEConfigError(
                f"activation {self.kind.value} takes no alpha/beta/limit (got {params}); only swiglu_oai does"
            )

    @classmethod
    def parse(
        cls,
        name: "str | ActivationKind | Activation",
        *,
        alpha: float | None = None,
        beta: float | None = None,
        limit: float | None = None,
    ) -> "Activation":
        """Builds an activation from its name; swiglu_oai parameters default to GPT-OSS's."""
        if isinstance(name, Activation):
            return name
        try:
            kind = ActivationKind(name)
        except ValueError:
            raise MoEConfigError(
                f"activation must be one of {ACTIVATION_NAMES} (got {name!r})"
            ) from None
        if kind is ActivationKind.SWIGLU_OAI:
            alpha = 1.702 if alpha is None else _finite("alpha", alpha)
            beta = 1.0 if beta is None else _finite("beta", beta)
            limit = 7.0 if limit is None else _finite("limit", limit)
        return cls(kind, alpha, beta, limit)

    @property
    def name(self) -> str:
        return self.kind.value

    @property
    def is_gated(self) -> bool:
        return self.kind in GATED_KINDS

    def w13_rows(self, intermediate_size: int) -> int:
        """Rows of ``w13`` per expert: ``2I`` for gated activations, ``I`` otherwise."""
        return 2 * intermediate_size if self.is_gated else intermediate_size

    def __str__(self) -> str:
        return self.name

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Reference math on ``[..., 2I]`` (gated, ``[gate; up]``) or ``[..., I]``; returns ``[..., I]``
        computed in ``x``'s dtype. With ``out``, the last op writes its result there, cast once to
        ``out``'s dtype (no copy after it), and returns ``out``."""
        if not self.is_gated:
            return torch.square(torch.relu(x), out=out)
        if x.shape[-1] % 2:
            raise MoEConfigError(
                f"gated activation {self.name} needs an even last dimension [gate; up] (got {x.shape[-1]})"
            )
        gate, up = x.chunk(2, dim=-1)
        if self.kind is ActivationKind.SILU:
            return torch.mul(torch.nn.functional.silu(gate), up, out=out)
        if self.kind is ActivationKind.GELU:
            return torch.mul(torch.nn.functional.gelu(gate), up, out=out)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return torch.mul(gate * torch.sigmoid(self.alpha * gate), up + self.beta, out=out)


def _finite(name: str, value: object) -> float:
    """``value`` as a finite float, or a MoEConfigError naming the swiglu_oai parameter."""
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise MoEConfigError(f"swiglu_oai {name} must be a number (got {value!r})") from None
    if not math.isfinite(number):
        raise MoEConfigError(f"swiglu_oai {name} must be finite (got {value!r})")
    return number
