"""``flashinfer_a2a``: expert parallelism over NVLink with FlashInfer's ``MoeAlltoAll`` (one host).

``flashinfer.comm.MoeAlltoAll`` (TensorRT-LLM's throughput all-to-all) maps every rank's workspace into
every other rank's address space -- cuMem allocations whose handles (POSIX file descriptors within a
host) are exchanged through torch.distributed (`TorchDistBackend`) -- and moves tokens with one-sided
NVLink writes: no NCCL on the hot path, receive buffers of ``[ep_size, max_tokens_per_rank]`` rows.
It creates no NVLink multicast object (FlashInfer's all-reduce and mixed-comm modules do; nothing
here calls them); keep ``NCCL_NVLS_ENABLE=0``. flashinfer is imported only when an instance is built.
FlashInfer 0.7.4 has no ``MoeAlltoAll`` (its expert-parallel all-to-alls moved to ``flashinfer.moe_ep``, a
different API): the platform probe then reports the feature missing and ``check`` refuses this transport,
saying so, and the oracle composes another.

How this package's contracts meet the kernel's:

- A token travels once per destination rank with all k ids and weights; the kernel picks ranks by
  contiguous placement (expert e on rank ``e // (E / ep_size)``), so ``check`` rejects other maps.
- Receive rows that no token filled get expert id ``skip_id`` (an expert of another rank) through
  FlashInfer's sanitize step, so the experts skip them. FlashInfer's examples use E there, but here
  `TopK` ids stay in ``[0, E)``: the experts index an E-entry expert map with them.
- An idle rank (M = 0) dispatches one dummy token routed to its own first expert, so it travels
  nowhere (the dispatch kernel wants a token, as SGLang found), with zero activations and weights and
  payload ids ``skip_id`` so no expert computes it; finalize returns ``[0, H]``.
- Per-slot outputs are weighted and summed over this rank's slots here; the partial sums travel
  home in the layer's dtype and FlashInfer's combine adds them.
- The kernel exchanges no counts, so before dispatch the ranks all-reduce their M on the host, over a
  gloo group built with the transport (`_agree_on_tokens`; it reads no GPU value). Two things follow.
  A rank with M > max_tokens_per_rank makes every rank raise the same error before any data moves
  (``agrees_on_tokens``), as the NCCL transports do. And ``runtime_max_tokens_per_rank``, which all
  ranks must pass alike, is the largest M of any rank (at least 1), not the capacity: the experts see
  ``ep_size x that`` rows, not ``ep_size x max_tokens_per_rank`` mostly padded ones (measured on 2 H200,
  DeepSeek-V3 at M = 1: see benchmarks/results/ep2_nvidia-h200-x2.md).
- In a CUDA graph capture the host all-reduce runs once, at capture, and the graph keeps its M: every
  rank must capture, and replay, the same forwards together, as engines capture their graphs (and as
  any collective in a graph requires). Nothing on the host runs at replay (``captures_in_cuda_graph``).
"""

from __future__ import annotations

import socket
import warnings
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist

from moe.errors import MoEConfigError, UnsupportedError
from moe.formats import ActivationFormat, Dispatched, DispatchShape, ExpertsOutput, OutputKind
from moe.platform import Platform, missing_library_reason
from moe.prepare_finalize._ep import (
    EPCapacity,
    ExpertParallelPrepareFinalize,
    RowCodec,
    arrived_activations,
    token_payloads,
    wire_format,
)
from moe.prepare_finalize.base import QUANTIZABLE, Ranks, Transport, add_shared
from moe.prepare_finalize.combine import sum_over_k
from moe.problem import MoEProblem
from moe.quant import QuantFormat
from moe.registry import register_prepare_finalize
from moe.router import TopK
from moe.workspace import Workspace

MAX_RANKS = 64  # kMaxRanks in FlashInfer's moeAlltoAllKernels.h
MAX_TOP_K = 22  # kMaxTopK there


def payload_order(payloads: dict[str, torch.Tensor]) -> list[str]:
    """Payload names by element size, largest first: the kernel packs them back to back and wants
    each one aligned to its element size ("reorder payloads by largest to smallest element size")."""
    return sorted(payloads, key=lambda name: -payloads[name].element_size())


def dispatch_bytes_per_token(problem: MoEProblem) -> int:
    """Bytes of one token's payloads: the larger of the two formats the experts may ask for."""
    p = problem
    return max(RowCodec.for_activations(p.hidden_size, p.dtype, wire_format(p, fmt), p.top_k).row_bytes
               for fmt in {QuantFormat.NONE, p.quant.activation})


@dataclass(frozen=True)
class FlashInferRoute:
    """What finalize needs of a dispatch: the kernel keeps its own record of where rows went."""

    num_tokens: int  # M, this rank's tokens: the rows combine returns that are real (an idle rank sent one dummy)
    runtime_max: int  # rows per source rank in the receive buffers: the largest M of any rank, at least 1


@register_prepare_finalize
class FlashInferAllToAllPrepareFinalize(ExpertParallelPrepareFinalize[FlashInferRoute]):
    name = "flashinfer_a2a"
    transport = Transport(ActivationFormat.STANDARD, QUANTIZABLE, ranks=frozenset({Ranks.EXPERT_PARALLEL}),
                          devices=frozenset({"cuda"}), runs_on="CUDA GPUs of one host joined by NVLink",
                          libraries=("flashinfer",), features=("flashinfer.moe_alltoall",), max_ranks=MAX_RANKS,
                          max_top_k=MAX_TOP_K, expert_map=False)
    agrees_on_tokens = True  # every rank's M, all-reduced on the host before dispatch (`_agree_on_tokens`)
    captures_in_cuda_graph = True  # M agreed at capture; the kernel's completion flags live on the GPU

    def __init__(self, problem: MoEProblem, *, max_prefill_tokens: int | None = None):
        capacity = EPCapacity(problem.parallel.ep_size, problem.max_tokens, None, max_prefill_tokens)
        reasons = self.check(problem, None)
        if reasons:
            raise UnsupportedError(f"{self.name} cannot serve this problem", reasons)
        super().__init__(problem, capacity)
        comm = _flashinfer_comm()
        _require_one_host(self.group)
        self._host_group = _host_group(self.group)
        self._first_local = self.placement.to_local.index(0)  # the global id of this rank's local expert 0
        self._a2a = self._build(comm)

    def _build(self, comm: SimpleNamespace):
        p, parallel, per_rank = self.problem, self.problem.parallel, self.capacity.max_tokens_per_rank
        ep = parallel.ep_size
        mapping = comm.Mapping(world_size=ep, rank=parallel.ep_rank, gpus_per_node=ep, tp_size=ep, moe_ep_size=ep)
        size = comm.moe_a2a_get_workspace_size_per_rank(ep, per_rank, dispatch_bytes_per_token(p),
                                                        p.hidden_size * p.dtype.itemsize)
        with warnings.catch_warnings():  # MoeAlltoAll is marked deprecated in 0.7.x; its API is what 0.7.2 documents
            warnings.simplefilter("ignore", DeprecationWarning)
            return comm.MoeAlltoAll(mapping, max_num_tokens=per_rank, top_k=p.top_k, num_experts=p.num_experts,
                                    workspace_size_per_rank=size,
                                    mnnvl_config=comm.MnnvlConfig(comm_backend=comm.TorchDistBackend(self.group)))

    def dispatch_shape(self, num_tokens: int) -> DispatchShape:
        return DispatchShape(ActivationFormat.STANDARD, self.capacity.rows_arriving)

    def prepare(self, hidden: torch.Tensor, topk: TopK, quantize_to: QuantFormat,
                workspace: Workspace) -> tuple[Dispatched, FlashInferRoute]:
        wire, _ = self._wire(quantize_to)
        runtime_max = self._agree_on_tokens(hidden.shape[0])
        payloads, route = token_payloads(hidden, topk, wire), topk.ids
        if hidden.shape[0] == 0:
            payloads, route = self._dummy_token(payloads)
        names = payload_order(payloads)
        received = self._a2a.dispatch(route, [payloads[n] for n in names], runtime_max,
                                      invalid_token_expert_id=self.placement.skip_id,
                                      expert_id_payload_index=names.index("ids"))
        fields = {n: r.reshape(-1, r.shape[-1]) for n, r in zip(names, received)}
        here = self._to_local[fields["ids"].long()] >= 0
        x = arrived_activations(fields, wire, quantize_to, valid=here.any(1, keepdim=True))
        return Dispatched(ActivationFormat.STANDARD, x, TopK(fields["ids"], fields["weights"])), FlashInferRoute(
            hidden.shape[0], runtime_max)

    def finalize(
        self, output: ExpertsOutput, dispatched: Dispatched, route: FlashInferRoute, topk: TopK,
        shared_output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        p, rows = self.problem, dispatched.num_rows
        if output.kind is OutputKind.REDUCED:
            partial = output.out[:rows]
        else:  # this rank's slots of each row, weighted and summed here; other ranks' slots may be garbage
            here = self._to_local[dispatched.topk.ids.long()] >= 0
            partial = sum_over_k(output.out[:rows], dispatched.topk.weights, output.kind, valid=here)
        payload = partial.to(p.dtype).view(p.parallel.ep_size, route.runtime_max, p.hidden_size)
        combined = self._a2a.combine(payload, route.runtime_max)
        return add_shared(combined[: route.num_tokens].clone(), shared_output)

    def _agree_on_tokens(self, num_tokens: int) -> int:
        """Every rank learns every rank's M (a host all-reduce of CPU integers, also while a CUDA graph is
        captured) and all raise the same error when one has more than ``max_tokens_per_rank``; returns the
        largest M, at least 1 (an idle rank sends one dummy token): the call's ``runtime_max_tokens_per_rank``."""
        counts = torch.zeros(self.problem.parallel.ep_size, dtype=torch.int64)
        counts[self.problem.parallel.ep_rank] = num_tokens
        dist.all_reduce(counts, group=self._host_group)
        tokens = counts.tolist()
        self._raise_on_too_many_tokens(tokens)
        return max(1, *tokens)

    def _dummy_token(self, payloads: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        dummy = {name: t.new_zeros(1, t.shape[-1]) for name, t in payloads.items()}
        dummy["ids"].fill_(self.placement.skip_id)
        route = torch.full_like(dummy["ids"], self._first_local)
        return dummy, route


def _flashinfer_comm() -> SimpleNamespace:
    try:
        from flashinfer.comm import MoeAlltoAll, moe_a2a_get_workspace_size_per_rank
        from flashinfer.comm.mapping import Mapping
        from flashinfer.comm.mnnvl import MnnvlConfig, TorchDistBackend
    except ImportError as error:
        raise UnsupportedError(
            "flashinfer_a2a needs flashinfer.comm.MoeAlltoAll (as in flashinfer-python 0.7.2.post1; 0.7.4 has "
            "none) with cuda-python and nvidia-ml-py installed",
            [f"import failed: {error}"],
        ) from error
    return SimpleNamespace(MoeAlltoAll=MoeAlltoAll, moe_a2a_get_workspace_size_per_rank=moe_a2a_get_workspace_size_per_rank,
                           Mapping=Mapping, MnnvlConfig=MnnvlConfig, TorchDistBackend=TorchDistBackend)


def _host_group(group):
    """A gloo group of ``group``'s ranks, for the M each rank sends (``group`` itself where it is gloo).
    Building one is collective: every rank of ``group`` builds the transport together."""
    if dist.get_backend(group) == dist.Backend.GLOO:
        return group
    return dist.new_group(dist.get_process_group_ranks(group), backend="gloo")


def _require_one_host(group) -> None:
    hosts = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    if len(set(hosts)) != 1:
        raise MoEConfigError(
            f"flashinfer_a2a runs within one host (NVLink peers); the ranks are on hosts {sorted(set(hosts))}: "
            "use all_to_all across hosts"
        )
