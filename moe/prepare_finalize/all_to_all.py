"""``all_to_all`` and ``all_to_all_batched``: expert parallelism over torch.distributed.

Each rank holds ``E_local`` experts (`moe.sharding`). prepare sends every token to the ranks that own
its experts; the experts there compute only their own slots; finalize brings the results home and
sums them in the original token order. The transport is ``torch.distributed.all_to_all_single``
(NCCL on GPUs, gloo on CPU). Construction is collective: every rank of the group builds it together.

Decisions, and why:

- A token travels **once per destination rank**, carrying all k ids and weights, not once per slot.
  With k=8 over 8 ranks (DeepSeek-V3 at EP8) a token's experts often share a rank, and the experts
  already take standard rows with global ids and an expert map (other ranks' experts map to -1 and
  are skipped), so no new contract is needed. DeepEP and FlashInfer's MoeAlltoAll do the same.
- One payload per token (activations, their per-row scales, ids, weights as bytes, `RowCodec`): one
  collective per direction instead of four.
- Activations travel quantized when their scales belong to single rows (fp8 per token or per
  128-group, MX); one scale over the batch (fp8 per tensor, nvfp4) must be computed over the batch the
  experts multiply, so those travel unquantized and are quantized on arrival.
- Results come back in the dtype the experts wrote them. Per-slot outputs (``reference``) return one
  row per (token, slot) and home weights and sums over k exactly as ``local`` does (`sum_over_k`), so
  a sharded ``reference`` equals the unsharded one bit for bit (while torch.sum adds the k slots in
  the same order for both batch sizes: it does on CPU up to k = 4). Reduced outputs return one partial sum per
  (token, rank), which home adds in rank order: equal up to summation order, k/ranks times less traffic.

``all_to_all`` (standard format) exchanges the counts first, then the rows with uneven splits: no
padding travels, but the counts are read on the host. ``all_to_all_batched`` keeps every shape fixed:
each rank sends a ``[ep, max_tokens_per_rank]`` block of rows (padding rows carry id -1) with even
splits, and the receiver scatters them into ``[E_local, T, H]`` expert buffers in the workspace. Its
capacity is agreed before any data moves: one all_reduce of the per-expert loads and of every rank's
M, after which every rank raises the same error when a limit is exceeded -- none is left waiting.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from moe.errors import MoEConfigError
from moe.formats import ActivationFormat, Dispatched, DispatchShape, ExpertsOutput, OutputKind
from moe.prepare_finalize._ep import EPCapacity, ExpertParallelPrepareFinalize, RowCodec, arrived_activations
from moe.prepare_finalize.base import add_shared, batch_slots
from moe.prepare_finalize.combine import sum_over_k
from moe.problem import MoEProblem
from moe.quant import QuantFormat, QuantizedTensor
from moe.registry import register_prepare_finalize
from moe.router import TopK
from moe.workspace import Workspace, WorkspaceShapes


@dataclass(frozen=True)
class StandardRoute:
    """How ``all_to_all``'s rows travelled. Example, M=3 on rank 0 of 2, tokens 0 and 2 to rank 0,
    tokens 1 and 2 to rank 1: ``send_tokens=[0, 2, 1, 2]``, ``send_counts=(2, 2)``."""

    send_tokens: torch.Tensor  # int64 [S]: home token of each row sent, grouped by destination rank
    send_counts: tuple[int, ...]  # rows sent to each rank
    recv_counts: tuple[int, ...]  # rows received from each rank; their sum is M'


@dataclass(frozen=True)
class BatchedRoute:
    """How ``all_to_all_batched``'s rows travelled."""

    send_rows: torch.Tensor  # int64 [M, ep]: row of (token, rank) in the [ep * max_tokens_per_rank] block, -1: not sent


@register_prepare_finalize
class AllToAllPrepareFinalize(ExpertParallelPrepareFinalize[StandardRoute]):
    """Standard format; M' (rows arriving) varies per call, bounded by ``ep_size x max_tokens``."""

    name = "all_to_all"
    agrees_on_tokens = True  # every rank's M travels with the counts (`_route`)

    def __init__(self, problem: MoEProblem, *, max_prefill_tokens: int | None = None):
        capacity = EPCapacity(problem.parallel.ep_size, problem.max_tokens, None, max_prefill_tokens)
        super().__init__(problem, capacity)

    def dispatch_shape(self, num_tokens: int) -> DispatchShape:
        # what arrives depends on the other ranks' tokens: bound it by what they may all send
        return DispatchShape(ActivationFormat.STANDARD, self.capacity.rows_arriving)

    def prepare(self, hidden: torch.Tensor, topk: TopK, quantize_to: QuantFormat,
                workspace: Workspace) -> tuple[Dispatched, StandardRoute]:
        wire, codec = self._wire(quantize_to)
        route = self._route(topk.ids)
        send = self._pack(hidden, topk, wire, codec)[route.send_tokens]
        fields = codec.unpack(_exchange(send, route.send_counts, route.recv_counts, self.group))
        x = arrived_activations(fields, wire, quantize_to)
        return Dispatched(ActivationFormat.STANDARD, x, TopK(fields["ids"], fields["weights"])), route

    def finalize(
        self, output: ExpertsOutput, dispatched: Dispatched, route: StandardRoute, topk: TopK,
        shared_output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        rows = dispatched.num_rows
        if output.kind is OutputKind.REDUCED:
            back = _exchange(output.out[:rows], route.recv_counts, route.send_counts, self.group)
            out = _sum_partials(back, route.send_tokens, route.send_counts, topk.num_tokens, self.problem.dtype)
        else:
            out = self._finalize_slots(output.out[:rows], output.kind, dispatched, route, topk)
        return add_shared(out, shared_output)

    def _route(self, ids: torch.Tensor) -> StandardRoute:
        sends = self._destinations(ids)
        rank_token = sends.t().nonzero()  # (rank, token) pairs, rank-major, tokens ascending
        # to each rank: (rows sent to it, this rank's M); so every rank learns every rank's M in the one
        # exchange of counts, and all raise together when one has too many tokens
        counts = sends.sum(0, dtype=torch.int64)
        send = torch.stack([counts, torch.full_like(counts, ids.shape[0])], 1)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        send_counts, recv_counts, tokens = torch.stack([send[:, 0], recv[:, 0], recv[:, 1]]).tolist()  # one sync
        self._raise_on_too_many_tokens(tokens)
        return StandardRoute(rank_token[:, 1], tuple(send_counts), tuple(recv_counts))

    def _finalize_slots(self, out: torch.Tensor, kind: OutputKind, dispatched: Dispatched, route: StandardRoute,
                        topk: TopK) -> torch.Tensor:
        """Per-slot results travel home one row per (token, slot) and are summed there like ``local``."""
        (num_tokens, k), hidden = topk.ids.shape, out.shape[-1]
        here = self._to_local.to(out.device)[dispatched.topk.ids.long()] >= 0  # [M', k] slots computed here
        # slots sent back to each source rank: rows arrived grouped by source, so sum per group
        edges = torch.tensor([0, *itertools.accumulate(route.recv_counts)], device=out.device)
        per_row = torch.cat([edges.new_zeros(1), here.sum(1).cumsum(0)])
        slots_back = per_row[edges[1:]] - per_row[edges[:-1]]
        # slots expected from each rank: those whose expert it owns, in (token, slot) order
        dest = self._owner.to(out.device)[topk.ids.long()].flatten()
        expected = torch.bincount(dest, minlength=self.problem.parallel.ep_size)
        send_counts, recv_counts = torch.stack([slots_back, expected]).tolist()
        back = _exchange(out[here], send_counts, recv_counts, self.group)
        per_slot = back.new_zeros(num_tokens * k, hidden)
        per_slot[dest.argsort(stable=True)] = back  # rank-major back into (token, slot) order
        return sum_over_k(per_slot.view(num_tokens, k, hidden), topk.weights, kind).to(self.problem.dtype)


@register_prepare_finalize
class BatchedAllToAllPrepareFinalize(ExpertParallelPrepareFinalize[BatchedRoute]):
    """Batched format with fixed shapes: ``[E_local, T, H]`` expert buffers, T = ``max_tokens_per_expert``.

    ``max_tokens_per_rank`` bounds M on every rank (default: the problem's max_tokens); T defaults to
    ``ep_size x max_tokens_per_rank``, which no routing can exceed. A smaller T saves memory and is
    checked on every call, collectively (see the module docstring).
    """

    name = "all_to_all_batched"
    format = ActivationFormat.BATCHED  # refines the expert-parallel transport
    agrees_on_tokens = True  # one all_reduce of every rank's M and per-expert loads (`_agree_capacity`)
    captures_in_cuda_graph = True  # with T = ep_size x max_tokens_per_rank (`_check_static`)

    def __init__(self, problem: MoEProblem, *, max_tokens_per_rank: int | None = None,
                 max_tokens_per_expert: int | None = None, max_prefill_tokens: int | None = None):
        per_rank = problem.max_tokens if max_tokens_per_rank is None else max_tokens_per_rank
        capacity = EPCapacity(problem.parallel.ep_size, per_rank, max_tokens_per_expert, max_prefill_tokens)
        if capacity.max_tokens_per_rank > problem.max_tokens:
            raise MoEConfigError(
                f"max_tokens_per_rank={per_rank} exceeds the problem's max_tokens={problem.max_tokens}, "
                "the most tokens a forward call takes; lower it or raise max_tokens"
            )
        if capacity.rows_per_expert is None:
            capacity = replace(capacity, rows_per_expert=capacity.rows_arriving)
        super().__init__(problem, capacity)
        self._buffers = self._size_buffers()

    @property
    def _block(self) -> int:
        """Rows of one rank's send (and receive) block: ``ep_size x max_tokens_per_rank``."""
        return self.capacity.rows_arriving

    def dispatch_shape(self, num_tokens: int) -> DispatchShape:
        return DispatchShape(ActivationFormat.BATCHED, self.capacity.rows_per_expert)

    def workspace_shapes(self, num_tokens: int) -> WorkspaceShapes:
        return self._buffers  # fixed shapes: the same for every M

    def _size_buffers(self) -> WorkspaceShapes:
        """Byte buffers sized for either activation format the experts may ask for (the format is
        known only per call): send/receive blocks, and the expert buffers (+1 row each: a dump row)."""
        p = self.problem
        wire = max(codec.row_bytes for codec in self._codecs.values())
        experts = [RowCodec.for_activations(p.hidden_size, p.dtype, f, p.top_k) for f in self._wires]
        x_row = max(c.field_bytes("x") for c in experts)
        scale_row = max(c.field_bytes("x_scale") for c in experts)
        slots = p.local_num_experts * self.capacity.rows_per_expert + 1
        buffers = {"send": (((self._block + 1) * wire,), torch.uint8),
                   "recv": ((self._block * wire,), torch.uint8),
                   "x": ((slots * x_row,), torch.uint8)}
        if scale_row:
            buffers["x_scale"] = ((slots * scale_row,), torch.uint8)
        return WorkspaceShapes.of(**buffers)

    def prepare(self, hidden: torch.Tensor, topk: TopK, quantize_to: QuantFormat,
                workspace: Workspace) -> tuple[Dispatched, BatchedRoute]:
        # 1. every rank learns whether the batch fits, before any data moves
        self._agree_capacity(topk)
        # 2. each token's row into its destinations' slots of the fixed send block
        wire, codec = self._wire(quantize_to)
        send_rows = self._send_rows(topk.ids)
        send = _carve(workspace["send"], self._block + 1, torch.uint8, codec.row_bytes)
        send[:, codec.columns("ids")].fill_(255)  # padding rows read expert id -1
        rows = self._pack(hidden, topk, wire, codec)
        target = torch.where(send_rows >= 0, send_rows, self._block)  # unsent (token, rank) -> dump row
        for rank in range(send_rows.shape[1]):
            send.index_copy_(0, target[:, rank], rows)
        # 3. one fixed-size exchange
        recv = _carve(workspace["recv"], self._block, torch.uint8, codec.row_bytes)
        dist.all_to_all_single(recv, send[: self._block], group=self.group)
        # 4. received rows into the local experts' buffers
        return self._scatter(codec.unpack(recv), wire, quantize_to, workspace), BatchedRoute(send_rows)

    def finalize(
        self, output: ExpertsOutput, dispatched: Dispatched, route: BatchedRoute, topk: TopK,
        shared_output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output.kind is OutputKind.REDUCED:
            raise MoEConfigError(f"{self.name} finalize takes per-slot output; the experts declared reduced")
        # each received row's slots computed here, summed in float32, travel home in the experts' dtype;
        # rows past an expert's count are selected away (they may hold garbage)
        flat, rows = output.out.reshape(-1, output.out.shape[-1]), dispatched.slot_rows
        partial = sum_over_k(flat[rows.clamp(min=0)], dispatched.topk.weights, output.kind, valid=rows >= 0)
        partial = partial.to(flat.dtype)
        back = torch.empty_like(partial)
        dist.all_to_all_single(back, partial, group=self.group)
        return add_shared(_gather_partials(back, route.send_rows, self.problem.dtype), shared_output)

    # --- steps ---------------------------------------------------------------------------------
    def _agree_capacity(self, topk: TopK) -> None:
        """One all_reduce of (tokens per expert, M per rank); every rank raises the same error."""
        p, capacity = self.problem, self.capacity
        if _capturing_cuda_graph():
            return self._check_static(topk.num_tokens)
        ids = topk.ids.flatten().long()
        loads = torch.bincount(ids, minlength=p.num_experts)
        tokens = torch.zeros(p.parallel.ep_size, dtype=loads.dtype, device=loads.device)
        tokens[p.parallel.ep_rank] = topk.num_tokens
        needed = torch.cat([loads, tokens])
        dist.all_reduce(needed, group=self.group)  # sum over ranks: loads over the group, every rank's M
        needed = needed.tolist()
        self._raise_on_overflow(
            capacity.overflow(needed[: p.num_experts], needed[p.num_experts:], self.placement.owner),
            f"Raise max_tokens_per_rank / max_tokens_per_expert (T = ep_size x max_tokens_per_rank = "
            f"{capacity.rows_arriving} never overflows)")

    def _check_static(self, num_tokens: int) -> None:
        # Inside a CUDA graph no count can be read: only the worst-case T is safe, and M is a shape.
        if self.capacity.rows_per_expert < self.capacity.rows_arriving:
            raise MoEConfigError(
                f"{self.name}: capturing a CUDA graph needs max_tokens_per_expert >= ep_size x "
                f"max_tokens_per_rank = {self.capacity.rows_arriving} (got {self.capacity.rows_per_expert})"
            )
        if num_tokens > self.capacity.max_tokens_per_rank:
            raise MoEConfigError(f"{self.name}: M={num_tokens} exceeds max_tokens_per_rank={self.max_tokens_per_rank}")

    def _send_rows(self, ids: torch.Tensor) -> torch.Tensor:
        sends = self._destinations(ids)
        position = sends.long().cumsum(0) - 1  # order of each token among those sent to that rank
        base = torch.arange(sends.shape[1], device=ids.device) * self.capacity.max_tokens_per_rank
        return torch.where(sends, base + position, -1)

    def _scatter(self, fields: dict, wire: QuantFormat, quantize_to: QuantFormat, workspace: Workspace) -> Dispatched:
        p, rows_per_expert = self.problem, self.capacity.rows_per_expert
        ids = fields["ids"]  # [M', k], -1 on padding rows
        to_local = self._to_local.to(ids.device)
        local = torch.where(ids >= 0, to_local[ids.clamp(min=0).long()], -1)
        slot_rows, counts = batch_slots(local, p.local_num_experts, rows_per_expert)
        x = arrived_activations(fields, wire, quantize_to, valid=ids[:, :1] >= 0)
        slots = p.local_num_experts * rows_per_expert
        target = torch.where(slot_rows >= 0, slot_rows, slots)  # slots of other ranks -> dump row
        data = _scatter_rows(x.data, workspace["x"], target, slots)
        scale = x.scale
        if scale is not None and scale.dim() > 0:
            scale = _scatter_rows(scale, workspace["x_scale"], target, slots)
        batched = QuantizedTensor(data=data.view(p.local_num_experts, rows_per_expert, -1),
                                  scale=_per_expert(scale, p.local_num_experts), global_scale=x.global_scale,
                                  fmt=x.fmt)
        received = TopK(torch.where(ids >= 0, ids, self.placement.skip_id), fields["weights"])
        return Dispatched(ActivationFormat.BATCHED, batched, received, tokens_per_expert=counts, slot_rows=slot_rows)


# --- helpers ---------------------------------------------------------------------------------------
def _exchange(send: torch.Tensor, send_counts, recv_counts, group) -> torch.Tensor:
    """Rows ``send`` (grouped by destination, ``send_counts`` each) -> the rows sent here."""
    recv = send.new_empty((sum(recv_counts), *send.shape[1:]))
    dist.all_to_all_single(recv, send.contiguous(), output_split_sizes=list(recv_counts),
                           input_split_sizes=list(send_counts), group=group)
    return recv


def _sum_partials(back: torch.Tensor, send_tokens: torch.Tensor, send_counts, num_tokens: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """Adds each rank's partial sums into the tokens they belong to, rank after rank (deterministic:
    a token appears once per rank's block)."""
    out = torch.zeros(num_tokens, back.shape[-1], dtype=torch.float32, device=back.device)
    start = 0
    for count in send_counts:
        block = slice(start, start + count)
        out.index_add_(0, send_tokens[block], back[block].float())
        start += count
    return out.to(dtype)


def _gather_partials(back: torch.Tensor, send_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Home side of the batched combine: each token's partial sums from every rank, in rank order."""
    out = torch.zeros(send_rows.shape[0], back.shape[-1], dtype=torch.float32, device=back.device)
    for rank in range(send_rows.shape[1]):
        rows = send_rows[:, rank : rank + 1]
        out += torch.where(rows >= 0, back[rows.squeeze(1).clamp(min=0)].float(), 0.0)
    return out.to(dtype)


def _carve(buffer: torch.Tensor, rows: int, dtype: torch.dtype, columns: int) -> torch.Tensor:
    """A contiguous ``[rows, columns]`` view of ``dtype`` at the start of a flat byte buffer."""
    return buffer[: rows * columns * dtype.itemsize].view(dtype).view(rows, columns)


def _scatter_rows(values: torch.Tensor, buffer: torch.Tensor, target: torch.Tensor, slots: int) -> torch.Tensor:
    """Copies ``values [M', c]`` to rows ``target [M', k]`` of a ``[slots + 1, c]`` view of ``buffer``
    (row ``slots`` is the dump row), byte-wise so every dtype (fp8 included) takes the same path.
    Returns the first ``slots`` rows as ``values.dtype``."""
    raw = values.contiguous().view(torch.uint8)
    rows = _carve(buffer, slots + 1, torch.uint8, raw.shape[-1])
    for j in range(target.shape[1]):
        rows.index_copy_(0, target[:, j], raw)
    return rows[:slots].view(values.dtype)


def _per_expert(scale: torch.Tensor | None, num_local: int) -> torch.Tensor | None:
    if scale is None or scale.dim() == 0:
        return scale
    return scale.view(num_local, -1, scale.shape[-1])


def _capturing_cuda_graph() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
