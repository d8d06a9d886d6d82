"""Contracts only a GPU can show: allocation outside the workspace, host syncs, CUDA-graph capture.

- ``measure_allocations``: device bytes still held after the call (persistent) and the peak above the
  starting point during it (transient), read from PyTorch's caching allocator
  (``torch.cuda.memory_allocated`` / ``max_memory_allocated``). Memory a library takes with its own
  ``cudaMalloc`` is invisible here.
- ``host_syncs``: runs the call under ``torch.cuda.set_sync_debug_mode("error")``, which turns the
  synchronizing PyTorch operations it knows (``.item()``, ``.tolist()``, ``nonzero``, ...) into errors;
  PyTorch calls the mode a prototype that does not see every sync, so the graph capture backs it up.
- ``capture_and_replay``: captures the call in a CUDA graph, then replays it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


@dataclass(frozen=True)
class Allocations:
    persistent: int  # bytes still allocated after the call, beyond what was before
    transient: int  # peak bytes allocated during the call, beyond what was before


def measure_allocations(fn: Callable[[], T], device: torch.device) -> tuple[T, Allocations]:
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = fn()
    torch.cuda.synchronize(device)
    after, peak = torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
    return result, Allocations(persistent=after - before, transient=peak - before)


def host_syncs(fn: Callable[[], T]) -> tuple[T | None, str | None]:
    """(result, None), or (None, the error) when ``fn`` synchronizes with the host."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "a prototype feature": known, and said in the docs
        torch.cuda.set_sync_debug_mode("error")
    try:
        return fn(), None
    except RuntimeError as error:
        return None, str(error).strip().splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def capture(fn: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
    """``fn`` warmed up on a side stream, then captured: the graph and what the captured call returned."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result


def capture_and_replay(fn: Callable[[], T], before_replay: Callable[[], None]) -> tuple[T | None, str | None]:
    """Warms ``fn`` up on a side stream, captures it, calls ``before_replay`` (e.g. to re-poison the
    buffers so the replay must really recompute), replays. (result, None) or (None, the error)."""
    try:
        graph, result = capture(fn)
        before_replay()
        graph.replay()
        torch.cuda.synchronize()
        return result, None
    except Exception as error:  # noqa: BLE001 -- any failure to capture is the finding
        torch.cuda.synchronize()
        return None, f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
