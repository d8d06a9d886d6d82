"""The exceptions `moe` raises for bad input.

Every error names the argument, the value it got and the constraint it broke, and where there is
an obvious fix, the fix. ``assert`` is kept for internal invariants only.
"""

from __future__ import annotations


class MoEError(Exception):
    """Base class of every error raised by `moe` on purpose."""


class MoEConfigError(MoEError, ValueError):
    """A configuration, shape, dtype or value given by the caller is invalid."""


class UnsupportedError(MoEError, NotImplementedError):
    """A valid configuration that the chosen backend (or platform) cannot serve.

    ``reasons`` lists every reason, one sentence each.
    """

    def __init__(self, message: str, reasons: list[str] | tuple[str, ...] = ()):
        self.reasons = tuple(reasons)
        if self.reasons:
            message = message + "\n" + "\n".join(f"  - {r}" for r in self.reasons)
        super().__init__(message)


class WorkspaceError(MoEError, RuntimeError):
    """A request for workspace that a locked WorkspaceManager cannot satisfy."""


class SlowPathWarning(UserWarning):
    """A layer on a GPU that takes a slower path than it could: one that only the reference experts can serve
    (``moe.oracle.slow_path``), or Triton experts whose fp4 weights found no room for their MMA decode copy
    (``moe.experts.triton.fragments_room``)."""


class CacheWarning(UserWarning):
    """A tuning-cache entry (``moe.cache``) that is ignored -- corrupt, stale, for another key, or
    unreadable -- or a ``MOE_CACHE_DIR`` that cannot be used; the load goes on without it."""
