"""Block alignment: the (token, slot) pairs sorted by local expert, each expert padded to BLOCK_M.

The grouped GEMMs walk ``sorted_slots`` one BLOCK_M block at a time; every block belongs to one
expert, so a program loads one expert's weights. Everything stays on the GPU (no host sync) and
every shape depends only on M, so the launches can be captured in a CUDA graph.

Example, M=3 tokens, k=2, E_local=3, BLOCK_M=2, ``topk_ids = [[0, 2], [2, 1], [0, 2]]`` (slots are
``token * k + j``)::

    slots by expert:  0 -> {0, 4}   1 -> {3}   2 -> {1, 2, 5}
    expert_counts  = [2, 1, 3]
    expert_ends    = [2, 4, 8]        (each expert's segment padded to a multiple of BLOCK_M)
    sorted_slots   = [0, 4 | 3, . | 1, 2 | 5, .]   (. = never written; the order within an
                                                    expert's segment is not specified)
    slot_rows      = [0, 4, 5, 2, 1, 6]           (each slot's position: sorted_slots[slot_rows[s]] == s)

Block b (positions ``b*BLOCK_M ...``) belongs to the expert whose segment holds its first position:
the number of experts whose end is at or before it; its rows past the expert's count are padding.
Slots whose expert is not on this rank (expert map entry -1) appear nowhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe.experts._triton import cdiv, kernels, next_power_of_2

# Up to this many slots (M * k), one program does everything, its slots in one chunk of registers:
# a second launch costs more than the work.
FUSED_MAX_SLOTS = 4096
_CHUNK = 1024  # slots per program of the two-launch path


@dataclass(frozen=True)
class BlockLayout:
    """The GEMMs' view of the routing: rows sorted by expert, each expert padded to whole blocks."""

    sorted_slots: torch.Tensor  # int32 [max_blocks * BLOCK_M]: slot ids; padding rows unspecified
    expert_counts: torch.Tensor  # int32 [E_local]: slots of each local expert
    expert_ends: torch.Tensor  # int32 [E_local]: end of each expert's padded segment (cumulative)
    local_ids: torch.Tensor  # int32 [M*k]: local expert of each slot, -1 when not on this rank
    block_m: int
    # int32 [M*k]: each slot's position in sorted_slots (unspecified where local_ids is -1): the sum over k reads
    # a GEMM's sorted output rows through it
    slot_rows: torch.Tensor

    @property
    def max_blocks(self) -> int:
        """The grid's bound on blocks; those past ``expert_ends[-1]`` exit at once."""
        return self.sorted_slots.numel() // self.block_m


def max_blocks(num_slots: int, num_local: int, block_m: int) -> int:
    """Upper bound on the blocks: each non-empty expert wastes less than one block."""
    return cdiv(num_slots, block_m) + min(num_local, num_slots)


def experts_pad(num_local: int) -> int:
    """The power of two the kernels hold the per-expert vectors in."""
    return next_power_of_2(max(num_local, 2))


def padded_rows(num_slots: int, num_local: int, block_ms: tuple[int, ...]) -> int:
    """The most rows (slots and padding) a `BlockLayout` of up to ``num_slots`` slots holds, for any
    block size in ``block_ms``."""
    return max(max_blocks(num_slots, num_local, bm) * bm for bm in block_ms)


def workspace_buffers(num_slots: int, num_local: int, block_ms: tuple[int, ...]) -> dict:
    """The alignment's buffers for up to ``num_slots`` slots and any block size in ``block_ms``."""
    padded = padded_rows(num_slots, num_local, block_ms)
    i32, experts = torch.int32, max(num_local, 1)
    return {
        "sorted_slots": ((padded,), i32),
        "local_ids": ((num_slots,), i32),
        "slot_rows": ((num_slots,), i32),
        "ranks": ((num_slots,), i32),
        "chunk_counts": ((cdiv(num_slots, _CHUNK) * experts_pad(num_local),), i32),  # rank_kernel's own counters
        "expert_counts": ((experts,), i32),
        "expert_ends": ((experts,), i32),
    }


def align_block_size(
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    num_local: int,
    block_m: int,
    workspace,
) -> BlockLayout:
    """``topk_ids [M, k]`` int32 global ids -> `BlockLayout` in ``workspace`` views (no allocation).

    ``expert_map`` int32 ``[E]`` maps global to local ids (-1: elsewhere); None means identity.
    """
    _align = kernels("align")
    num_slots = topk_ids.numel()
    layout = BlockLayout(
        sorted_slots=workspace["sorted_slots"][: max_blocks(num_slots, num_local, block_m) * block_m],
        expert_counts=workspace["expert_counts"][:num_local],
        expert_ends=workspace["expert_ends"][:num_local],
        local_ids=workspace["local_ids"][:num_slots],
        block_m=block_m,
        slot_rows=workspace["slot_rows"][:num_slots],
    )
    ids = topk_ids.reshape(-1)
    has_map = expert_map is not None
    map_arg = expert_map if has_map else ids  # any tensor: never read without HAS_MAP
    counts, ends, e_pad = layout.expert_counts, layout.expert_ends, experts_pad(num_local)
    if num_slots <= FUSED_MAX_SLOTS:
        chunk = next_power_of_2(max(num_slots, 16))
        _align.align_fused_kernel[(1,)](
            ids, map_arg, counts, layout.local_ids, layout.sorted_slots, layout.slot_rows, ends, num_slots,
            num_local, HAS_MAP=has_map, BLOCK_M=block_m, E_PAD=e_pad, CHUNK=chunk, num_warps=4 if chunk <= 1024 else 8,
        )
        return layout
    counts.zero_()
    grid = (cdiv(num_slots, _CHUNK),)
    _align.rank_kernel[grid](ids, map_arg, counts, workspace["chunk_counts"], layout.local_ids, workspace["ranks"],
                             num_slots, HAS_MAP=has_map, CHUNK=_CHUNK, E_PAD=e_pad, num_warps=4)
    _align.place_kernel[grid](counts, layout.local_ids, workspace["ranks"], layout.sorted_slots, layout.slot_rows,
                              ends, num_slots, num_local, BLOCK_M=block_m, E_PAD=e_pad, CHUNK=_CHUNK, num_warps=4)
    return layout


def align_block_size_reference(
    topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_local: int, block_m: int
) -> BlockLayout:
    """Torch twin of `align_block_size` (allocates; slots in ascending order within each expert)."""
    num_slots = topk_ids.numel()
    ids = topk_ids.reshape(-1).long()
    local = expert_map.long()[ids] if expert_map is not None else ids
    sorted_slots = torch.full((max_blocks(num_slots, num_local, block_m) * block_m,), -1, dtype=torch.int32,
                              device=ids.device)
    counts = torch.zeros(num_local, dtype=torch.int32, device=ids.device)
    ends = torch.zeros(num_local, dtype=torch.int32, device=ids.device)
    slot_rows = torch.full((num_slots,), -1, dtype=torch.int32, device=ids.device)
    position = 0
    for e in range(num_local):
        slots = (local == e).nonzero().squeeze(1)
        sorted_slots[position : position + slots.numel()] = slots.to(torch.int32)
        slot_rows[slots] = torch.arange(position, position + slots.numel(), dtype=torch.int32, device=ids.device)
        counts[e] = slots.numel()
        position += cdiv(slots.numel(), block_m) * block_m
        ends[e] = position
    return BlockLayout(sorted_slots, counts, ends, local.to(torch.int32), block_m, slot_rows)
