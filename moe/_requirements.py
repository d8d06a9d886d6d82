"""The oldest torch moe runs on, checked when ``import moe`` starts, before any module that needs a newer one.

Older releases fail inside moe's own code, not with a clear message: 2.6 lacks ``guard_or_false`` (``import moe``
fails), 2.8 cannot index an fp8 tensor on the CPU (the reference experts), 2.10's ``mark_unbacked`` has no
``shape_id`` (torch.compile). pyproject.toml requires the same floor (a test keeps the two equal).
"""

import torch

MIN_TORCH = "2.11"


def check_torch(version: str) -> None:
    """ImportError when torch ``version`` is older than `MIN_TORCH`, compared by major.minor: a pre-release
    build of the floor (NVIDIA's containers ship "2.11.0a0+<commit>") passes."""
    if tuple(map(int, version.split(".")[:2])) < tuple(map(int, MIN_TORCH.split("."))):
        raise ImportError(f"moe needs torch >= {MIN_TORCH}, and torch {version} is installed: "
                          f"pip install 'torch>={MIN_TORCH}'")


check_torch(torch.__version__)
