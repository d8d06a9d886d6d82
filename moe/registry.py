"""Where backends register themselves: a decorator for this package's classes and the
``moe.backends`` entry-point group for plugins.

A plugin package declares, in its pyproject.toml::

    [project.entry-points."moe.backends"]
    my_backend = "my_package.experts"      # a module whose import registers its classes

Nothing else in `moe` lists the backends; the oracle, the CLI's support table and the test matrix
iterate this registry.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import TypeVar

from moe.errors import MoEConfigError

T = TypeVar("T", bound=type)

_EXPERTS: dict[str, type] = {}
_PREPARE_FINALIZE: dict[str, type] = {}
# modules of this package that register backends; imported lazily so that `import moe` stays light
_BUILTIN_MODULES = (
    "moe.experts",
    "moe.prepare_finalize",
)
_loaded = False


def _register(table: dict[str, type], kind: str, cls: T) -> T:
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise MoEConfigError(f"{kind} class {cls.__qualname__} needs a class attribute `name` (a non-empty str)")
    existing = table.get(name)
    if existing is not None and existing is not cls:
        raise MoEConfigError(
            f"{kind} name {name!r} is already registered by {existing.__module__}.{existing.__qualname__}; "
            f"pick another name for {cls.__module__}.{cls.__qualname__}"
        )
    table[name] = cls
    return cls


def register_experts(cls: T) -> T:
    """Class decorator: makes an Experts subclass known to the oracle under ``cls.name``."""
    return _register(_EXPERTS, "Experts", cls)


def register_prepare_finalize(cls: T) -> T:
    """Class decorator: makes a PrepareFinalize subclass known to the oracle under ``cls.name``."""
    return _register(_PREPARE_FINALIZE, "PrepareFinalize", cls)


def load_backends() -> None:
    """Imports the built-in backend modules and every ``moe.backends`` entry point (once)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)
    for ep in entry_points(group="moe.backends"):
        ep.load()


def experts_classes() -> dict[str, type]:
    """Registered Experts classes by name, in registration order."""
    load_backends()
    return dict(_EXPERTS)


def prepare_finalize_classes() -> dict[str, type]:
    load_backends()
    return dict(_PREPARE_FINALIZE)


def get_experts(name: str) -> type:
    classes = experts_classes()
    if name not in classes:
        raise MoEConfigError(f"unknown experts backend {name!r}; registered: {sorted(classes)}")
    return classes[name]


def get_prepare_finalize(name: str) -> type:
    classes = prepare_finalize_classes()
    if name not in classes:
        raise MoEConfigError(f"unknown prepare/finalize {name!r}; registered: {sorted(classes)}")
    return classes[name]
