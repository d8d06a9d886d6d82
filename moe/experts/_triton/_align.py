"""Triton code of the block alignment (see align.py for the contract and the torch twin).

Two steps, fused into one program for small inputs and two launches for large ones:

1. ``_rank_chunk``: each slot's local expert (through the expert map) and its rank among the slots
   of that expert, by an atomic increment of the expert's counter. Over a grid (``rank_kernel``) each program
   increments counters of its own, then adds its counts to the experts' with one atomic per expert: the L2
   applies the increments of one counter one at a time, and with every program on the same counters Qwen3-30B-A3B's
   131072 slots took 26.5 us on an H200. Ranks depend on the order the atomics land in, but each row of a GEMM
   tile is computed independently, so results do not.
2. ``_segments`` + ``_place``: counts -> each expert's padded segment (an exclusive scan over the experts, in
   registers: every program computes it, no launch of its own), then
   ``sorted_slots[segment_start[expert] + rank] = slot`` and its inverse ``slot_rows[slot]`` (the sum over k of a
   GEMM whose output rows stay sorted gathers through it); program 0 also stores the padded ends.

Nothing else is written: the GEMMs find a block's expert by comparing its first position with the
ends, and its valid rows with the expert's count, so there is no per-block table and no padding fill.
Loads of values written earlier in the same launch bypass L1 (``.cg``): atomics and stores land in
L2, and an L1 line read before them would be stale.
"""

import triton
import triton.language as tl

from moe.experts._triton._lang import cumsum_


@triton.jit
def _rank_chunk(ids_ptr, map_ptr, counts_ptr, start, num_slots, HAS_MAP: tl.constexpr, CHUNK: tl.constexpr):
    """(offsets, local expert or -1, rank) of the chunk's slots; the counters get incremented."""
    offs = start + tl.arange(0, CHUNK)
    in_range = offs < num_slots
    ids = tl.load(ids_ptr + offs, mask=in_range, other=0)
    if HAS_MAP:
        local = tl.load(map_ptr + ids, mask=in_range, other=-1)
    else:
        local = tl.where(in_range, ids, -1)
    # relaxed: a rank needs only to be unique, and the counts are read after a barrier or in the next launch. The
    # default (acq_rel) put a full memory fence and an L1 invalidation around every increment, so a thread's
    # increments ran one after another.
    rank = tl.atomic_add(counts_ptr + local, 1, mask=local >= 0, sem="relaxed")
    return offs, local, rank


@triton.jit
def _segments(counts_ptr, num_local, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr):
    """(expert indices, first padded position, padded end) of every expert, from the final counts."""
    experts = tl.arange(0, E_PAD)
    counts = tl.load(counts_ptr + experts, mask=experts < num_local, other=0, cache_modifier=".cg")
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = cumsum_(padded, 0)
    return experts, ends - padded, ends


@triton.jit
def _place(sorted_ptr, slot_rows_ptr, starts, offs, local, rank):
    here = local >= 0
    first = tl.gather(starts, tl.where(here, local, 0), 0)
    tl.store(sorted_ptr + first + rank, offs, mask=here)
    tl.store(slot_rows_ptr + offs, first + rank, mask=here)


@triton.jit(do_not_specialize=["num_slots", "num_local"])
def align_fused_kernel(ids_ptr, map_ptr, counts_ptr, local_ptr, sorted_ptr, slot_rows_ptr, ends_ptr, num_slots,
                       num_local,
                       HAS_MAP: tl.constexpr, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Both steps in one program, every slot in one chunk (CHUNK >= num_slots): the ranks stay in
    registers. For few slots, where a second launch costs more than the work."""
    experts = tl.arange(0, E_PAD)
    tl.store(counts_ptr + experts, tl.full(experts.shape, 0, experts.dtype), mask=experts < num_local)
    tl.debug_barrier()
    offs, local, rank = _rank_chunk(ids_ptr, map_ptr, counts_ptr, 0, num_slots, HAS_MAP, CHUNK)
    tl.store(local_ptr + offs, local, mask=offs < num_slots)
    tl.debug_barrier()
    experts, starts, ends = _segments(counts_ptr, num_local, BLOCK_M, E_PAD)
    tl.store(ends_ptr + experts, ends, mask=experts < num_local)
    _place(sorted_ptr, slot_rows_ptr, starts, offs, local, rank)


@triton.jit(do_not_specialize=["num_slots"])
def rank_kernel(ids_ptr, map_ptr, counts_ptr, chunk_counts_ptr, local_ptr, ranks_ptr, num_slots,
                HAS_MAP: tl.constexpr, CHUNK: tl.constexpr, E_PAD: tl.constexpr):
    """Step 1 over a grid of chunks; ``counts`` must be zero before the launch. Each program ranks its slots on
    counters of its own (row ``program_id`` of ``chunk_counts [programs, E_PAD]``), then adds its counts to the
    experts' with one atomic per expert and offsets its ranks by the counts those returned."""
    pid = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    own = chunk_counts_ptr + pid * E_PAD
    tl.store(own + experts, tl.full([E_PAD], 0, tl.int32))
    tl.debug_barrier()
    offs, local, rank = _rank_chunk(ids_ptr, map_ptr, own, pid * CHUNK, num_slots, HAS_MAP, CHUNK)
    tl.store(local_ptr + offs, local, mask=offs < num_slots)
    tl.debug_barrier()
    counts = tl.load(own + experts, cache_modifier=".cg")
    first = tl.atomic_add(counts_ptr + experts, counts, mask=counts > 0, sem="relaxed")
    here = local >= 0
    tl.store(ranks_ptr + offs, tl.gather(first, tl.where(here, local, 0), 0) + rank, mask=here)


@triton.jit(do_not_specialize=["num_slots", "num_local"])
def place_kernel(counts_ptr, local_ptr, ranks_ptr, sorted_ptr, slot_rows_ptr, ends_ptr, num_slots, num_local,
                 BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Step 2 over a grid of chunks."""
    pid = tl.program_id(0)
    experts, starts, ends = _segments(counts_ptr, num_local, BLOCK_M, E_PAD)
    if pid == 0:
        tl.store(ends_ptr + experts, ends, mask=experts < num_local)
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    local = tl.load(local_ptr + offs, mask=offs < num_slots, other=-1)
    rank = tl.load(ranks_ptr + offs, mask=local >= 0, other=0)
    _place(sorted_ptr, slot_rows_ptr, starts, offs, local, rank)
