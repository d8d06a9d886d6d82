"""Block alignment: the (token, slot) pairs sorted by local expert, each expert padded to BLOCK_M.

The grouped GEMMs walk ``sorted_slots`` one BLOCK_M block at a time; every block belongs to one
expert, so a program loads one expert's weights. Everything stays on the GPU (no host sync) and
every shape depends only on M, so the launches can be captured in a CUDA graph.

Example, M=3 tokens, k=2, E_local=3, BLOCK_M=2, ``topk_ids = [[0, 2], [2, 1], [0, 2]]`` (slots are
``token * k + j``)::

    slots by expert:  0 -> {0, 4}   1 -> {3}   2 -> {1, 2, 5}
    sorted_slots   = [0, 4 | 3, S | 1, 2 | 5, S]   (S = the sentinel M*k = 6; order within an
    block_expert   = [0,     1,     2,     2, -1, ...]   expert's segment is not specified)
    num_padded     = [8]

Slots whose expert is not on this rank (expert map entry -1) appear nowhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from moe.experts._triton import kernels

# Up to this many slots (M * k), one program does everything: launches cost more than the work.
FUSED_MAX_SLOTS = 2048
_CHUNK = 1024  # slots per program (or per loop step of the fused program)
_BLOCKS_CHUNK = 64


@dataclass(frozen=True)
class BlockLayout:
    """The GEMMs' view of the routing: rows sorted by expert, padded to whole blocks."""

    sorted_slots: torch.Tensor  # int32 [max_padded(M)]: slot ids; sentinel M*k = padding; tail unused
    block_expert: torch.Tensor  # int32 [max_blocks(M)]: local expert of each block, -1 past the end
    num_padded: torch.Tensor  # int32 [1]: positions in use (a multiple of BLOCK_M)
    local_ids: torch.Tensor  # int32 [M*k]: local expert of each slot, -1 when not on this rank
    block_m: int


def max_blocks(num_slots: int, num_local: int, block_m: int) -> int:
    """Upper bound on the blocks: each non-empty expert wastes less than one block."""
    return triton.cdiv(num_slots, block_m) + min(num_local, num_slots)


def workspace_buffers(num_slots: int, num_local: int, block_ms: tuple[int, ...]) -> dict:
    """The alignment's buffers for up to ``num_slots`` slots and any block size in ``block_ms``."""
    blocks = max(max_blocks(num_slots, num_local, bm) for bm in block_ms)
    padded = max(max_blocks(num_slots, num_local, bm) * bm for bm in block_ms)
    i32 = torch.int32
    return {
        "sorted_slots": ((padded,), i32),
        "block_expert": ((blocks,), i32),
        "num_padded": ((1,), i32),
        "local_ids": ((num_slots,), i32),
        "ranks": ((num_slots,), i32),
        "expert_counts": ((max(num_local, 1),), i32),
        "expert_offsets": ((max(num_local, 1),), i32),
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
    blocks = max_blocks(num_slots, num_local, block_m)
    layout = BlockLayout(
        sorted_slots=workspace["sorted_slots"][: blocks * block_m],
        block_expert=workspace["block_expert"][:blocks],
        num_padded=workspace["num_padded"],
        local_ids=workspace["local_ids"][:num_slots],
        block_m=block_m,
    )
    ranks, counts, offsets = workspace["ranks"], workspace["expert_counts"], workspace["expert_offsets"]
    ids = topk_ids.reshape(-1)
    has_map = expert_map is not None
    map_arg = expert_map if has_map else ids  # any tensor: never read without HAS_MAP
    e_pad = triton.next_power_of_2(max(num_local, 2))
    fill_e = max(1, 4096 // block_m)
    common = dict(BLOCK_M=block_m, E_PAD=e_pad, BLOCKS_CHUNK=_BLOCKS_CHUNK, FILL_E=fill_e)
    if num_slots <= FUSED_MAX_SLOTS:
        _align.align_fused_kernel[(1,)](
            ids, map_arg, counts, layout.local_ids, ranks, offsets, layout.sorted_slots,
            layout.block_expert, layout.num_padded, num_slots, num_local, blocks,
            HAS_MAP=has_map, CHUNK=min(_CHUNK, triton.next_power_of_2(num_slots)), num_warps=4,
            **common,
        )
        return layout
    counts.zero_()
    grid = (triton.cdiv(num_slots, _CHUNK),)
    _align.rank_kernel[grid](ids, map_arg, counts, layout.local_ids, ranks, num_slots,
                             HAS_MAP=has_map, CHUNK=_CHUNK, num_warps=4)
    _align.layout_kernel[(1,)](counts, offsets, layout.sorted_slots, layout.block_expert,
                               layout.num_padded, num_local, num_slots, blocks, num_warps=8, **common)
    _align.scatter_kernel[grid](layout.local_ids, ranks, offsets, layout.sorted_slots, num_slots,
                                CHUNK=_CHUNK, num_warps=4)
    return layout


def align_block_size_reference(
    topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_local: int, block_m: int
) -> BlockLayout:
    """Torch twin of `align_block_size` (allocates; slots in ascending order within each expert)."""
    num_slots = topk_ids.numel()
    ids = topk_ids.reshape(-1).long()
    local = expert_map.long()[ids] if expert_map is not None else ids
    blocks = max_blocks(num_slots, num_local, block_m)
    sorted_slots = torch.full((blocks * block_m,), num_slots, dtype=torch.int32, device=ids.device)
    block_expert = torch.full((blocks,), -1, dtype=torch.int32, device=ids.device)
    position = 0
    for e in range(num_local):
        slots = (local == e).nonzero().squeeze(1)
        sorted_slots[position : position + slots.numel()] = slots.to(torch.int32)
        padded = triton.cdiv(slots.numel(), block_m) * block_m
        block_expert[position // block_m : (position + padded) // block_m] = e
        position += padded
    sorted_slots[position:] = 0  # past num_padded: unspecified; the kernels leave it as it was
    num_padded = torch.tensor([position], dtype=torch.int32, device=ids.device)
    return BlockLayout(sorted_slots, block_expert, num_padded, local.to(torch.int32), block_m)
