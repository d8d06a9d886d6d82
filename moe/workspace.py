"""Workspace: what an Experts (or PrepareFinalize) needs as scratch, reserved once and reused.

An Experts declares its buffers with ``workspace_shapes`` -- an upper bound that does not depend on
routing data -- and receives them as views into one reserved byte buffer. A kernel groups the buffers
of its two halves by owner (a `WorkspaceLayout` of sections) and takes one `Workspace` per section.
After warm-up the manager can be locked: a later request that does not fit raises ``WorkspaceError``
naming the caller and the bytes, instead of silently allocating on the hot path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Mapping

import torch

from moe.errors import MoEConfigError, WorkspaceError

ALIGNMENT = 256  # bytes; every view starts on this boundary (TMA and vectorised loads want >= 128)


def _align(nbytes: int) -> int:
    return (nbytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


@dataclass(frozen=True)
class BufferSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class WorkspaceShapes:
    """Named buffers: ``WorkspaceShapes.of(out=((M, H), torch.bfloat16), ...)``.

    ``nbytes`` counts each buffer rounded up to ``ALIGNMENT``, i.e. exactly what ``take`` uses.
    """

    buffers: tuple[tuple[str, BufferSpec], ...] = ()

    @classmethod
    def of(cls, **buffers: tuple[tuple[int, ...], torch.dtype]) -> "WorkspaceShapes":
        specs = []
        for name, (shape, dtype) in buffers.items():
            shape = tuple(int(s) for s in shape)
            if any(s < 0 for s in shape):
                raise MoEConfigError(f"workspace buffer {name!r} has a negative dimension: {shape}")
            specs.append((name, BufferSpec(shape, dtype)))
        return cls(tuple(specs))

    def __iter__(self) -> Iterator[tuple[str, BufferSpec]]:
        return iter(self.buffers)

    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.buffers)

    @property
    def nbytes(self) -> int:
        return sum(_align(spec.nbytes) for _, spec in self.buffers)

    def merge(self, other: "WorkspaceShapes", prefix: str) -> "WorkspaceShapes":
        """Both sets of buffers side by side; ``other``'s names get ``prefix``."""
        return WorkspaceShapes(self.buffers + tuple((prefix + n, s) for n, s in other.buffers))


@dataclass(frozen=True)
class WorkspaceLayout:
    """Buffers grouped by owner: ``WorkspaceLayout.of(prepare_finalize=shapes, experts=shapes)``.

    Each section's buffer names are its own (two sections may both hold an ``out``); ``nbytes`` is
    the sum of the sections', i.e. exactly what ``WorkspaceManager.take_sections`` uses.
    """

    sections: tuple[tuple[str, WorkspaceShapes], ...] = ()

    @classmethod
    def of(cls, **sections: WorkspaceShapes) -> "WorkspaceLayout":
        return cls(tuple(sections.items()))

    @property
    def nbytes(self) -> int:
        return sum(shapes.nbytes for _, shapes in self.sections)


class Workspace(Mapping[str, torch.Tensor]):
    """Read-only mapping name -> tensor view, as handed out by ``WorkspaceManager.take``."""

    def __init__(self, views: dict[str, torch.Tensor]):
        self._views = views

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self._views[name]
        except KeyError:
            raise KeyError(
                f"workspace has no buffer {name!r}; declared: {sorted(self._views)} "
                "(declare it in workspace_shapes)"
            ) from None

    def __iter__(self):
        return iter(self._views)

    def __len__(self) -> int:
        return len(self._views)

    def replacing(self, **views: torch.Tensor) -> "Workspace":
        """This workspace with the named buffers replaced by ``views`` (each already declared)."""
        for name in views:
            self[name]  # noqa: B018 (raises, naming the declared buffers, for an unknown name)
        return Workspace({**self._views, **views})


class WorkspaceManager:
    """Owns one byte buffer per device; grows until ``lock()``, then only hands out views.

    Worst case first: ``reserve(shapes)`` with the shapes for the largest M makes every later
    ``take`` free of allocation.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._buffer = torch.empty(0, dtype=torch.uint8, device=self.device)
        self.locked = False
        # counts the buffers reserve has replaced: views taken under an older generation point into a
        # buffer this manager no longer uses (a holder of views compares it before using them)
        self.generation = 0

    @property
    def reserved_bytes(self) -> int:
        return self._buffer.numel()

    def reserve(self, nbytes: int) -> None:
        if nbytes <= self.reserved_bytes:
            return
        if self.locked:
            raise WorkspaceError(
                f"workspace is locked at {self.reserved_bytes} bytes; reserving {nbytes} bytes "
                "is not allowed after lock() (reserve the worst case before locking)"
            )
        self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.generation += 1

    def lock(self) -> None:
        self.locked = True

    def take(self, shapes: WorkspaceShapes, caller: str = "?") -> Workspace:
        """Views for every buffer in ``shapes``; raises WorkspaceError if locked and too small."""
        return self.take_sections(WorkspaceLayout.of(views=shapes), caller)["views"]

    def take_sections(self, layout: WorkspaceLayout, caller: str = "?") -> dict[str, Workspace]:
        """One `Workspace` per section of ``layout``, side by side in the buffer; raises WorkspaceError
        if locked and too small."""
        needed = layout.nbytes
        if needed > self.reserved_bytes:
            if self.locked:
                raise WorkspaceError(
                    f"{caller} needs {needed} bytes of workspace but the locked workspace holds "
                    f"{self.reserved_bytes} bytes; reserve for a larger max_tokens before lock()"
                )
            self.reserve(needed)
        sections, offset = {}, 0
        for section, shapes in layout.sections:
            views = {}
            for name, spec in shapes:
                raw = self._buffer[offset : offset + spec.nbytes]
                views[name] = raw.view(spec.dtype).view(spec.shape)
                offset += _align(spec.nbytes)
            sections[section] = Workspace(views)
        return sections
