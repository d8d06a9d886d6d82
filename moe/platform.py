"""The platform a layer runs on: device, compute capability, rates, libraries and their features.

A plain frozen dataclass, so any GPU can be simulated and the oracle can answer for hardware that is
not present::

    >>> b200 = Platform.preset("b200")
    >>> b200.capability, b200.has_library("flashinfer")
    ((10, 0), True)
    >>> b200.with_libraries(remove=("flashinfer",)).has_feature("flashinfer.cutlass_fused_moe")
    False

Hardware questions are asked through the named predicates here (``capability_at_least``,
``has_library``, ``has_feature``, ``peak_flops``), never as ``major >= 9`` at call sites.

Library features are probe results named ``"<library>.<entry point>"`` (``"flashinfer.trtllm_fp4_block_scale_moe"``):
``detect()`` runs the probes the backends declare for the installed libraries, and a preset assumes
the features and versions they declare (`LibrarySupport`, through `moe.registry.register_library`).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import statistics
import time
from dataclasses import dataclass, field, replace
from importlib.metadata import PackageNotFoundError, version
from typing import Callable

import torch

from moe.errors import MoEConfigError, UnsupportedError

TB, TFLOP, GB = 1e12, 1e12, 10**9
# importable module -> its distribution (for the version)
LIBRARIES = {"triton": "triton", "flashinfer": "flashinfer-python", "cutlass": "nvidia-cutlass-dsl"}
# importable module -> the extra of pyproject.toml that installs it beside moe
LIBRARY_EXTRAS = {"triton": "triton", "flashinfer": "flashinfer", "cutlass": "cutedsl"}


def missing_library_reason(library: str) -> str:
    """The reason a backend gives when ``library`` is not installed, with the line that installs it."""
    extra = LIBRARY_EXTRAS.get(library)
    fix = f": pip install 'moe[{extra}]'" if extra else ""
    return f"needs library {library!r}, which is not installed{fix}"


def missing_features_reason(platform: "Platform", library: str, features) -> str | None:
    """The reason a backend gives when the installed ``library`` lacks some of ``features`` (short names, as
    `Platform.features_of` gives them), naming them and its version; None when it has them all, or when the
    library is not installed (`missing_library_reason` says that)."""
    if not platform.has_library(library):
        return None
    missing = [f for f in features if f not in platform.features_of(library)]
    if not missing:
        return None
    version = platform.version_of(library)
    return f"the installed {library}{f' {version}' if version else ''} lacks {', '.join(missing)}"


@dataclass(frozen=True)
class LibrarySupport:
    """What the backends that call ``library`` declare about it (through `moe.registry.register_library`).

    ``probe()`` returns the short names of the features an installation provides (``"cutlass_fused_moe"``;
    a platform records them as ``"<library>.<feature>"``); it imports Python modules at most -- no GPU
    work, no JIT -- and runs only where the library is installed. A simulated platform with the library
    (``Platform.preset``, ``with_libraries``) assumes ``assumed_features`` and ``assumed_version``: the
    release the backends' declarations were written against.
    """

    library: str  # the importable module: "flashinfer", "triton", ...
    probe: Callable[[], frozenset[str]] | None = None
    assumed_features: frozenset[str] = frozenset()
    assumed_version: str | None = None


# library -> its declaration: filled by moe.registry.register_library as the backends load, read here
_DECLARED_LIBRARIES: dict[str, LibrarySupport] = {}


def declare_library(support: LibrarySupport) -> LibrarySupport:
    """Records ``support`` (`moe.registry.register_library` is how backends call this); MoEConfigError
    when another declaration holds that library: one module declares each, so they cannot disagree."""
    existing = _DECLARED_LIBRARIES.get(support.library)
    if existing is not None and existing != support:
        raise MoEConfigError(f"library {support.library!r} is already declared ({existing}); "
                             f"declare each library once, in the module that wraps it (got {support})")
    _DECLARED_LIBRARIES[support.library] = support
    return support


# the precision a GEMM runs in -> the ones to fall back to when a platform has no rate for it
_PRECISION_FALLBACK = {"fp4": ("fp8", "bf16"), "fp8": ("bf16",), "fp16": ("bf16",), "bf16": ("fp16",), "fp32": ("bf16",)}


@dataclass(frozen=True)
class Platform:
    """One device and what is installed beside it. Rates are dense (no sparsity), per GPU."""

    name: str  # "h100", ... for presets; the device name for detect() ("NVIDIA H100 80GB HBM3")
    device: str  # "cpu" or "cuda"
    capability: tuple[int, int] | None = None  # CUDA compute capability; None on CPU
    kind: str = ""  # the preset this platform is or resembles ("h100"); profiles are keyed by it
    sm_count: int | None = None
    memory_bytes: int | None = None
    memory_bandwidth: float = 0.0  # bytes/s, counted as a device copy counts them (read + written)
    peak: tuple[tuple[str, float], ...] = ()  # (precision, FLOP/s): "fp32", "bf16", "fp16", "fp8", "fp4"
    interconnect_bandwidth: float = 0.0  # bytes/s per direction to a peer GPU of the node (NVLink/PCIe)
    rates_source: str = ""  # where bandwidth and peak come from: "measured ...", "datasheet ...", "nominal"
    libraries: frozenset[str] = field(default_factory=frozenset)  # importable: "triton", "flashinfer", "cutlass"
    versions: tuple[tuple[str, str], ...] = ()  # (library, version) where known
    features: frozenset[str] = field(default_factory=frozenset)  # "flashinfer.cutlass_fused_moe", ...

    def __post_init__(self):
        if self.device not in ("cpu", "cuda"):
            raise MoEConfigError(f"device must be 'cpu' or 'cuda' (got {self.device!r})")
        if not self.kind:
            object.__setattr__(self, "kind", self.name)
        object.__setattr__(self, "libraries", frozenset(self.libraries))
        object.__setattr__(self, "features", frozenset(self.features))

    # --- named predicates -------------------------------------------------------------------
    @property
    def is_cuda(self) -> bool:
        return self.device == "cuda"

    def capability_at_least(self, major: int, minor: int = 0) -> bool:
        return self.capability is not None and self.capability >= (major, minor)

    def has_library(self, name: str) -> bool:
        return name in self.libraries

    def has_feature(self, name: str) -> bool:
        """``name`` is ``"<library>.<feature>"``; true when the probe (or the preset) found it."""
        return name in self.features

    def features_of(self, library: str) -> frozenset[str]:
        """The features of ``library`` by their short names (``"cutlass_fused_moe"``)."""
        prefix = library + "."
        return frozenset(f[len(prefix) :] for f in self.features if f.startswith(prefix))

    def version_of(self, library: str) -> str | None:
        return dict(self.versions).get(library)

    def peak_flops(self, precision: str) -> float:
        """Dense FLOP/s for GEMMs in ``precision``, or the nearest wider one this platform has."""
        rates = dict(self.peak)
        for p in (precision,) + _PRECISION_FALLBACK.get(precision, ()):
            if rates.get(p):
                return rates[p]
        raise MoEConfigError(f"platform {self.name!r} has no peak rate for {precision} (rates: {sorted(rates)})")

    # --- variants -----------------------------------------------------------------------------
    def with_libraries(self, add: tuple[str, ...] = (), remove: tuple[str, ...] = ()) -> "Platform":
        """A copy with libraries added (with the features a preset assumes) or removed (with theirs)."""
        libraries = (self.libraries | set(add)) - set(remove)
        features = {f for f in self.features if f.split(".", 1)[0] in libraries}
        versions = {lib: v for lib, v in self.versions if lib in libraries}
        declared = _DECLARED_LIBRARIES
        for lib in set(add) - self.libraries - set(remove):
            support = declared.get(lib)
            if support is None:
                continue
            features |= {f"{lib}.{f}" for f in support.assumed_features}
            if support.assumed_version is not None:
                versions[lib] = support.assumed_version
        return replace(
            self, libraries=frozenset(libraries), features=frozenset(features), versions=tuple(sorted(versions.items()))
        )

    # --- construction -------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str) -> "Platform":
        """A simulated platform (``PRESET_NAMES``); a GPU one has triton, flashinfer and cutlass-dsl
        installed, with the features and versions their backends declare (`with_libraries`)."""
        if name not in _PRESETS:
            raise MoEConfigError(f"platform: unknown preset {name!r}; choose one of {', '.join(PRESET_NAMES)}")
        spec = _PRESETS[name]
        base = cls(name=name, **spec)
        return base if base.device == "cpu" else base.with_libraries(add=_GPU_LIBRARIES)

    @classmethod
    def cpu(cls) -> "Platform":
        """This machine's CPU with the libraries installed here and their probed features (cached)."""
        return _detect_cpu()

    @classmethod
    def detect(cls, device: torch.device | str | None = None) -> "Platform":
        """The real machine: CUDA device 0 if present (or the given device), else the CPU.

        Rates come from the preset whose name the device's name contains (or of its compute
        capability's family, said so in ``rates_source``); `measure_rates` measures them instead.
        """
        device = torch.device(device) if device is not None else None
        if device is None:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if device.type != "cuda":
            return cls.cpu()
        return _detect_cuda(device.index or 0)

    def measure_rates(self, device: torch.device | str = "cuda") -> "Platform":
        """A copy whose memory bandwidth and bf16 and fp8 peaks are measured on the CUDA ``device``.

        The bandwidth is that of a device-to-device copy of 1 GiB (bytes read + written), the peaks
        those of 8192³ matrix products. Precisions not measured keep their preset ratio to bf16, fp8
        too where torch or the device has no fp8 product. Takes a few seconds; `moe.tools.bench`
        calls it once per run. Raises UnsupportedError for a device that is not a CUDA GPU.
        """
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            raise UnsupportedError(f"measure_rates: measures a CUDA GPU, and {device} is none")
        bandwidth, bf16 = _measure_bandwidth(device), _measure_matmul_flops(device, torch.bfloat16)
        scale = bf16 / self.peak_flops("bf16")
        peak = {precision: rate * scale for precision, rate in self.peak} | {"bf16": bf16}
        fp8 = _measure_matmul_flops(device, torch.float8_e4m3fn)
        if fp8 is not None:
            peak["fp8"] = fp8
        return replace(self, memory_bandwidth=bandwidth, peak=tuple(peak.items()),
                       rates_source=f"measured on {self.name} (bandwidth, bf16{', fp8' if fp8 else ''})")


def _installed_libraries() -> frozenset[str]:
    return frozenset(n for n in LIBRARIES if _importable(n))


def _importable(module: str) -> bool:
    """True when ``module`` can be found; a finder that refuses it (raises) counts as missing."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _installed_versions() -> tuple[tuple[str, str], ...]:
    found = []
    for module, dist in LIBRARIES.items():
        try:
            found.append((module, version(dist)))
        except PackageNotFoundError:
            continue
    return tuple(sorted(found))


TRITON_INTERPRETER = "triton.interpreter"  # Triton runs kernels on the CPU (TRITON_INTERPRET=1): tests only


def _probe_features(libraries: frozenset[str]) -> frozenset[str]:
    """Runs the probe each installed library's backends declared; notes whether Triton's CPU
    interpreter is on (how this machine runs Triton kernels: a fact of the platform, not a library)."""
    features = set()
    if "triton" in libraries and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        features.add(TRITON_INTERPRETER)
    for lib, support in _DECLARED_LIBRARIES.items():
        if lib in libraries and support.probe is not None:
            features |= {f"{lib}.{f}" for f in support.probe()}
    return frozenset(features)


@functools.lru_cache(maxsize=None)
def _detect_cpu() -> Platform:
    libraries = _installed_libraries()
    return Platform(name="cpu", **_PRESETS["cpu"], libraries=libraries, versions=_installed_versions(),
                    features=_probe_features(libraries))


@functools.lru_cache(maxsize=None)
def _detect_cuda(index: int) -> Platform:
    props = torch.cuda.get_device_properties(index)
    capability = (props.major, props.minor)
    kind, how = preset_for_device(props.name, capability)
    rates = _PRESETS[kind]
    libraries = _installed_libraries()
    return Platform(
        name=props.name, device="cuda", capability=capability, kind=kind, sm_count=props.multi_processor_count,
        memory_bytes=props.total_memory, memory_bandwidth=rates["memory_bandwidth"], peak=rates["peak"],
        interconnect_bandwidth=rates["interconnect_bandwidth"], rates_source=f"{rates['rates_source']}, {how}",
        libraries=libraries, versions=_installed_versions(), features=_probe_features(libraries),
    )


def preset_named(device_name: str) -> str | None:
    """The GPU preset a device's name names ("NVIDIA H100 80GB HBM3" -> h100), or None."""
    lowered = device_name.lower().replace(" ", "-")
    return next((name for name in sorted(_PRESETS, key=len, reverse=True)  # "gb200" before "b200"
                 if name != "cpu" and name in lowered), None)


def preset_for_device(device_name: str, capability: tuple[int, int]) -> tuple[str, str]:
    """(preset name, how it was matched) for a real device: by name (`preset_named`), else by compute
    capability family."""
    name = preset_named(device_name)
    if name is not None:
        return name, f"rates of the {name} preset (device name)"
    family = {8: "a100", 9: "h100", 10: "b200", 12: "rtx-pro-6000"}.get(capability[0], "h100")
    return family, f"rates of the {family} preset (guessed from SM{capability[0]}{capability[1]})"


def median_ms(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of one ``fn()`` over ``reps`` calls, after ``warmup`` calls: timed with CUDA
    events when a GPU is present (each call waits for the GPU), with the wall clock otherwise."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if not torch.cuda.is_available():
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _measure_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes read + written per second by a device-to-device copy."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / (median_ms(lambda: dst.copy_(src), 20) * 1e-3)


def _measure_matmul_flops(device: torch.device, dtype: torch.dtype, n: int = 8192) -> float | None:
    """FLOP/s of an ``n``³ matrix product in ``dtype`` (bf16, or fp8 e4m3 through torch._scaled_mm
    with bf16 output); None where torch or the device has no such product."""
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    product = lambda: a @ b  # noqa: E731
    if dtype != torch.bfloat16:
        if not hasattr(torch, "_scaled_mm"):
            return None
        a, b = a.to(dtype), b.to(dtype).t().contiguous().t()  # _scaled_mm wants b column-major
        one = torch.ones((), device=device)
        product = lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)  # noqa: E731
        try:
            product()
        except (RuntimeError, TypeError):  # no fp8 matrix product on this GPU or torch build
            return None
    return 2 * n**3 / (median_ms(product, 10) * 1e-3)


# --- presets -------------------------------------------------------------------------------------
_GPU_LIBRARIES = ("triton", "flashinfer", "cutlass")


def _peak(fp32: float, bf16: float, fp8: float | None = None, fp4: float | None = None) -> tuple:
    rates = {"fp32": fp32, "bf16": bf16, "fp16": bf16, "fp8": fp8, "fp4": fp4}
    return tuple((p, r * TFLOP) for p, r in rates.items() if r)


_PRESETS: dict[str, dict] = {
    # A nominal CPU: only the reference and torch_grouped experts run here, so only their ratio matters.
    "cpu": dict(device="cpu", memory_bandwidth=0.02 * TB, peak=_peak(0.2, 0.1), rates_source="nominal"),
    # A100 SXM4 80GB datasheet: 2,039 GB/s HBM2e, 312 TFLOP/s bf16 dense, 19.5 fp32, no fp8; 108 SMs;
    # NVLink 3 600 GB/s (300 per direction).
    "a100": dict(device="cuda", capability=(8, 0), sm_count=108, memory_bytes=80 * GB, memory_bandwidth=2.039 * TB,
                 peak=_peak(19.5, 312), interconnect_bandwidth=0.3 * TB, rates_source="datasheet"),
    # H100 SXM5: measured on the lent machines (shared/GPU.md): device copy about 3.0 TB/s (datasheet
    # 3.35), bf16 matmul about 768 TFLOP/s (datasheet 989); fp8 kept at the datasheet's 2x bf16.
    # Datasheet: 67 TFLOP/s fp32, 132 SMs, 80 GB, NVLink 4 900 GB/s (450 per direction).
    "h100": dict(device="cuda", capability=(9, 0), sm_count=132, memory_bytes=80 * GB, memory_bandwidth=3.0 * TB,
                 peak=_peak(67, 768, 1536), interconnect_bandwidth=0.45 * TB,
                 rates_source="measured (bandwidth, bf16; fp8 = 2x bf16)"),
    # H200 SXM: measured on the lent machines: 4.2 TB/s device copy (datasheet 4.8), 768 TFLOP/s bf16.
    # Datasheet: 141 GB HBM3e, 132 SMs, NVLink 4 900 GB/s.
    "h200": dict(device="cuda", capability=(9, 0), sm_count=132, memory_bytes=141 * GB, memory_bandwidth=4.2 * TB,
                 peak=_peak(67, 768, 1536), interconnect_bandwidth=0.45 * TB,
                 rates_source="measured (bandwidth, bf16; fp8 = 2x bf16)"),
    # HGX B200 datasheet (1,000 W): 8 TB/s HBM3e, dense 2.25 PFLOP/s bf16, 4.5 fp8, 9 fp4, 80 TFLOP/s fp32;
    # 180 GB per GPU (1.44 TB for 8); 148 SMs; NVLink 5 1.8 TB/s (900 GB/s per direction).
    "b200": dict(device="cuda", capability=(10, 0), sm_count=148, memory_bytes=180 * GB, memory_bandwidth=8.0 * TB,
                 peak=_peak(80, 2250, 4500, 9000), interconnect_bandwidth=0.9 * TB, rates_source="datasheet"),
    # GB200 NVL72 datasheet, per GPU (1,200 W): 8 TB/s, dense 2.5 PFLOP/s bf16, 5 fp8, 10 fp4, 90 fp32;
    # 186 GB (13.4 TB for 72); the same 148-SM Blackwell GPU; NVLink 5 1.8 TB/s.
    "gb200": dict(device="cuda", capability=(10, 0), sm_count=148, memory_bytes=186 * GB, memory_bandwidth=8.0 * TB,
                  peak=_peak(90, 2500, 5000, 10000), interconnect_bandwidth=0.9 * TB, rates_source="datasheet"),
    # RTX PRO 6000 Blackwell Server Edition (SM120) datasheet: 96 GB GDDR7 at 1,792 GB/s, 188 SMs,
    # 125 TFLOP/s fp32, 4,000 fp4 TOPS with sparsity (2,000 dense; fp8 and bf16 halve it each);
    # no NVLink: PCIe Gen5 x16, 64 GB/s per direction.
    "rtx-pro-6000": dict(device="cuda", capability=(12, 0), sm_count=188, memory_bytes=96 * GB,
                         memory_bandwidth=1.792 * TB, peak=_peak(125, 500, 1000, 2000),
                         interconnect_bandwidth=0.064 * TB, rates_source="datasheet"),
}
PRESET_NAMES: tuple[str, ...] = tuple(_PRESETS)
