"""The platform a layer runs on: device, compute capability, rates and libraries.

A plain frozen dataclass, so any GPU can be simulated (``Platform.preset("b200")``) and the oracle can
answer for hardware that is not present. Hardware questions are asked through the named predicates
here, never as ``major >= 9`` at call sites.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field, replace

import torch


@dataclass(frozen=True)
class Platform:
    name: str  # "cpu", "h100", ... or what detect() read
    device: str  # "cpu" or "cuda"
    capability: tuple[int, int] | None = None  # CUDA compute capability; None on CPU
    libraries: frozenset[str] = field(default_factory=frozenset)  # importable: "triton", "flashinfer", ...

    # --- named predicates -------------------------------------------------------------------
    @property
    def is_cuda(self) -> bool:
        return self.device == "cuda"

    def capability_at_least(self, major: int, minor: int = 0) -> bool:
        return self.capability is not None and self.capability >= (major, minor)

    def has_library(self, name: str) -> bool:
        return name in self.libraries

    def with_libraries(self, add: tuple[str, ...] = (), remove: tuple[str, ...] = ()) -> "Platform":
        return replace(self, libraries=(self.libraries | set(add)) - set(remove))

    # --- construction -------------------------------------------------------------------------
    @classmethod
    def cpu(cls) -> "Platform":
        return cls(name="cpu", device="cpu", libraries=_installed_libraries())

    @classmethod
    def detect(cls, device: torch.device | str | None = None) -> "Platform":
        """The real machine: CUDA device 0 if present (or the given device), else CPU."""
        device = torch.device(device) if device is not None else None
        if device is None:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if device.type != "cuda":
            return cls.cpu()
        index = device.index or 0
        props = torch.cuda.get_device_properties(index)
        return cls(
            name=props.name,
            device="cuda",
            capability=(props.major, props.minor),
            libraries=_installed_libraries(),
        )


def _installed_libraries() -> frozenset[str]:
    names = ("triton", "flashinfer", "cutlass")
    return frozenset(n for n in names if importlib.util.find_spec(n) is not None)
