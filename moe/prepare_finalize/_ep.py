"""The expert-parallel half of the transports: placement, process group, capacity, wire format, and
the base every expert-parallel prepare/finalize builds on.

Under expert parallelism (``ParallelConfig(ep_size, ep_rank, expert_map, group)``) each rank holds the
weights of its ``E_local`` experts (`moe.sharding`) and tokens travel to the ranks that own their
experts and back. What the transports ``all_to_all``, ``all_to_all_batched`` and ``flashinfer_a2a``
share lives here:

- `ExpertPlacement`    the owner rank of every expert (gathered from every rank's expert map)
- `process_group`      the torch.distributed group of a ParallelConfig, checked against it
- `EPCapacity`         tokens per rank x ranks, checked against the largest batch, with a report
- `RowCodec`           one token's payload (activations, their scales, top-k ids and weights) as bytes,
                       so that a dispatch is one collective rather than four; `wire_format`,
                       `token_payloads`, `arrived_activations` decide what travels quantized
- `ExpertParallelPrepareFinalize`  the base class: group, placement, capacity and codecs, all set up
                       at construction (collective: every rank of the group constructs together)

Nothing here moves data: each transport does, over torch.distributed or FlashInfer's NVLink kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe.errors import MoEConfigError
from moe.formats import ActivationFormat
from moe.prepare_finalize.base import QUANTIZABLE, PrepareFinalize, R, Ranks, Transport
from moe.problem import MoEProblem, ParallelConfig
from moe.quant import QuantFormat, QuantizedTensor, quantize_activations, row_layout
from moe.router import TopK


# --- placement -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExpertPlacement:
    """Where every expert lives.

    Example, E=4 on 2 ranks, default placement, seen from rank 1:
    ``owner=(0, 0, 1, 1)``, ``to_local=(-1, -1, 0, 1)``, ``skip_id=0``.
    """

    owner: tuple[int, ...]  # E entries: the rank that holds expert e
    to_local: tuple[int, ...]  # E entries: this rank's local id of expert e, -1 elsewhere
    skip_id: int  # a global id of an expert this rank does not hold: padding rows point at it

    @classmethod
    def from_maps(cls, maps: list[list[int]], rank: int) -> "ExpertPlacement":
        """From every rank's global->local map; each expert must live on exactly one rank."""
        num_experts = len(maps[0])
        owners = [[r for r, m in enumerate(maps) if m[e] >= 0] for e in range(num_experts)]
        bad = {e: o for e, o in enumerate(owners) if len(o) != 1}
        if bad:
            shown = ", ".join(f"expert {e} on ranks {o}" for e, o in list(bad.items())[:4])
            raise MoEConfigError(
                f"every expert must live on exactly one rank ({shown}); "
                "fix the ranks' expert_map (for replicas of hot experts use ParallelConfig(num_redundant_experts=N))"
            )
        to_local = tuple(maps[rank])
        elsewhere = [e for e, local in enumerate(to_local) if local < 0]
        if not elsewhere:
            raise MoEConfigError(f"rank {rank} holds every expert; expert parallelism needs ep_size > 1 owners")
        return cls(tuple(o[0] for o in owners), to_local, elsewhere[0])

    @classmethod
    def gather(cls, problem: MoEProblem, group) -> "ExpertPlacement":
        """Collective: every rank of ``group`` calls it together (the maps travel as one all_gather)."""
        p = problem.parallel
        mine = torch.tensor(p.global_to_local(problem.num_experts), dtype=torch.int64, device=comm_device(group))
        maps = [torch.empty_like(mine) for _ in range(p.ep_size)]
        dist.all_gather(maps, mine, group=group)
        return cls.from_maps([m.tolist() for m in maps], p.ep_rank)

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(owner, to_local)`` as int64 tensors on ``device``."""
        return (torch.tensor(self.owner, dtype=torch.int64, device=device),
                torch.tensor(self.to_local, dtype=torch.int64, device=device))


# --- process group -------------------------------------------------------------------------------
def process_group(parallel: ParallelConfig, who: str):
    """The group of ``parallel`` (None: the default group) after checking it matches ep_size/ep_rank.

    Raises `MoEConfigError` when torch.distributed is not initialized or disagrees with the config --
    conditions of the running job, so they are construction errors, not oracle check reasons.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise MoEConfigError(
            f"{who} needs torch.distributed: call torch.distributed.init_process_group(...) on every rank "
            f"before building it (ep_size={parallel.ep_size}, ep_rank={parallel.ep_rank})"
        )
    group = parallel.group
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if (size, rank) != (parallel.ep_size, parallel.ep_rank):
        raise MoEConfigError(
            f"{who}: the process group has {size} ranks and this is rank {rank}, but ParallelConfig says "
            f"ep_size={parallel.ep_size}, ep_rank={parallel.ep_rank}; pass the expert-parallel group as "
            "ParallelConfig(group=...) or make the config match it"
        )
    return group


def comm_device(group) -> torch.device:
    """Where the tensors of ``group``'s collectives live: the current GPU for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# --- capacity ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EPCapacity:
    """How many tokens one forward can carry over the group, known at construction.

    ``max_tokens_per_rank`` bounds M on every rank; ``rows_per_expert`` (batched format only) is T,
    the rows of each local expert's buffer; ``max_prefill_tokens`` the largest batch the engine
    splits over the ranks (checked: it must fit in ``max_tokens_per_rank x ep_size``).
    """

    ep_size: int
    max_tokens_per_rank: int
    rows_per_expert: int | None = None
    max_prefill_tokens: int | None = None

    def __post_init__(self):
        for name in ("max_tokens_per_rank", "rows_per_expert", "max_prefill_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise MoEConfigError(f"{name} must be a positive int or None (got {value!r})")
        group_tokens = self.max_tokens_per_rank * self.ep_size
        if self.max_prefill_tokens is not None and group_tokens < self.max_prefill_tokens:
            need = -(-self.max_prefill_tokens // self.ep_size)
            raise MoEConfigError(
                f"max_tokens_per_rank x ep_size must be >= max_prefill_tokens: {self.max_tokens_per_rank} x "
                f"{self.ep_size} = {group_tokens} < {self.max_prefill_tokens}; raise max_tokens_per_rank "
                f"to at least {need} (and the problem's max_tokens with it)"
            )

    @property
    def rows_arriving(self) -> int:
        """The most token rows one rank can receive in a forward: each rank sends a token once at most."""
        return self.max_tokens_per_rank * self.ep_size

    def overflow(self, loads: list[int], tokens: list[int], owner: tuple[int, ...]) -> list[str]:
        """Every way a batch exceeds this capacity: ``loads[e]`` tokens for expert e over the group,
        ``tokens[r]`` = M on rank r, ``owner[e]`` the rank of expert e. Empty when it fits."""
        reasons = [f"rank {r} has M={m} tokens but max_tokens_per_rank={self.max_tokens_per_rank}"
                   for r, m in enumerate(tokens) if m > self.max_tokens_per_rank]
        if self.rows_per_expert is not None:
            over = sorted(((n, e) for e, n in enumerate(loads) if n > self.rows_per_expert), reverse=True)
            reasons += [f"expert {e} (on rank {owner[e]}) would receive {n} tokens but max_tokens_per_expert="
                        f"{self.rows_per_expert}" for n, e in over[:3]]
            if len(over) > 3:
                reasons.append(f"{len(over) - 3} more experts over capacity")
        return reasons

    def describe(self, workspace_bytes: int | None = None) -> str:
        text = (f"EP capacity: {self.ep_size} ranks x max_tokens_per_rank={self.max_tokens_per_rank} "
                f"= {self.rows_arriving} tokens per forward over the group; up to {self.rows_arriving} rows "
                "arrive on a rank")
        if self.rows_per_expert is not None:
            text += f"; T={self.rows_per_expert} rows per local expert"
        if self.max_prefill_tokens is not None:
            text += f"; fits max_prefill_tokens={self.max_prefill_tokens}"
        if workspace_bytes is not None:
            text += f"; workspace {workspace_bytes:,} bytes"
        return text


# --- wire format ---------------------------------------------------------------------------------
def quantizes_before_sending(fmt: QuantFormat, hidden_size: int, dtype: torch.dtype) -> bool:
    """True when activations in ``fmt`` can be quantized on the sending rank.

    A format whose scales belong to single rows (fp8 per token or per 128-group, MX) gives the same
    bytes wherever it is computed, so tokens travel quantized (fewer bytes). One scale over the whole
    batch (fp8 per tensor, nvfp4's global scale) must be computed over the batch the experts actually
    multiply -- the received one -- so those tokens travel unquantized and are quantized on arrival.
    """
    return row_layout(fmt, hidden_size, dtype).row_scaled


@dataclass(frozen=True)
class RowCodec:
    """One token's payload as a row of bytes: ``fields`` in order, each ``(name, dtype, elements)``.

    Example, H=4096 bf16 activations, k=8: ``x`` bf16 x 4096, ``ids`` int32 x 8, ``weights`` float32 x 8
    -> ``row_bytes`` = 8192 + 32 + 32 = 8256. With fp8 per-token activations an ``x_scale`` float32 x 1
    field follows ``x``.
    """

    fields: tuple[tuple[str, torch.dtype, int], ...]

    @classmethod
    def for_activations(cls, hidden_size: int, dtype: torch.dtype, fmt: QuantFormat, top_k: int) -> "RowCodec":
        """The codec of tokens in ``fmt`` (NONE: ``dtype`` itself), from the format's `row_layout`."""
        layout = row_layout(fmt, hidden_size, dtype)
        fields = [("x", layout.data_dtype, layout.data_columns)]
        if layout.scale_columns:
            fields.append(("x_scale", layout.scale_dtype, layout.scale_columns))
        fields += [("ids", torch.int32, top_k), ("weights", torch.float32, top_k)]
        return cls(tuple(fields))

    @property
    def row_bytes(self) -> int:
        return sum(dtype.itemsize * n for _, dtype, n in self.fields)

    def field_bytes(self, name: str) -> int:
        """Bytes of field ``name`` in one row; 0 when the codec has no such field."""
        return sum(dtype.itemsize * n for field, dtype, n in self.fields if field == name)

    def columns(self, name: str) -> slice:
        """The byte columns of field ``name``."""
        start = 0
        for field, dtype, n in self.fields:
            if field == name:
                return slice(start, start + dtype.itemsize * n)
            start += dtype.itemsize * n
        raise KeyError(name)

    def pack(self, values: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[n, row_bytes]`` uint8 rows from ``values[name] [n, elements]``."""
        parts = [values[name].contiguous().view(torch.uint8).reshape(len(values[name]), dtype.itemsize * n)
                 for name, dtype, n in self.fields]
        return torch.cat(parts, dim=1)

    def unpack(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Inverse of `pack`: contiguous ``[n, elements]`` tensors by name."""
        return {name: rows[:, self.columns(name)].contiguous().view(dtype) for name, dtype, _ in self.fields}


def wire_format(problem: MoEProblem, quantize_to: QuantFormat) -> QuantFormat:
    """The format activations travel in: ``quantize_to`` if its scales are per row, else unquantized."""
    if quantizes_before_sending(quantize_to, problem.hidden_size, problem.dtype):
        return quantize_to
    return QuantFormat.NONE


def token_payloads(hidden: torch.Tensor, topk: TopK, wire: QuantFormat) -> dict[str, torch.Tensor]:
    """Each token's payload by `RowCodec` field name: ``x`` (in ``wire``), ``x_scale`` if per row,
    ``ids`` and ``weights``."""
    q = quantize_activations(hidden, wire)
    payloads = {"x": q.data, "ids": topk.ids, "weights": topk.weights}
    if q.scale is not None and q.scale.dim() > 0:
        payloads["x_scale"] = q.scale
    return payloads


def arrived_activations(fields: dict[str, torch.Tensor], wire: QuantFormat, quantize_to: QuantFormat,
                        valid: torch.Tensor | None = None) -> QuantizedTensor:
    """The received rows' activations in ``quantize_to``; rows not ``valid`` (padding) count as 0
    when quantizing on arrival, so they cannot move a per-tensor scale."""
    if wire is quantize_to:
        return QuantizedTensor(data=fields["x"], scale=fields.get("x_scale"), fmt=wire)
    data = fields["x"] if valid is None else torch.where(valid, fields["x"], 0)
    return quantize_activations(data, quantize_to)


# --- the base class ------------------------------------------------------------------------------
class ExpertParallelPrepareFinalize(PrepareFinalize[R]):
    """What every expert-parallel transport shares, set up at construction: the group, the placement,
    the capacity, and a `RowCodec` for each format the experts may ask for (unquantized when they
    quantize themselves, else the problem's activation format). Construction is collective."""

    # what every expert-parallel transport declares; a subclass refines a field or declares its own
    transport = Transport(ActivationFormat.STANDARD, QUANTIZABLE, ranks=frozenset({Ranks.EXPERT_PARALLEL}))

    def __init__(self, problem: MoEProblem, capacity: EPCapacity):
        super().__init__(problem)
        self.capacity = capacity
        self.group = process_group(problem.parallel, self.name)
        self.placement = ExpertPlacement.gather(problem, self.group)
        self._owner, self._to_local = self.placement.tensors(comm_device(self.group))
        p = problem
        self._wires = {fmt: wire_format(p, fmt) for fmt in (QuantFormat.NONE, p.quant.activation)}
        self._codecs = {wire: RowCodec.for_activations(p.hidden_size, p.dtype, wire, p.top_k)
                        for wire in self._wires.values()}

    @property
    def max_tokens_per_rank(self) -> int:
        return self.capacity.max_tokens_per_rank

    def describe(self) -> str:
        """The capacity and the workspace for the largest batch, known before the first forward."""
        return f"{self.name}: " + self.capacity.describe(self.workspace_shapes(self.problem.max_tokens).nbytes)

    def _raise_on_overflow(self, reasons: list[str], fix: str) -> None:
        """Raises the capacity error (the same on every rank: ``reasons`` come from counts all ranks
        exchanged) unless ``reasons`` is empty; ``fix`` says what to change."""
        if reasons:
            raise MoEConfigError(f"{self.name}: the batch does not fit the capacity set at construction (every "
                                 f"rank raises this): {'; '.join(reasons)}. {fix}")

    def _raise_on_too_many_tokens(self, tokens: list[int]) -> None:
        """Raises (on every rank: ``tokens`` is every rank's M, exchanged) when one exceeds max_tokens_per_rank."""
        self._raise_on_overflow(self.capacity.overflow([], tokens, self.placement.owner),
                                "Build the layer with a larger max_tokens or split the batch")

    def _wire(self, quantize_to: QuantFormat) -> tuple[QuantFormat, RowCodec]:
        """The format tokens travel in for experts that want ``quantize_to``, and its codec."""
        if quantize_to not in self._wires:
            raise MoEConfigError(
                f"{self.name}: prepare quantizes to none or the problem's activation format "
                f"{self.problem.quant.activation.value} (got quantize_to={quantize_to!r})"
            )
        wire = self._wires[quantize_to]
        return wire, self._codecs[wire]

    def _pack(self, hidden: torch.Tensor, topk: TopK, wire: QuantFormat, codec: RowCodec) -> torch.Tensor:
        """``[M, row_bytes]``: each token's activations (in ``wire``), scales, ids and weights."""
        return codec.pack(token_payloads(hidden, topk, wire))

    def _destinations(self, ids: torch.Tensor) -> torch.Tensor:
        """``[M, ep]`` bool: which ranks each token travels to (those owning any of its experts)."""
        dest = self._owner.to(ids.device)[ids.long()]
        sends = torch.zeros(ids.shape[0], self.problem.parallel.ep_size, dtype=torch.bool, device=ids.device)
        return sends.scatter_(1, dest, True)
