"""Launch configurations: tuned ones as data files per (shape, scheme, device), and a default.

A file in ``configs/`` holds one `ConfigKey`'s table: a `LaunchConfig` per token count M (the
bucket). ``python -m moe tune`` writes them; `ConfigTable.load` reads the one matching a key and
`ConfigTable.lookup` picks the bucket nearest to M (log scale), or the default when there is none.
Tables in the tuning cache (``$MOE_CACHE_DIR/triton/``, where ``moe tune`` writes by default) come
before the packaged ones.

File name: ``E=128,k=8,H=2048,I=768,silu,bf16,standard,NVIDIA_H200.json``; content::

    {"key": {...ConfigKey fields...}, "configs": {"1": {"block_m": 16, "gemm1": {...}, ...}, ...},
     "decode": {"1": {"gemm1": {...DecodeTile fields...}, "gemm2": {...}}, "2": "grouped", "16": "default"}}

The optional ``decode`` section is the shape's own choice for the decode path (fp8 W8A8: `decode.fp8_decode_config`;
the weight-only formats: `decode.decode_config`), by token count, the largest key at or below M: a pair of
`decode.DecodeTile`, ``"grouped"`` (this shape runs the grouped GEMMs there instead) or ``"default"`` (the decode
path's shared config). A file may hold a ``decode`` section and no launch configs (``"configs": {}``): the grouped
GEMMs then take the default, as without the file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from moe.cache import atomic_write, cache_dir, warn_ignored
from moe.errors import MoEConfigError

CONFIG_DIR = Path(__file__).parent / "configs"
BLOCK_MS = (16, 32, 64, 128)  # every block_m a config may use (the workspace covers all of them)


@dataclass(frozen=True)
class TileConfig:
    """The tile of one GEMM's program (BLOCK_M is shared by both GEMMs: see `LaunchConfig`)."""

    block_n: int
    block_k: int
    group_m: int = 1  # m blocks walked together, so that their A tiles stay in L2
    num_warps: int = 4
    num_stages: int = 3
    tma: bool = False  # weight tiles by TMA (SM90+; dense and fp8 weights whose rows are 16-byte multiples)
    # A tiles by TMA too, from rows gathered into sorted order by a separate kernel first
    # (gemm_tma_a.py): dense weights in the activations' dtype, the standard format's sorted path
    tma_a: bool = False
    # fp8_block on SM90: the Gluon GEMM whose K steps overlap one step's wgmma with the previous step's
    # scaling (gemm_wgmma.py): A gathered into sorted order, both operands by TMA into a ring of
    # num_stages buffers, one 128-column scale group per K step. Set on both GEMMs or neither.
    wgmma: bool = False
    # SM90: the warp-specialized, persistent Gluon kernels (gemm_ws.py): a one-warp loader partition fills
    # a ring of num_stages buffers while the num_warps others run the wgmmas and the epilogue; one
    # program per SM walks the tiles (two for a one-warpgroup fp8 tile whose rings fit,
    # gemm_ws.fp8_programs_per_sm); block_m >= 64. On a tma_a tile (dense bf16/fp16) or a wgmma one
    # (fp8_block: the wgmma tile's scaled K steps).
    ws: bool = False
    # ws tiles (dense or fp8_block): the epilogue stages the tile in shared memory and stores it by one TMA
    # store, which runs on under the next tile's K steps. GEMM2 then writes its rows in sorted order, and the sum
    # over k reads them through the layout's slot_rows. The ring and a [block_m, block_n] output tile must fit in
    # shared memory together (gemm_ws.check_shared_memory; an fp8 tile that no longer fits twice runs one program
    # per SM, gemm_ws.fp8_programs_per_sm).
    tma_store: bool = False
    # GEMM1's dense ws tile: no gather kernel first. Its loader (four warps) copies each K step's A rows straight
    # from the unsorted activations by cp.async (16 bytes a copy), the weights still by TMA (gemm_ws.py). Where K is
    # not a multiple of block_k or the rows are not 16-byte multiples apart, the layer gathers them first instead.
    gather: bool = False

    def __post_init__(self):
        if self.tma_a and not self.tma:
            raise MoEConfigError(f"tma_a=True needs tma=True: the TMA-A GEMM loads the weight tiles by TMA "
                                 f"too (got {self})")
        if self.wgmma and (self.block_k != 128 or self.num_stages < 3 or self.tma_a or self.num_warps not in (4, 8)):
            raise MoEConfigError(f"wgmma=True tiles take block_k=128 (one scale group per K step), num_stages >= 3 "
                                 f"(loads run num_stages - 2 steps ahead), num_warps 4 or 8, and tma_a=False "
                                 f"(got {self})")
        if self.ws and (not (self.tma_a or self.wgmma) or self.num_warps not in (4, 8)
                        or self.block_k not in (32, 64, 128) or self.num_stages < 2):
            raise MoEConfigError(f"ws=True tiles are tma_a=True (dense) or wgmma=True (fp8_block) tiles, A gathered "
                                 f"and both operands by TMA, with num_warps 4 or 8, block_k 32, 64 or 128 and "
                                 f"num_stages >= 2 (got {self})")
        if self.tma_store and not self.ws:
            raise MoEConfigError(f"tma_store=True is an epilogue of the ws tiles: it needs ws=True (got {self})")
        if self.gather and not (self.ws and self.tma_a):
            raise MoEConfigError(f"gather=True is a loader of the dense ws tiles: it needs ws=True and tma_a=True "
                                 f"(got {self})")


@dataclass(frozen=True)
class LaunchConfig:
    """Both GEMMs' launch parameters for one M; ``block_m`` also sets the alignment's padding.

    ``direct``: no sorting; one program per (slot, N tile) reads its expert from the top-k ids
    (decode: saves the alignment launch; a repeated expert's weights are read once per slot).
    """

    block_m: int
    gemm1: TileConfig
    gemm2: TileConfig
    direct: bool = False

    def __post_init__(self):
        if self.block_m not in BLOCK_MS:
            raise MoEConfigError(f"block_m must be one of {BLOCK_MS} (got {self.block_m})")
        if self.gemm2.tma_a and not self.gemm1.tma_a:
            raise MoEConfigError(f"gemm2.tma_a=True needs gemm1.tma_a=True: the second GEMM reads its A tiles "
                                 f"from the intermediate rows the first writes in sorted order (got {self})")
        if self.direct and self.gemm1.tma_a:
            raise MoEConfigError(f"tma_a=True tiles need sorted rows; a direct config has none (got {self})")
        if (self.gemm1.ws or self.gemm2.ws) and self.block_m < 64:
            raise MoEConfigError(f"ws=True tiles take block_m >= 64, 64 rows per warpgroup's wgmma (got {self})")
        if self.gemm2.gather or (self.gemm1.gather and not self.gemm2.tma_a):
            raise MoEConfigError(f"gather=True is set on GEMM1 only, with gemm2.tma_a=True: GEMM1 reads the "
                                 f"unsorted activations, GEMM2 the intermediate GEMM1 writes in sorted order "
                                 f"(got {self})")
        if self.gemm1.wgmma != self.gemm2.wgmma or (self.direct and self.gemm1.wgmma):
            raise MoEConfigError(f"wgmma=True is set on both GEMMs of a sorted config or on neither: the second "
                                 f"GEMM reads the sorted fp8 rows the first writes (got {self})")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "LaunchConfig":
        return cls(data["block_m"], TileConfig(**data["gemm1"]), TileConfig(**data["gemm2"]),
                   data.get("direct", False))


@dataclass(frozen=True)
class ConfigKey:
    """What a tuned table is valid for. ``num_experts`` is the local count (E_local)."""

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    activation: str  # the activation's name (gated and non-gated tiles differ)
    scheme: str  # "bf16", "fp16", "fp32", or a quantized scheme's name
    format: str  # "standard" or "batched"
    device: str  # the GPU's name, e.g. "NVIDIA H200"

    @property
    def filename(self) -> str:
        device = re.sub(r"[^A-Za-z0-9]+", "_", self.device).strip("_")
        return (
            f"E={self.num_experts},k={self.top_k},H={self.hidden_size},I={self.intermediate_size},"
            f"{self.activation},{self.scheme},{self.format},{device}.json"
        )


@dataclass(frozen=True)
class ConfigTable:
    """The tuned configs of one key (possibly none), with the default as fallback."""

    key: ConfigKey
    configs: tuple[tuple[int, LaunchConfig], ...] = ()  # (M, config), ascending M
    # (M, "grouped", "default" or the two tiles' fields as ((gemm, ((field, value), ...)), ...): hashable, as the
    # rest of the table; `decode_tiles` gives them back as dicts), ascending M: the module docstring's ``decode``
    # section, which decode.py reads
    decode: tuple[tuple[int, object], ...] = ()

    @classmethod
    def load(cls, key: ConfigKey, directory: Path | None = None) -> "ConfigTable":
        """The table of ``key`` in ``directory``; None: the tuning cache's (`cached_table`), else the
        packaged one. No file: an empty table (the default config)."""
        if directory is None:
            cached = cached_table(key)
            if cached is not None:
                return cached
            directory = CONFIG_DIR
        path = directory / key.filename
        if not path.exists():
            path = sibling_table_path(key, directory)
            if path is None:
                return cls(key)
        return cls.from_json(key, json.loads(path.read_text()))

    @classmethod
    def from_json(cls, key: ConfigKey, data: dict) -> "ConfigTable":
        """A table from a file's content (``{"key": ..., "configs": {M: config}[, "decode": {M: entry}]}``)."""
        configs = sorted((int(m), LaunchConfig.from_dict(c)) for m, c in data["configs"].items())
        decode = sorted((int(m), _decode_entry(m, entry)) for m, entry in data.get("decode", {}).items())
        return cls(key, tuple(configs), tuple(decode))

    def save(self, directory: Path = CONFIG_DIR) -> Path:
        """Writes the table into ``directory`` (atomically: a reader never sees half a file)."""
        path = directory / self.key.filename
        data = {
            "key": dataclasses.asdict(self.key),
            "configs": {str(m): c.to_dict() for m, c in self.configs},
        }
        if self.decode:
            data["decode"] = {str(m): entry if entry in DECODE_CHOICES else decode_tiles(entry) for m, entry in self.decode}
        atomic_write(path, json.dumps(data, indent=1) + "\n")
        return path

    @property
    def tuned(self) -> bool:
        return bool(self.configs)

    def lookup(self, num_tokens: int) -> LaunchConfig:
        """The config of the bucket nearest to ``num_tokens`` (log scale; ties go to the larger
        bucket), else the default. A ``direct`` (unsorted) config is only taken up to twice its
        bucket's M: past that, repeated experts would re-read their weights once per slot."""
        usable = [(m, c) for m, c in self.configs if not c.direct or num_tokens <= 2 * m]
        if not usable:
            return default_config(self.key, num_tokens)
        target = math.log2(max(num_tokens, 1))
        return min(usable, key=lambda mc: (abs(math.log2(mc[0]) - target), -mc[0]))[1]


DECODE_CHOICES = ("grouped", "default")  # a decode entry that names no tiles


def _decode_entry(m: str, entry: object) -> object:
    """A table's ``decode`` entry as read: one of `DECODE_CHOICES`, or its two tiles' fields, frozen (checked as
    `decode.DecodeTile` when the decode path builds them)."""
    if entry in DECODE_CHOICES:
        return entry
    if not isinstance(entry, dict) or set(entry) != {"gemm1", "gemm2"} or not all(
            isinstance(entry[g], dict) for g in entry):
        raise MoEConfigError(f"decode entry {m!r}: expected {{'gemm1': {{...}}, 'gemm2': {{...}}}} of DecodeTile "
                             f"fields or one of {DECODE_CHOICES} (got {entry!r})")
    return tuple((g, tuple(sorted(entry[g].items()))) for g in ("gemm1", "gemm2"))


def decode_tiles(entry: tuple) -> dict[str, dict]:
    """A frozen tiles entry of `ConfigTable.decode` as ``{"gemm1": {field: value}, "gemm2": {...}}``."""
    return {gemm: dict(fields) for gemm, fields in entry}


def triton_cache_dir() -> Path | None:
    """Where ``moe tune`` writes tables by default and `ConfigTable.load` looks first: ``triton/`` in
    the tuning cache (``MOE_CACHE_DIR``); None when the cache is off or unusable."""
    root = cache_dir()
    return None if root is None else root / "triton"


def cached_table(key: ConfigKey) -> ConfigTable | None:
    """The table of ``key`` in the tuning cache, or None: none there, or one that cannot be trusted
    (unreadable, corrupt, or written for another key: one `CacheWarning`, and the packaged table
    serves). Not keyed by library versions, like the packaged tables: a launch config stays correct
    across versions, only its speed may change."""
    folder = triton_cache_dir()
    path = None if folder is None else folder / key.filename
    if path is None or not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data["key"] != dataclasses.asdict(key):
            return warn_ignored(path, f"wrong key: it holds {data['key']}")
        return ConfigTable.from_json(key, data)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:  # MoEConfigError is a ValueError
        return warn_ignored(path, f"corrupt or unreadable ({error!r})")


def default_config(key: ConfigKey, num_tokens: int) -> LaunchConfig:
    """A sane config without tuning, by the rows each expert gets on average."""
    rows_per_expert = num_tokens * key.top_k / max(key.num_experts, 1)
    gated = key.activation != "relu2"
    block_k = 128 if key.scheme in ("fp8_block", "mxfp4") or rows_per_expert <= 32 else 64
    if rows_per_expert <= 16:  # decode: weight streaming, many narrow programs
        tile = TileConfig(block_n=32 if gated else 64, block_k=block_k, num_warps=4, num_stages=4)
        return LaunchConfig(16, tile, TileConfig(64, block_k, 1, 4, 4), direct=num_tokens <= 4)
    if rows_per_expert <= 128:
        tile = TileConfig(block_n=64, block_k=block_k, group_m=1, num_warps=4, num_stages=3)
        return LaunchConfig(32 if rows_per_expert <= 48 else 64, tile, TileConfig(128 if not gated else 64, block_k, 1, 4, 3))
    tile1 = TileConfig(block_n=64 if gated else 128, block_k=block_k, group_m=8, num_warps=8, num_stages=3)
    tile2 = TileConfig(block_n=128, block_k=block_k, group_m=8, num_warps=8, num_stages=3)
    return LaunchConfig(128, tile1, tile2)


def sibling_table_path(key: ConfigKey, directory: Path) -> Path | None:
    """A table of the same problem tuned on a sibling GPU (another preset of the same architecture,
    `moe.oracle.profile.sibling_kinds`: H100 <-> H200, one chip with the same SMs and shared memory)
    for a device that has none of its own: its launch configs fit this device's limits, and they beat
    the untuned default there (H100, Qwen3-30B-A3B bf16: 1.37x at M = 1024;
    benchmarks/results/bf16_nvidia-h100.md)."""
    from moe.oracle.profile import sibling_kinds
    from moe.platform import Platform, preset_named

    mine = preset_named(key.device)
    if mine is None:  # an unknown GPU: no sibling to trust
        return None
    siblings = sibling_kinds(Platform.preset(mine))
    pattern = dataclasses.replace(key, device="DEVICE").filename.replace("DEVICE.json", "*.json")
    for path in sorted(directory.glob(pattern)):
        if preset_named(json.loads(path.read_text())["key"]["device"]) in siblings:
            return path
    return None

