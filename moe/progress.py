"""A one-line progress bar on stderr for work that takes a while (tuning): tqdm when it is installed,
a small built-in bar otherwise (no dependency).

>>> bar = progress(2, "tuning", stream=io.StringIO())
>>> bar.step("M=1"); bar.step("M=8")
"""

from __future__ import annotations

import io  # noqa: F401  (the doctest's stream)
import sys
import time
from typing import TextIO


class Progress:
    """The built-in bar: ``label [#####.....] done/total elapsed note``, redrawn in place."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None):
        self.total, self.done, self.label, self.start = max(total, 1), 0, label, time.time()
        self.stream = sys.stderr if stream is None else stream

    def step(self, note: str = "") -> None:
        """One unit done; ``note`` says which. The last step ends the line."""
        self.done += 1
        filled = int(30 * self.done / self.total)
        elapsed = time.time() - self.start
        self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} "
                          f"{elapsed:.0f}s {note[:50]:<50}")
        if self.done >= self.total:
            self.stream.write("\n")
        self.stream.flush()


class _TqdmProgress:
    """The same contract on a tqdm bar."""

    def __init__(self, tqdm_class, total: int, label: str, stream: TextIO | None):
        self.total = max(total, 1)
        self.bar = tqdm_class(total=self.total, desc=label, file=sys.stderr if stream is None else stream,
                              leave=True, dynamic_ncols=True)

    def step(self, note: str = "") -> None:
        self.bar.set_postfix_str(note[:50], refresh=False)
        self.bar.update(1)
        if self.bar.n >= self.total:
            self.bar.close()


def progress(total: int, label: str, stream: TextIO | None = None) -> Progress | _TqdmProgress:
    """A bar of ``total`` steps on ``stream`` (stderr): tqdm's if importable, else `Progress`."""
    try:
        from tqdm import tqdm
    except ImportError:
        return Progress(total, label, stream)
    return _TqdmProgress(tqdm, total, label, stream)
