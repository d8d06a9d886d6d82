"""Triton code of the block alignment (see align.py for the contract and the torch twin).

Three steps, fused into one program for small inputs and three launches for large ones:

1. ``_rank_chunk``: each slot's local expert (through the expert map) and its rank among the slots
   of that expert, by an atomic increment of the expert's counter. Ranks depend on the order the
   atomics land in, but each row of a GEMM tile is computed independently, so results do not.
2. ``_block_layout``: counts -> each expert's first padded position, the number of padded
   positions, the expert of every BLOCK_M block (-1 past the end), and sentinel entries in each
   expert's last block.
3. ``_scatter_chunk``: ``sorted_slots[offset[expert] + rank] = slot``.

Loads of values written earlier in the same launch bypass L1 (``.cg``): atomics and stores land in
L2, and an L1 line read before them would be stale.
"""

import triton
import triton.language as tl

from moe.experts._triton._lang import cumsum_, sum_


@triton.jit
def _rank_chunk(ids_ptr, map_ptr, counts_ptr, local_ptr, ranks_ptr, start, num_slots,
                HAS_MAP: tl.constexpr, CHUNK: tl.constexpr):
    offs = start + tl.arange(0, CHUNK)
    in_range = offs < num_slots
    ids = tl.load(ids_ptr + offs, mask=in_range, other=0)
    if HAS_MAP:
        local = tl.load(map_ptr + ids, mask=in_range, other=-1)
    else:
        local = tl.where(in_range, ids, -1)
    here = local >= 0
    rank = tl.atomic_add(counts_ptr + local, 1, mask=here)
    tl.store(local_ptr + offs, local, mask=in_range)
    tl.store(ranks_ptr + offs, rank, mask=here)


@triton.jit
def _block_layout(counts_ptr, offsets_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
                  num_local, num_slots, max_blocks,
                  BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, BLOCKS_CHUNK: tl.constexpr,
                  FILL_E: tl.constexpr):
    experts = tl.arange(0, E_PAD)
    is_expert = experts < num_local
    counts = tl.load(counts_ptr + experts, mask=is_expert, other=0, cache_modifier=".cg")
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = cumsum_(padded, 0)
    total = sum_(padded, 0)
    tl.store(offsets_ptr + experts, ends - padded, mask=is_expert)
    tl.store(num_padded_ptr, total)
    # block b belongs to the expert whose padded range holds position b*BLOCK_M: the number of
    # experts whose range ends at or before it (ends never decrease).
    for b0 in range(0, max_blocks, BLOCKS_CHUNK):
        blocks = b0 + tl.arange(0, BLOCKS_CHUNK)
        pos = blocks * BLOCK_M
        before = (ends[None, :] <= pos[:, None]) & is_expert[None, :]
        owner = sum_(before.to(tl.int32), 1)
        owner = tl.where(pos < total, owner, -1)
        tl.store(block_expert_ptr + blocks, owner, mask=blocks < max_blocks)
    tl.debug_barrier()
    # the unused rows of each expert's last block get the sentinel num_slots
    cols = tl.arange(0, BLOCK_M)
    for e0 in range(0, num_local, FILL_E):
        e = e0 + tl.arange(0, FILL_E)
        ok = e < num_local
        count = tl.load(counts_ptr + e, mask=ok, other=0, cache_modifier=".cg")
        first = tl.load(offsets_ptr + e, mask=ok, other=0, cache_modifier=".cg")
        end = first + (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        pos = (first + count)[:, None] + cols[None, :]
        tl.store(sorted_ptr + pos, num_slots + tl.full(pos.shape, 0, pos.dtype), mask=ok[:, None] & (pos < end[:, None]))


@triton.jit
def _scatter_chunk(local_ptr, ranks_ptr, offsets_ptr, sorted_ptr, start, num_slots,
                   CHUNK: tl.constexpr):
    offs = start + tl.arange(0, CHUNK)
    local = tl.load(local_ptr + offs, mask=offs < num_slots, other=-1, cache_modifier=".cg")
    here = local >= 0
    rank = tl.load(ranks_ptr + offs, mask=here, other=0, cache_modifier=".cg")
    first = tl.load(offsets_ptr + local, mask=here, other=0, cache_modifier=".cg")
    tl.store(sorted_ptr + first + rank, offs, mask=here)


@triton.jit(do_not_specialize=["num_slots", "num_local", "max_blocks"])
def align_fused_kernel(ids_ptr, map_ptr, counts_ptr, local_ptr, ranks_ptr, offsets_ptr, sorted_ptr,
                       block_expert_ptr, num_padded_ptr, num_slots, num_local, max_blocks,
                       HAS_MAP: tl.constexpr, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr,
                       CHUNK: tl.constexpr, BLOCKS_CHUNK: tl.constexpr, FILL_E: tl.constexpr):
    """All three steps in one program: for few slots, where launches cost more than the work."""
    experts = tl.arange(0, E_PAD)
    tl.store(counts_ptr + experts, tl.full(experts.shape, 0, experts.dtype), mask=experts < num_local)
    tl.debug_barrier()
    for start in range(0, num_slots, CHUNK):
        _rank_chunk(ids_ptr, map_ptr, counts_ptr, local_ptr, ranks_ptr, start, num_slots, HAS_MAP, CHUNK)
    tl.debug_barrier()
    _block_layout(counts_ptr, offsets_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, num_local,
                  num_slots, max_blocks, BLOCK_M, E_PAD, BLOCKS_CHUNK, FILL_E)
    tl.debug_barrier()
    for start in range(0, num_slots, CHUNK):
        _scatter_chunk(local_ptr, ranks_ptr, offsets_ptr, sorted_ptr, start, num_slots, CHUNK)


@triton.jit(do_not_specialize=["num_slots"])
def rank_kernel(ids_ptr, map_ptr, counts_ptr, local_ptr, ranks_ptr, num_slots,
                HAS_MAP: tl.constexpr, CHUNK: tl.constexpr):
    """Step 1 over a grid of chunks; ``counts`` must be zero before the launch."""
    _rank_chunk(ids_ptr, map_ptr, counts_ptr, local_ptr, ranks_ptr, tl.program_id(0) * CHUNK,
                num_slots, HAS_MAP, CHUNK)


@triton.jit(do_not_specialize=["num_local", "num_slots", "max_blocks"])
def layout_kernel(counts_ptr, offsets_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
                  num_local, num_slots, max_blocks, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr,
                  BLOCKS_CHUNK: tl.constexpr, FILL_E: tl.constexpr):
    """Step 2, one program."""
    _block_layout(counts_ptr, offsets_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, num_local,
                  num_slots, max_blocks, BLOCK_M, E_PAD, BLOCKS_CHUNK, FILL_E)


@triton.jit(do_not_specialize=["num_slots"])
def scatter_kernel(local_ptr, ranks_ptr, offsets_ptr, sorted_ptr, num_slots, CHUNK: tl.constexpr):
    """Step 3 over a grid of chunks."""
    _scatter_chunk(local_ptr, ranks_ptr, offsets_ptr, sorted_ptr, tl.program_id(0) * CHUNK,
                   num_slots, CHUNK)
