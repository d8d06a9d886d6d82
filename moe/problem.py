"""The problem an MoE layer solves: shapes, activation, quantization, dtype and parallel layout.

Vocabulary (used everywhere in `moe`): M tokens, H hidden size, I intermediate size, E experts,
k experts per token (top-k), ``w13`` the first GEMM's weights ``[E, 2I, H]`` (rows ``[gate; up]``),
``w2`` the second's ``[E, H, I]``.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from moe.activation import Activation
from moe.errors import MoEConfigError
from moe.quant.scheme import UNQUANTIZED, QuantFormat, QuantScheme

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise MoEConfigError(f"{name} must be a positive int (got {value!r})")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_dtype(dtype: Any) -> None:
    """Raises `MoEConfigError` unless ``dtype`` is one of the activation dtypes in `DTYPES`."""
    if dtype not in DTYPES.values():
        names = ", ".join(f"torch.{name}" for name in ("bfloat16", "float16", "float32"))
        hint = f"; use {DTYPES[dtype]} for {dtype!r}" if isinstance(dtype, str) and dtype in DTYPES else ""
        raise MoEConfigError(f"dtype must be one of {names} (got {dtype!r}){hint}")


@dataclass(frozen=True)
class ParallelConfig:
    """Expert parallelism: this rank owns ``local_num_experts`` of the ``E`` experts.

    By default rank r owns the contiguous block ``[r * E/ep, (r+1) * E/ep)``. ``expert_map`` (a tuple
    of E ints, global id -> local id or -1 when the expert lives elsewhere) overrides that.
    ``group`` is the torch.distributed process group (None: the default group); it takes no part in
    equality or repr.

    ``num_redundant_experts`` N > 0 adds N physical expert slots for replicas of hot experts (EPLB,
    `moe.eplb`): the ``E + N`` physical experts are sharded contiguously, ``(E + N) / ep_size`` per rank,
    and every map here (``global_to_local``, ``local_num_experts``) counts physical experts.
    """

    ep_size: int = 1
    ep_rank: int = 0
    expert_map: tuple[int, ...] | None = None
    group: Any = field(default=None, compare=False, repr=False)
    num_redundant_experts: int = 0

    def __post_init__(self):
        _positive("ep_size", self.ep_size)
        if not (_is_int(self.ep_rank) and 0 <= self.ep_rank < self.ep_size):
            raise MoEConfigError(f"ep_rank must be in [0, ep_size={self.ep_size}), an int (got {self.ep_rank!r})")
        if self.expert_map is not None:
            if not isinstance(self.expert_map, (tuple, list)) or not all(_is_int(i) for i in self.expert_map):
                raise MoEConfigError(
                    f"expert_map must be a sequence of ints, one per global expert (got {self.expert_map!r})"
                )
            object.__setattr__(self, "expert_map", tuple(self.expert_map))  # a list would make it unhashable
            local = sorted(i for i in self.expert_map if i >= 0)
            if local != list(range(len(local))) or any(i < -1 for i in self.expert_map):
                raise MoEConfigError(
                    "expert_map must map each global expert to -1 or a local id, the local ids being "
                    f"0..n-1 each exactly once (got {self.expert_map})"
                )
        self._check_redundant()

    def _check_redundant(self) -> None:
        n = self.num_redundant_experts
        if not (_is_int(n) and n >= 0):
            raise MoEConfigError(f"num_redundant_experts must be an int >= 0 (got {n!r})")
        if n and self.ep_size == 1:
            raise MoEConfigError(
                f"num_redundant_experts={n} needs expert parallelism (ep_size > 1): replicas balance the load "
                "between ranks; on one rank use num_redundant_experts=0"
            )
        if n and self.expert_map is not None:
            raise MoEConfigError(
                f"num_redundant_experts={n} goes without expert_map: EPLB (moe.eplb) decides which expert each "
                "physical slot holds; leave expert_map None"
            )

    def num_physical_experts(self, num_experts: int) -> int:
        """``E + num_redundant_experts``: the expert slots over all ranks (E when there are no replicas)."""
        return num_experts + self.num_redundant_experts

    @property
    def enabled(self) -> bool:
        return self.ep_size > 1 or self.expert_map is not None

    def global_to_local(self, num_experts: int) -> list[int]:
        """The expert map as a list of E ints: global id -> local id, or -1 (not on this rank).

        With redundant experts the ids are physical: ``E + num_redundant_experts`` entries."""
        if self.expert_map is not None:
            if len(self.expert_map) != num_experts:
                raise MoEConfigError(
                    f"expert_map has {len(self.expert_map)} entries but num_experts={num_experts}"
                )
            return list(self.expert_map)
        slots = self.num_physical_experts(num_experts)
        if self.num_redundant_experts:
            self._check_replicas_fit(num_experts)
        elif num_experts % self.ep_size:
            raise MoEConfigError(
                f"num_experts={num_experts} must be divisible by ep_size={self.ep_size} "
                "for the default contiguous sharding; pass an explicit expert_map otherwise"
            )
        per_rank = slots // self.ep_size
        first = self.ep_rank * per_rank
        return [e - first if first <= e < first + per_rank else -1 for e in range(slots)]

    def _check_replicas_fit(self, num_experts: int) -> None:
        slots, n, ep = self.num_physical_experts(num_experts), self.num_redundant_experts, self.ep_size
        if slots % ep:
            fits = n + (-slots) % ep
            raise MoEConfigError(
                f"num_experts + num_redundant_experts = {num_experts} + {n} = {slots} physical experts must be "
                f"divisible by ep_size={ep} (each rank holds as many); e.g. num_redundant_experts={fits}"
            )
        if n > num_experts * (ep - 1):
            raise MoEConfigError(
                f"num_redundant_experts={n} exceeds num_experts x (ep_size - 1) = {num_experts * (ep - 1)}: an "
                "expert has at most one replica per rank (two on one rank would not spread its load)"
            )

    def global_to_local_tensor(self, num_experts: int, device: torch.device | str) -> torch.Tensor:
        """``global_to_local`` as int32 ``[E]`` on ``device``. Build it once, at load, and index it with the
        top-k ids per forward: building it is a host-to-device copy, which a CUDA graph cannot capture."""
        return torch.tensor(self.global_to_local(num_experts), dtype=torch.int32, device=device)

    def local_num_experts(self, num_experts: int) -> int:
        return sum(1 for i in self.global_to_local(num_experts) if i >= 0)


@dataclass(frozen=True)
class MoEProblem:
    """Everything a backend needs to know to decide whether and how it can run a layer.

    >>> p = MoEProblem.create(num_experts=8, top_k=2, hidden_size=4096, intermediate_size=14336)
    >>> p.local_num_experts, p.w13_rows, str(p.quant)
    (8, 28672, 'bf16')
    """

    num_experts: int  # E, over all ranks
    top_k: int  # k
    hidden_size: int  # H
    intermediate_size: int  # I
    activation: Activation
    quant: QuantScheme
    dtype: torch.dtype  # activations in and out: bfloat16, float16 or float32
    has_bias: bool = False  # b13 [E, w13_rows] and b2 [E, H]
    max_tokens: int = 8192  # the largest M one forward call may get (sizes the workspace)
    parallel: ParallelConfig = ParallelConfig()

    def __post_init__(self):
        for name in ("num_experts", "top_k", "hidden_size", "intermediate_size", "max_tokens"):
            _positive(name, getattr(self, name))
        if self.top_k > self.num_experts:
            raise MoEConfigError(
                f"top_k must be <= num_experts (got top_k={self.top_k}, num_experts={self.num_experts})"
            )
        check_dtype(self.dtype)
        names = "; MoEProblem.create(...) takes names"
        if not isinstance(self.activation, Activation):
            raise MoEConfigError(f"activation must be an Activation (got {self.activation!r}){names}")
        if not isinstance(self.quant, QuantScheme):
            raise MoEConfigError(f"quant must be a QuantScheme (got {self.quant!r}){names}")
        if not isinstance(self.has_bias, bool):
            raise MoEConfigError(f"has_bias must be a bool (got {self.has_bias!r})")
        if not isinstance(self.parallel, ParallelConfig):
            raise MoEConfigError(
                f"parallel must be a ParallelConfig (got {self.parallel!r}); e.g. ParallelConfig(ep_size=2, ep_rank=0)"
            )
        self.parallel.global_to_local(self.num_experts)  # validates the sharding against E
        self._check_scale_blocks()

    def _check_scale_blocks(self) -> None:
        reasons = scale_block_reasons(self.quant, self.hidden_size, self.intermediate_size)
        if reasons:
            raise MoEConfigError(reasons[0])

    @classmethod
    def create(
        cls,
        *,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        activation: "str | Activation" = "silu",
        quant: "str | QuantScheme | None" = None,
        dtype: torch.dtype | None = None,
        **kwargs: Any,
    ) -> "MoEProblem":
        """Builds a problem from names; an unquantized scheme name ("bf16") also sets the dtype.

        ``quant=None`` keeps the weights unquantized in ``dtype`` (default bf16), so passing only
        ``dtype=torch.float32`` means fp32 weights and activations.
        """
        if dtype is not None:
            check_dtype(dtype)
        if quant is None:
            quant = "unquantized"
        if isinstance(quant, str):
            named_dtype = UNQUANTIZED.get(quant)
            if named_dtype is not None and dtype is not None and dtype != named_dtype:
                raise MoEConfigError(
                    f"quant={quant!r} keeps weights in {named_dtype} but dtype={dtype}; "
                    f"pass quant matching the dtype (one of {tuple(UNQUANTIZED)}) or leave dtype out"
                )
            dtype = dtype or named_dtype
            quant = QuantScheme.from_name(quant)
        return cls(
            num_experts=num_experts,
            top_k=top_k,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            activation=Activation.parse(activation),
            quant=quant,
            dtype=dtype or torch.bfloat16,
            **kwargs,
        )

    @functools.cached_property
    def local_num_experts(self) -> int:
        # read on every forward by some backends; counting the map each time cost tens of microseconds at E=128
        return self.parallel.local_num_experts(self.num_experts)

    def physical(self) -> "MoEProblem":
        """The problem the kernels solve: with redundant experts (EPLB), ``E + N`` physical experts, each
        on one rank, and no replicas left to resolve (top-k ids are physical ids, `moe.eplb`); else self."""
        if not self.parallel.num_redundant_experts:
            return self
        slots = self.parallel.num_physical_experts(self.num_experts)
        parallel = dataclasses.replace(self.parallel, num_redundant_experts=0)
        return dataclasses.replace(self, num_experts=slots, parallel=parallel)

    @property
    def w13_rows(self) -> int:
        return self.activation.w13_rows(self.intermediate_size)

    @property
    def quant_name(self) -> str:
        """The scheme's name, with unquantized schemes named by their dtype ("bf16")."""
        if self.quant.is_quantized:
            return self.quant.name
        return next(name for name, dt in DTYPES.items() if dt == self.dtype)

    def scheme_run_as(self, activation: QuantFormat | None) -> str:
        """The scheme whose kernels run this problem when its GEMMs read activations in ``activation`` (a
        `QuantFormat`, or None for the scheme's own): a weight-only mode (NONE) runs the scheme of the same
        weights and unquantized activations where that is one (W4A8 mxfp4 -> W4A16 mxfp4:
        `QuantScheme.with_unquantized_activations`), so it shares that scheme's launch tables and
        measurements; else `quant_name`."""
        same_kernels = self.quant.with_unquantized_activations()
        return same_kernels.name if same_kernels and activation is QuantFormat.NONE else self.quant_name

    @property
    def sizes(self) -> str:
        """The sizes that error messages quote: ``"E=8, k=2, H=4096, I=14336"`` (and the local E under EP)."""
        experts = f"E={self.num_experts}"
        if self.parallel.num_redundant_experts:
            experts += f" (+{self.parallel.num_redundant_experts} redundant, {self.local_num_experts} physical on this rank)"
        elif self.parallel.enabled:
            experts += f" ({self.local_num_experts} on this rank)"
        return f"{experts}, k={self.top_k}, H={self.hidden_size}, I={self.intermediate_size}"


def scale_block_reasons(quant: QuantScheme, hidden_size: int, intermediate_size: int) -> list[str]:
    """Why ``quant`` cannot store a layer of these sizes (empty when it can): H and I are the K of a
    GEMM each, and micro-scaled formats need K a multiple of their scale block."""
    return [
        f"{name} must be a multiple of {fmt.k_multiple} for quant={quant.name} "
        f"({fmt.value} stores one scale per {fmt.k_multiple} elements; got {size}); "
        "pad the weights or choose another scheme"
        for fmt in (quant.weight, quant.activation)
        for name, size in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size))
        if size % fmt.k_multiple
    ]
