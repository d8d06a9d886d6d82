"""A workspace of exactly the declared shapes, poisoned, with guard bytes around every view.

``workspace_shapes`` promises an upper bound: ``apply`` must fit in those views. Here each view sits
in one larger byte buffer between guard regions filled with a known pattern, and the views themselves
are filled with 0xFF bytes -- NaN in every float format (float32/16, bfloat16, e4m3, e8m0), -1 in
integers -- so that a buffer read before it is written shows up in the output. After ``apply``,
``violations()`` names every guard region that changed: a write past (or before) a declared buffer.

Views start on the same ``ALIGNMENT`` boundaries as ``WorkspaceManager.take`` gives, so alignment
assumptions that hold in production hold here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe.workspace import ALIGNMENT, BufferSpec, Workspace, WorkspaceShapes

GUARD_BYTES = 4 * ALIGNMENT  # before the first view and after every view
VIEW_POISON = 0xFF


def _align(nbytes: int) -> int:
    return (nbytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def _guard_pattern(nbytes: int, device: torch.device) -> torch.Tensor:
    # bytes 0x5B, 0x9E, ...: a writer storing zeros, ones, NaN or copies of nearby data is seen
    return ((torch.arange(nbytes, dtype=torch.int64) * 67 + 91) % 251).to(torch.uint8).to(device)


@dataclass(frozen=True)
class _Region:
    name: str  # the view a guard follows ("" for the guard before the first view)
    start: int
    end: int


class PoisonedWorkspace:
    """Views of exactly ``shapes`` in a guarded byte buffer; ``workspace`` is what ``apply`` gets."""

    def __init__(self, shapes: WorkspaceShapes, device: torch.device | str = "cpu"):
        self.shapes = shapes
        offset, self._guards, self._views = GUARD_BYTES, [_Region("", 0, GUARD_BYTES)], []
        for name, spec in shapes:
            end = offset + spec.nbytes
            guard_end = _align(end + GUARD_BYTES)
            self._views.append((name, spec, offset))
            self._guards.append(_Region(name, end, guard_end))
            offset = guard_end
        self.buffer = torch.empty(offset, dtype=torch.uint8, device=device)
        self.refill()
        views = {}
        for name, spec, start in self._views:
            raw = self.buffer[start : start + spec.nbytes]
            views[name] = raw.view(spec.dtype).view(spec.shape)
        self.workspace = Workspace(views)

    def refill(self) -> None:
        """Guards back to their pattern, views back to the poison."""
        self.buffer.fill_(VIEW_POISON)
        self._pattern = _guard_pattern(self.buffer.numel(), self.buffer.device)
        for region in self._guards:
            self.buffer[region.start : region.end] = self._pattern[region.start : region.end]

    def violations(self) -> list[str]:
        """One sentence per guard region that was written, naming the buffer it borders."""
        messages = []
        for region in self._guards:
            changed = (self.buffer[region.start : region.end] != self._pattern[region.start : region.end])
            changed = changed.nonzero().flatten()
            if changed.numel():
                first, last = int(changed[0]), int(changed[-1])
                messages.append(self._describe(region, first, last, changed.numel()))
        return messages

    def _describe(self, region: _Region, first: int, last: int, count: int) -> str:
        if not region.name:
            first_view = self._views[0][0] if self._views else "?"
            return (f"{count} guard bytes changed in the {GUARD_BYTES} bytes before buffer {first_view!r} "
                    f"(from {GUARD_BYTES - first} bytes before its start)")
        spec = self.shapes_by_name()[region.name]
        return (f"{count} guard bytes changed past the end of buffer {region.name!r} "
                f"(declared {list(spec.shape)} {str(spec.dtype).replace('torch.', '')} = {spec.nbytes} bytes), "
                f"at +{first}..+{last + 1} bytes after its end")

    def shapes_by_name(self) -> dict[str, BufferSpec]:
        return dict(self.shapes)

    def holds(self, tensor: torch.Tensor) -> bool:
        """True when every element of ``tensor`` lies inside one declared view."""
        if tensor.numel() == 0:
            return True
        if tensor.device != self.buffer.device:
            return False
        size = tensor.element_size()
        low = tensor.data_ptr()
        high = low + size * (1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()) if n > 0))
        base = self.buffer.data_ptr()
        return any(base + start <= low and high <= base + start + spec.nbytes for _, spec, start in self._views)

    def owns_storage_of(self, tensor: torch.Tensor) -> bool:
        """True when ``tensor`` shares memory with this workspace at all."""
        if tensor.numel() == 0 or tensor.device != self.buffer.device:
            return False
        base, low = self.buffer.data_ptr(), tensor.data_ptr()
        return base <= low < base + self.buffer.numel()
