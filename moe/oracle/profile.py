"""Efficiency profiles: how close each backend gets to the roofline, estimated or measured.

The oracle estimates a backend's time as ``overhead_us + roofline_us / efficiency`` (see
``moe.oracle.cost``). The efficiencies are data, in YAML files of this schema (one file may hold
many backends and platforms)::

    version: 1
    backends:
      triton:                        # an Experts or PrepareFinalize name
        h100:                        # Platform.kind ("h100", "b200", "cpu", ...) or "*" for any
          - tokens: 1                # M of this point; between points efficiency and overhead are
            quant: bf16              #   interpolated linearly in log2(M), beyond them held constant
            efficiency: 0.45         # scheme name (MoEProblem.quant_name: bf16, fp8_block, nvfp4, ...) or "*"
            overhead_us: 8           # optional fixed cost per call (launches, host work); default 0
            note: why this number    # optional
          - tokens: 64
            quant: fp8_block
            measured_us: 41.7        # a measurement instead of an efficiency, with the shape it was
            shape: {preset: deepseek-v3}   # measured at: a preset name, or num_experts, top_k,
                                           # hidden_size, intermediate_size, activation (default silu)
      all_to_all:                    # a PrepareFinalize: its prepare + finalize alone (the experts' time
        h200:                        #   taken out), per rank, M tokens per rank
          - tokens: 16
            quant: bf16
            measured_us: 95.0
            shape: {preset: deepseek-v3, ep_size: 2}   # ep_size: the ranks it spanned (default 1)

A measurement becomes an efficiency by dividing its shape's roofline (on the same platform) by the
measured time, so it also informs other shapes: an Experts backend's the experts' roofline
(`moe.oracle.cost.roofline`), a PrepareFinalize's what it moves (`moe.oracle.cost.transport_us`, over the
interconnect at the shape's ``ep_size``). Experts shapes are taken at ``ep_size`` 1 (the bench times one
GPU); a PrepareFinalize's shape keeps its ``ep_size``, so an EP2 measurement is "at this shape" only for an
EP2 problem. ``python -m moe bench --save-profile PATH`` writes
measurements with ``save_profile``; the oracle reads them from a policy's ``profiles`` or
``MOE_PROFILE=path[:path...]``.

Which points the oracle uses for (backend, platform, quant), first non-empty wins:

1. measured points, in this order: for (backend, platform.kind or platform.name, quant) at the problem's own
   shape, from any file; a sibling platform's at this shape (another preset of the same architecture: an H100
   reads the H200's measurements), each divided by its shape's roofline *on the platform it was measured on*,
   so the efficiency carries over and the sibling's ceilings scale the time; this platform's at other shapes;
   the sibling's at other shapes. The sibling's measurement of this shape comes before this platform's of
   other shapes: over every cell both committed profiles hold, carried across the two it came within 5.5% (to
   the H100) and 6.7% (to the H200) of the time measured there (median), other shapes' on the same platform
   within 11% and 15% (`benchmarks/oracle_levels.py`, session 42). Several shapes measured at one M count as
   the mean of their efficiencies;
2. if a peer (another experts backend) is measured for this scheme on this architecture, nothing
   more: the backend takes ``DEFAULT_EFFICIENCY`` (a generic guess never displaces a measurement);
   otherwise estimated points for (backend, platform, quant), then (backend, platform, "*"), then
   (backend, "*", quant), then (backend, "*", "*");
3. none: ``DEFAULT_EFFICIENCY`` and ``DEFAULT_OVERHEAD_US`` -- pessimistic on purpose, so that an
   unmeasured plugin never displaces a profiled backend -- said so in the explanation.

Asked for one M (``tokens``), each of the four measured levels speaks only for M within `REACH` times the
token counts it was measured at, and gives way to a later measured level that reaches M: a backend measured on
this shape at decode only (M = 1-16) says little of its efficiency at M = 4096, where it computes instead of
streaming weights, and its measurements on other shapes at that M say more. Where no measured level
reaches M, the first with points is used, held constant beyond them.

Within one level, a later file's points replace an earlier file's points at the same tokens and shape.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable

import yaml

from moe.errors import MoEConfigError
from moe.platform import PRESET_NAMES, Platform
from moe.problem import MoEProblem, ParallelConfig

PROFILE_DIR = Path(__file__).parent / "profiles"
SCHEMA_VERSION = 1
ANY = "*"
# An unprofiled backend (a new plugin) ranks below the profiled ones until it is measured.
DEFAULT_EFFICIENCY = 0.02
DEFAULT_OVERHEAD_US = 1000.0
REACH = 4  # a level of measurements speaks for M within this factor of the token counts it was measured at
_ENTRY_KEYS = ("tokens", "quant", "efficiency", "measured_us", "overhead_us", "shape", "note")
_SHAPE_KEYS = ("preset", "num_experts", "top_k", "hidden_size", "intermediate_size", "activation", "ep_size")


@dataclass(frozen=True)
class ProfileShape:
    """The layer shape a measurement was taken at."""

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    activation: str = "silu"
    preset: str | None = None  # the preset it was read from, if any (saved as just the name)
    ep_size: int = 1  # the ranks a PrepareFinalize measurement spanned; 1 for Experts measurements

    @classmethod
    def of(cls, problem: MoEProblem, preset: str | None = None, *, parallel: bool = False) -> "ProfileShape":
        """``problem``'s shape; ``parallel``: with its ``ep_size`` (a PrepareFinalize's), else at 1."""
        return cls(problem.num_experts, problem.top_k, problem.hidden_size, problem.intermediate_size,
                   problem.activation.name, preset, problem.parallel.ep_size if parallel else 1)

    def problem(self, quant: str, max_tokens: int) -> MoEProblem:
        """The problem measured: rank 0 of ``ep_size`` ranks when it spanned several."""
        scheme = "bf16" if quant == ANY else quant
        return MoEProblem.create(num_experts=self.num_experts, top_k=self.top_k, hidden_size=self.hidden_size,
                                 intermediate_size=self.intermediate_size, activation=self.activation,
                                 quant=scheme, max_tokens=max_tokens, parallel=ParallelConfig(self.ep_size))

    def same_layer(self, other: "ProfileShape") -> bool:
        """Same E, k, H, I, activation and ranks (where it was read from does not matter)."""
        fields = ("num_experts", "top_k", "hidden_size", "intermediate_size", "activation", "ep_size")
        return all(getattr(self, f) == getattr(other, f) for f in fields)

    def to_yaml(self) -> dict[str, Any]:
        ranks = {"ep_size": self.ep_size} if self.ep_size > 1 else {}
        if self.preset is not None:
            return {"preset": self.preset, **ranks}
        return {**{k: getattr(self, k) for k in _SHAPE_KEYS[1:6]}, **ranks}


@dataclass(frozen=True)
class ProfileEntry:
    """One point: an efficiency (estimated) or a time (measured) for one backend, platform, scheme, M."""

    backend: str
    platform: str  # Platform.kind, or "*"
    tokens: int
    quant: str  # scheme name or "*"
    efficiency: float | None = None
    measured_us: float | None = None
    overhead_us: float = 0.0
    shape: ProfileShape | None = None  # required with measured_us
    note: str = ""
    source: str = ""  # the file it was read from (not saved)

    @property
    def measured(self) -> bool:
        return self.measured_us is not None

    @classmethod
    def measurement(cls, backend: str, platform: Platform, problem: MoEProblem, tokens: int, measured_us: float,
                    *, preset: str | None = None, note: str = "", parallel: bool = False) -> "ProfileEntry":
        """What the bench records: ``backend`` ran ``problem`` with M=``tokens`` in ``measured_us``;
        ``parallel``: a PrepareFinalize across ``problem.parallel.ep_size`` ranks (`ProfileShape.of`)."""
        return cls(backend, platform.kind, tokens, problem.quant_name, measured_us=measured_us,
                   shape=ProfileShape.of(problem, preset, parallel=parallel), note=note)

    def key(self) -> tuple:
        return (self.backend, self.platform, self.quant, self.tokens, self.measured, self.shape)

    def to_yaml(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": self.tokens, "quant": self.quant}
        if self.measured:
            out.update(measured_us=self.measured_us, shape=self.shape.to_yaml())
        else:
            out["efficiency"] = self.efficiency
        if self.overhead_us:
            out["overhead_us"] = self.overhead_us
        if self.note:
            out["note"] = self.note
        return out


@dataclass(frozen=True)
class Profile:
    """Profile entries from one or more files, later files taking precedence."""

    entries: tuple[ProfileEntry, ...] = ()

    def merged(self, other: "Profile") -> "Profile":
        return Profile(self.entries + other.entries)

    def points(self, backend: str, platform: Platform, quant: str, shape: ProfileShape | None = None,
               peers: Iterable[str] = (), tokens: int | None = None) -> tuple[tuple[ProfileEntry, ...], str]:
        """The points to use and a description of where they come from (see the module docstring).

        Measurements of the problem's own ``shape`` come first; measurements of other shapes are used
        as efficiencies against their own rooflines. ``peers``: the backends this one competes with
        (the experts backends, for an experts backend); where any of them is measured for ``quant``
        on this architecture, this one's estimates are not used. ``tokens``: the M asked for; a
        measured level that does not reach it (`REACH`) gives way to a later one that does.
        """
        mine = [e for e in self.entries if e.backend == backend]
        names, kin = {platform.kind, platform.name}, set(sibling_kinds(platform))
        measured = [e for e in mine if e.measured and e.platform in names and e.quant == quant]
        theirs = [e for e in mine if e.measured and e.platform in kin and e.quant == quant]
        levels = [
            ("measured at this shape", _at(measured, shape)),
            (f"measured on {_joined(theirs)} at this shape, against its ceilings", _at(theirs, shape)),
            ("measured at other shapes", measured),
            (f"measured on {_joined(theirs)} at other shapes, against its ceilings", theirs),
        ]
        peers = set(peers)
        if not any(e.measured and e.backend in peers and e.platform in names | kin and e.quant == quant
                   for e in self.entries):
            levels += [
                (f"{platform.kind}, {quant}", _estimates(mine, names, {quant})),
                (f"{platform.kind}, any scheme", _estimates(mine, names, {ANY})),
                (f"any platform, {quant}", _estimates(mine, {ANY}, {quant})),
                ("any platform, any scheme", _estimates(mine, {ANY}, {ANY})),
            ]
        measured_levels = [(label, found) for label, found in levels[:4] if found]
        reaching = [level for level in measured_levels if _reaches(level[1], tokens)]
        if reaching and reaching[0] is not measured_levels[0]:
            label, found = reaching[0]
            first = measured_levels[0][1]
            skipped = (f"; {measured_levels[0][0]}: M = {min(e.tokens for e in first)}-"
                       f"{max(e.tokens for e in first)} only, more than {REACH}x from M = {tokens}")
            levels = [(label + skipped, found)]
        for label, found in levels:
            if found:
                points = _latest_per_tokens(found)
                files = sorted({Path(e.source).name for e in points if e.source})
                return points, f"{label} ({', '.join(files) or 'given'})"
        if len(levels) == 4:  # peers are measured for this scheme on this architecture
            return (), (f"not measured on {platform.kind} or its architecture while other backends are: default "
                        f"efficiency {DEFAULT_EFFICIENCY}, overhead {DEFAULT_OVERHEAD_US} us (a guess never "
                        "displaces a measurement; python -m moe bench --save-profile measures it)")
        return (), f"no profile entry: default efficiency {DEFAULT_EFFICIENCY}, overhead {DEFAULT_OVERHEAD_US} us"


def sibling_kinds(platform: Platform) -> tuple[str, ...]:
    """The other platform presets of ``platform``'s architecture (same device type and compute
    capability: h100 <-> h200), whose measurements stand in for its own, as efficiencies."""
    if platform.capability is None:
        return ()
    return tuple(name for name in PRESET_NAMES if name != platform.kind
                 and Platform.preset(name).capability == platform.capability)


def measured_on(point: ProfileEntry, platform: Platform) -> Platform:
    """The platform whose ceilings a measured ``point`` is divided by: its own preset when it was taken
    on a sibling of ``platform``, else ``platform``."""
    if point.platform in (platform.kind, platform.name) or point.platform not in PRESET_NAMES:
        return platform
    return Platform.preset(point.platform)


def _reaches(entries: list[ProfileEntry], tokens: int | None) -> bool:
    """Whether measurements at ``entries``' token counts speak for M = ``tokens`` (None: any M)."""
    if tokens is None:
        return True
    measured = [e.tokens for e in entries]
    return min(measured) / REACH <= tokens <= max(measured) * REACH


def _at(entries: list[ProfileEntry], shape: ProfileShape | None) -> list[ProfileEntry]:
    return [e for e in entries if shape is not None and e.shape.same_layer(shape)]


def _joined(entries: list[ProfileEntry]) -> str:
    return "/".join(sorted({e.platform for e in entries})) or "a sibling"


def _estimates(entries: list[ProfileEntry], platforms: set[str], quants: set[str]) -> list[ProfileEntry]:
    return [e for e in entries if not e.measured and e.platform in platforms and e.quant in quants]


def _latest_per_tokens(entries: list[ProfileEntry]) -> tuple[ProfileEntry, ...]:
    """One point per (tokens, shape): the last one read; sorted by tokens."""
    latest = {(e.tokens, e.shape): e for e in entries}
    return tuple(sorted(latest.values(), key=lambda e: e.tokens))


# --- files ---------------------------------------------------------------------------------------
def load_profile(path: str | Path) -> Profile:
    """Reads and validates one profile file (schema in the module docstring)."""
    path = Path(path)
    where = str(path)
    with open(path, encoding="utf-8") as file:
        try:
            data = yaml.safe_load(file) or {}
        except yaml.YAMLError as error:
            raise MoEConfigError(f"{where}: not valid YAML ({error})") from None
    _require_mapping(data, where, "the file")
    _only_keys(data, ("version", "description", "backends"), where, "top level")
    if data.get("version", SCHEMA_VERSION) != SCHEMA_VERSION:
        raise MoEConfigError(f"{where}: version must be {SCHEMA_VERSION} (got {data.get('version')!r})")
    backends = data.get("backends") or {}
    _require_mapping(backends, where, "backends")
    entries = []
    for backend, platforms in backends.items():
        _require_mapping(platforms, where, f"backends.{backend}")
        for platform, points in platforms.items():
            if not isinstance(points, list):
                raise MoEConfigError(f"{where}: backends.{backend}.{platform} must be a list of points")
            for i, point in enumerate(points):
                entries.append(_parse_entry(str(backend), str(platform), point, where, f"backends.{backend}.{platform}[{i}]"))
    return Profile(tuple(entries))


def save_profile(path: str | Path, entries: Iterable[ProfileEntry], *, merge: bool = True,
                 description: str = "") -> Profile:
    """Writes ``entries`` to ``path`` (keeping the file's other entries when ``merge``); returns what it wrote.

    An entry replaces an existing one with the same backend, platform, scheme, tokens and shape.
    """
    path = Path(path)
    existing = load_profile(path).entries if merge and path.exists() else ()
    by_key = {e.key(): e for e in existing}
    by_key.update({e.key(): e for e in entries})
    kept = sorted(by_key.values(), key=lambda e: (e.backend, e.platform, e.quant, e.tokens))
    tree: dict[str, dict[str, list]] = {}
    for e in kept:
        tree.setdefault(e.backend, {}).setdefault(e.platform, []).append(e.to_yaml())
    document = {"version": SCHEMA_VERSION, **({"description": description} if description else {}), "backends": tree}
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as file:
        yaml.safe_dump(document, file, sort_keys=False)
    return Profile(tuple(replace(e, source=str(path)) for e in kept))


@functools.lru_cache(maxsize=None)
def builtin_profile() -> Profile:
    """The estimates shipped in ``moe/oracle/profiles/*.yaml``, in file-name order."""
    profile = Profile()
    for path in sorted(PROFILE_DIR.glob("*.yaml")):
        profile = profile.merged(load_profile(path))
    return profile


def load_profiles(paths: Iterable[str | Path]) -> Profile:
    """The built-in estimates followed by ``paths`` (later files take precedence)."""
    profile = builtin_profile()
    for path in paths:
        if not Path(path).is_file():
            raise MoEConfigError(f"profile file {str(path)!r} does not exist")
        profile = profile.merged(load_profile(path))
    return profile


# --- validation ----------------------------------------------------------------------------------
def _require_mapping(value: Any, where: str, what: str) -> None:
    if not isinstance(value, dict):
        raise MoEConfigError(f"{where}: {what} must be a mapping (got {type(value).__name__})")


def _only_keys(data: dict, allowed: tuple[str, ...], where: str, what: str) -> None:
    unknown = sorted(str(k) for k in data if k not in allowed)
    if unknown:
        raise MoEConfigError(f"{where}: unknown key(s) {unknown} at {what}; allowed keys: {', '.join(allowed)}")


def _number(value: Any, where: str, key: str, *, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (positive and value <= 0) or value < 0:
        bound = "> 0" if positive else ">= 0"
        raise MoEConfigError(f"{where}: {key} must be a number {bound} (got {value!r})")
    return float(value)


def _parse_entry(backend: str, platform: str, point: Any, file: str, at: str) -> ProfileEntry:
    _require_mapping(point, file, at)
    _only_keys(point, _ENTRY_KEYS, file, at)
    tokens = point.get("tokens")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise MoEConfigError(f"{file}: {at}.tokens must be an int >= 1 (got {tokens!r})")
    quant = point.get("quant")
    if not isinstance(quant, str):
        raise MoEConfigError(f"{file}: {at}.quant must be a scheme name or '*' (got {quant!r})")
    has_eff, has_us = "efficiency" in point, "measured_us" in point
    if has_eff == has_us:
        raise MoEConfigError(f"{file}: {at} needs exactly one of efficiency, measured_us")
    efficiency = _number(point["efficiency"], file, f"{at}.efficiency") if has_eff else None
    if efficiency is not None and efficiency > 1:
        raise MoEConfigError(f"{file}: {at}.efficiency is a fraction of the roofline, in (0, 1] (got {efficiency})")
    shape = _parse_shape(point.get("shape"), file, f"{at}.shape") if has_us else None
    return ProfileEntry(
        backend, platform, tokens, quant, efficiency=efficiency,
        measured_us=_number(point["measured_us"], file, f"{at}.measured_us") if has_us else None,
        overhead_us=_number(point.get("overhead_us", 0.0), file, f"{at}.overhead_us", positive=False),
        shape=shape, note=str(point.get("note", "")), source=file,
    )


def _parse_shape(value: Any, file: str, at: str) -> ProfileShape:
    if value is None:
        raise MoEConfigError(f"{file}: {at} is required with measured_us (a preset name or the layer's sizes)")
    _require_mapping(value, file, at)
    _only_keys(value, _SHAPE_KEYS, file, at)
    ep_size = value.get("ep_size", 1)
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise MoEConfigError(f"{file}: {at}.ep_size must be an int >= 1, the ranks measured (got {ep_size!r})")
    if "preset" in value:
        from moe.presets import load_preset

        p = load_preset(value["preset"])
        shape = ProfileShape(p.num_experts, p.top_k, p.hidden_size, p.intermediate_size, p.activation, p.name, ep_size)
    else:
        missing = [k for k in _SHAPE_KEYS[1:5] if k not in value]
        if missing:
            raise MoEConfigError(f"{file}: {at} lacks {missing}; give a preset or all of {', '.join(_SHAPE_KEYS[1:5])}")
        sizes = {k: int(_number(value[k], file, f"{at}.{k}")) for k in _SHAPE_KEYS[1:5]}
        shape = ProfileShape(**sizes, activation=str(value.get("activation", "silu")), ep_size=ep_size)
    if shape.num_experts % ep_size:
        raise MoEConfigError(f"{file}: {at}.ep_size must divide num_experts={shape.num_experts}, the ranks sharing "
                             f"the experts evenly (got {ep_size})")
    return shape
