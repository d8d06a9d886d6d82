"""Policy: what a deployment tells the oracle -- force, deny, prefer, token buckets, measured profiles.

A YAML file (every key optional)::

    force: flashinfer_cutlass        # an Experts and/or a PrepareFinalize name (a string or a list):
                                     #   used for every bucket; if it cannot serve, plan() raises with
                                     #   its reasons -- nothing falls back silently
    deny: [triton_batched]           # names never chosen (reported as rejected "denied by policy")
    prefer: [flashinfer_trtllm]      # in order; a preferred candidate wins a bucket when its estimate is
    prefer_margin: 0.1               #   within this fraction of the best (default 0.1)
    buckets: [1, 16, 128, 1024]      # upper token edges of the buckets (max_tokens closes the last one)
    profiles: [bench-h200.yaml]      # measured profiles, relative to this file (see moe.oracle.profile)

Environment: ``MOE_POLICY=path`` names the file; ``MOE_EXPERTS=name`` forces an Experts backend on
top of it; ``MOE_PROFILE=path[:path]`` adds profiles. ``Policy.from_env()`` reads all three.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable

import yaml

from moe.errors import MoEConfigError

DEFAULT_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)
DEFAULT_PREFER_MARGIN = 0.1
KEYS = ("force", "deny", "prefer", "prefer_margin", "buckets", "profiles")


@dataclass(frozen=True)
class Policy:
    """``Policy(force=("triton",))``; names are checked against the registry when a plan is made."""

    force: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()
    prefer: tuple[str, ...] = ()
    prefer_margin: float = DEFAULT_PREFER_MARGIN
    buckets: tuple[int, ...] = DEFAULT_BUCKETS  # upper edges, increasing
    profiles: tuple[str, ...] = ()  # measured profile files
    source: str = "default"  # where it came from, for messages: a path, "MOE_EXPERTS", "experts=..."

    def __post_init__(self):
        for key in ("force", "deny", "prefer", "profiles"):
            value = getattr(self, key)
            names = (value,) if isinstance(value, str) else value
            if not isinstance(names, (tuple, list)) or not all(isinstance(n, str) and n for n in names):
                raise MoEConfigError(f"policy {self.source}: {key} must be a name or a list of names (got {value!r})")
            object.__setattr__(self, key, tuple(names))
        overlap = sorted(set(self.force) & set(self.deny))
        if overlap:
            raise MoEConfigError(f"policy {self.source}: {overlap} both forced and denied; keep one of force, deny")
        margin = self.prefer_margin
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 10:
            raise MoEConfigError(f"policy {self.source}: prefer_margin must be a number in [0, 10) (got {margin!r})")
        buckets = self.buckets
        if (not isinstance(buckets, (tuple, list)) or not buckets
                or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in buckets)
                or list(buckets) != sorted(set(buckets))):
            raise MoEConfigError(
                f"policy {self.source}: buckets must be a non-empty list of increasing ints >= 1 (got {buckets!r})"
            )
        object.__setattr__(self, "buckets", tuple(buckets))

    # --- construction ---------------------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str | Path) -> "Policy":
        """Reads and validates a policy file; unknown keys and bad values name the key and what is allowed."""
        path = Path(path)
        if not path.is_file():
            what = "is not a file" if path.exists() else "does not exist"
            raise MoEConfigError(f"policy file {str(path)!r} {what}")
        try:
            with open(path, encoding="utf-8") as file:
                data = yaml.safe_load(file)
        except yaml.YAMLError as error:
            where = getattr(error, "problem_mark", None)
            at = f" at line {where.line + 1}" if where is not None else ""
            raise MoEConfigError(f"policy file {str(path)!r} is not valid YAML{at}: "
                                 f"{getattr(error, 'problem', None) or error}") from None
        return cls.from_mapping({} if data is None else data, source=str(path), base=path.parent)

    @classmethod
    def from_mapping(cls, data: Any, *, source: str = "policy", base: Path | None = None) -> "Policy":
        if not isinstance(data, dict):
            raise MoEConfigError(f"policy {source}: must be a mapping of {', '.join(KEYS)} (got {type(data).__name__})")
        unknown = sorted(str(k) for k in data if k not in KEYS)
        if unknown:
            raise MoEConfigError(f"policy {source}: unknown key(s) {unknown}; allowed keys: {', '.join(KEYS)}")
        fields = dict(data)
        if "profiles" in fields and base is not None:
            profiles = fields["profiles"]
            profiles = [profiles] if isinstance(profiles, str) else profiles
            if isinstance(profiles, list):
                fields["profiles"] = [str(base / p) if isinstance(p, str) else p for p in profiles]
        return cls(**fields, source=source)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "Policy":
        """``MOE_POLICY`` (a file), then ``MOE_EXPERTS`` (forces an experts) and ``MOE_PROFILE`` (adds profiles)."""
        env = os.environ if environ is None else environ
        policy = cls.from_file(env["MOE_POLICY"]) if env.get("MOE_POLICY") else cls()
        if env.get("MOE_EXPERTS"):
            from moe.registry import experts_classes

            policy = policy.forcing(env["MOE_EXPERTS"], source="MOE_EXPERTS", replacing=experts_classes())
        extra = tuple(p for p in env.get("MOE_PROFILE", "").split(os.pathsep) if p)
        return replace(policy, profiles=policy.profiles + extra) if extra else policy

    def forcing(self, name: str, *, source: str, replacing: Iterable[str] = ()) -> "Policy":
        """A copy that forces ``name`` too, instead of any forced name in ``replacing`` (names of its kind)."""
        replacing = set(replacing) | {name}
        force = tuple(n for n in self.force if n not in replacing) + (name,)
        return replace(self, force=force, deny=tuple(n for n in self.deny if n != name),
                       source=source if self.source == "default" else f"{self.source} + {source}")

    # --- queries --------------------------------------------------------------------------------
    def bucket_edges(self, max_tokens: int) -> tuple[int, ...]:
        """Upper edges up to ``max_tokens``, which always closes the last bucket."""
        return tuple(b for b in self.buckets if b < max_tokens) + (max_tokens,)

    def check_names(self, experts: set[str], prepare_finalize: set[str]) -> None:
        """Every name in force/deny/prefer must be registered; at most one forced name of each kind."""
        known = experts | prepare_finalize
        for key in ("force", "deny", "prefer"):
            unknown = [n for n in getattr(self, key) if n not in known]
            if unknown:
                raise MoEConfigError(
                    f"policy {self.source}: {key} names unknown backend(s) {unknown}; "
                    f"experts: {', '.join(sorted(experts))}; prepare/finalize: {', '.join(sorted(prepare_finalize))}"
                )
        for kind, names in (("experts", experts), ("prepare/finalize", prepare_finalize)):
            forced = [n for n in self.force if n in names]
            if len(forced) > 1:
                raise MoEConfigError(f"policy {self.source}: force names {len(forced)} {kind} backends {forced}; name one")
