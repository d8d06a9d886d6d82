"""The tuning cache: per-shape tuning results on disk, so that a second load of a layer takes seconds.

Rooted at ``MOE_CACHE_DIR`` (default ``~/.cache/moe``; ``MOE_CACHE_DIR=""`` or ``off`` turns it off).
One entry is one JSON file holding its own key and a checksum of its payload::

    {"format": 1, "key": {...}, "checksum": "<sha256 of the payload>", "payload": ...}

The key (`entry_key`) names the kind of result, the device, the library versions, the problem (E, k,
H, I, activation, quant scheme, dtype, bias, max_tokens, parallel) and the token buckets. The file
name hashes the key without its versions, so an upgrade finds the old entry, reports it stale and
overwrites it after tuning again. An entry that is corrupt, truncated, stale, for another key or
unreadable is ignored with one `CacheWarning` naming the file and why -- never trusted. Writes go
to a temporary file in the same folder, then ``os.replace``: a reader (or a second writer) sees the
old file or the new one, never a torn one. A ``MOE_CACHE_DIR`` that cannot be used (a file, not
writable) gets one warning and the load runs uncached; the cache never fails a load.

>>> cache = TuningCache(Path(tempfile.mkdtemp()))
>>> key = {"kind": "example", "versions": {"moe": "0.1.0"}, "buckets": [1, 8]}
>>> cache.load(key) is None                     # a miss: nothing to warn about
True
>>> path = cache.store(key, {"tactic": 3})
>>> cache.load(key)
{'tactic': 3}
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import tempfile
import warnings
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Iterable

import torch

from moe.errors import CacheWarning
from moe.problem import MoEProblem

ENV_VAR = "MOE_CACHE_DIR"
DEFAULT_DIR = Path("~/.cache/moe")
DISABLED_VALUES = ("", "off")
FORMAT = 1
# import name -> distribution name, for the versions in a key
DISTRIBUTIONS = {"triton": "triton", "flashinfer": "flashinfer-python"}


def cache_dir() -> Path | None:
    """The cache folder ``MOE_CACHE_DIR`` names (created if missing), or None when it is turned off
    or unusable -- the latter with a `CacheWarning` saying why and how to fix it. Read at each call."""
    value = os.environ.get(ENV_VAR)
    if value is not None and value.strip().lower() in DISABLED_VALUES:
        return None
    root = (Path(value) if value is not None else DEFAULT_DIR).expanduser()
    problem = _unusable(root)
    if problem:
        warnings.warn(f"{ENV_VAR}={str(root)!r} {problem}; running without the tuning cache (set {ENV_VAR} "
                      f"to a writable folder, or to 'off' to silence this)", CacheWarning, stacklevel=2)
        return None
    return root


def _unusable(root: Path) -> str | None:
    if root.exists() and not root.is_dir():
        return "is a file, not a folder"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return f"cannot be created ({error.strerror or error})"
    if not os.access(root, os.W_OK | os.X_OK):
        return "is not writable"
    return None


def open_cache() -> TuningCache | None:
    """The `TuningCache` at `cache_dir`, or None (turned off, or unusable: warned)."""
    root = cache_dir()
    return None if root is None else TuningCache(root)


# --- keys --------------------------------------------------------------------------------------


def device_name(device: torch.device | str) -> str:
    """``torch.cuda.get_device_name`` of a CUDA device, "cpu" otherwise."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def library_versions(libraries: Iterable[str] = ()) -> dict[str, str]:
    """Installed versions of torch, moe and ``libraries`` (import names, e.g. "flashinfer"); "absent"
    for one that is not installed. A kind names its libraries, so its key does not depend on what
    else the process happened to import."""
    # moe's own __version__ (this package is imported whenever this module is): a source checkout on
    # PYTHONPATH may differ from an installed distribution of the same name
    found = {"torch": torch.__version__, "moe": getattr(sys.modules.get("moe"), "__version__", "unknown")}
    for name in libraries:
        try:
            found[name] = version(DISTRIBUTIONS.get(name, name))
        except PackageNotFoundError:
            found[name] = "absent"
    return found


def problem_key(problem: MoEProblem) -> dict[str, Any]:
    """The problem's fields that decide what tuning finds, as JSON values."""
    p, ep = problem, problem.parallel
    return {"E": p.num_experts, "k": p.top_k, "H": p.hidden_size, "I": p.intermediate_size,
            "activation": repr(p.activation), "quant": p.quant.name, "dtype": str(p.dtype).removeprefix("torch."),
            "has_bias": p.has_bias, "max_tokens": p.max_tokens,
            "parallel": {"ep_size": ep.ep_size, "ep_rank": ep.ep_rank,
                         "expert_map": None if ep.expert_map is None else list(ep.expert_map)}}


def entry_key(kind: str, problem: MoEProblem, buckets: Iterable[int] | None, device: torch.device | str,
              libraries: Iterable[str] = ()) -> dict[str, Any]:
    """The key of one entry: ``kind`` (what was tuned, e.g. "flashinfer_cutlass.tactics"), the device's
    name, the versions of torch, moe and ``libraries``, the problem and the token ``buckets``."""
    return {"kind": kind, "device": device_name(device), "versions": library_versions(libraries),
            "problem": problem_key(problem), "buckets": None if buckets is None else sorted(set(buckets))}


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# --- the store ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class TuningCache:
    """The entries under ``root``; ``load`` and ``store`` take a key from `entry_key` (any JSON dict
    with a "kind" works)."""

    root: Path

    def path_of(self, key: dict[str, Any]) -> Path:
        """The entry's file: its kind and a hash of its key without the versions (see the module)."""
        kind = "".join(c if c.isalnum() or c in "._-" else "_" for c in str(key.get("kind", "entry")))
        stable = {name: value for name, value in key.items() if name != "versions"}
        return self.root / f"{kind}-{_digest(stable)[:24]}.json"

    def load(self, key: dict[str, Any]) -> Any:
        """The payload stored for ``key``; None for a miss, or (with one `CacheWarning`) for an entry
        that cannot be trusted."""
        path = self.path_of(key)
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as error:
            return warn_ignored(path, f"unreadable ({error})")
        try:
            entry = json.loads(text)
        except json.JSONDecodeError as error:
            return warn_ignored(path, f"corrupt: not valid JSON, truncated? ({error})")
        why = _untrusted(entry, key)
        return warn_ignored(path, why) if why else entry["payload"]

    def store(self, key: dict[str, Any], payload: Any) -> Path | None:
        """Writes ``payload`` (JSON values) as the entry of ``key``, atomically; returns its path, or
        None (with a `CacheWarning`) when it cannot be written."""
        path = self.path_of(key)
        entry = {"format": FORMAT, "key": key, "checksum": _digest(payload), "payload": payload}
        try:
            atomic_write(path, json.dumps(entry, indent=1, sort_keys=True) + "\n")
        except OSError as error:
            warnings.warn(f"tuning cache: cannot write {path} ({error}); the result is not kept for the next load",
                          CacheWarning, stacklevel=2)
            return None
        return path

    def entries(self) -> list[Path]:
        """Every file the cache holds (its entries, and the Triton tables under ``triton/``), by path;
        not the temporary files of writes under way."""
        return sorted(p for p in self.root.rglob("*.json") if p.is_file() and not p.name.startswith(".tmp-"))

    def clear(self) -> int:
        """Deletes every file of `entries` (and leftover temporary files); returns how many entries."""
        entries = self.entries()
        for path in [*entries, *self.root.rglob(".tmp-*")]:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        return len(entries)


def atomic_write(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` through a temporary file in its folder and ``os.replace`` (atomic on
    one file system), so no reader sees a partial file; raises OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _untrusted(entry: Any, key: dict[str, Any]) -> str | None:
    """Why ``entry`` (a parsed file) cannot serve ``key``; None when it can."""
    if not isinstance(entry, dict) or not {"format", "key", "checksum", "payload"} <= entry.keys():
        return "corrupt: not a tuning-cache entry (fields missing)"
    if entry["format"] != FORMAT:
        return f"stale: format {entry['format']!r}, this moe reads format {FORMAT}"
    if entry["checksum"] != _digest(entry["payload"]):
        return "corrupt: the payload does not match its checksum"
    stored = entry["key"]
    if not isinstance(stored, dict):
        return "corrupt: its key is not a mapping"
    if stored.get("versions") != key.get("versions"):
        return f"stale: written with {stored.get('versions')}, running {key.get('versions')}"
    if stored != key:
        differ = sorted(name for name in {*stored, *key} if stored.get(name) != key.get(name))
        return f"wrong key: it was written for another {', '.join(differ)}"
    return None


def warn_ignored(path: Path, why: str) -> None:
    """The one `CacheWarning` of an entry that is not used: its file and ``why``."""
    warnings.warn(f"tuning cache: ignoring {path}: {why}; tuning again", CacheWarning, stacklevel=3)
    return None
